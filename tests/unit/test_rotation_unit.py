"""integration/rotation.py against a real RotationEngine and a synthetic device pool (no server)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from superinfer_sgl.duplexkv.device_pool import DevicePoolView
from superinfer_sgl.duplexkv.engine import RotationEngine
from superinfer_sgl.duplexkv.host_pool import HostKVPool
from fakes import FakeReq as Req
from superinfer_sgl.integration import rotation

LAYERS, HEADS, DIM, BT = 3, 2, 8, 4


@pytest.fixture
def setup(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, RotationEngine, list[Any]]:
    dev = DevicePoolView.synthetic(64, LAYERS, HEADS, DIM, torch.float32)
    for buf in (*dev.k_buffers, *dev.v_buffers):
        buf.copy_(torch.randn_like(buf))
    host = HostKVPool(32, LAYERS, HEADS, DIM, BT, torch.float32, pin=False)
    engine = RotationEngine(dev, host, "torch")
    req_to_token = torch.zeros((4, 256), dtype=torch.int32)
    req_to_token[1, :40] = torch.randperm(63)[:40] + 1  # slots in any order
    released: list[Any] = []
    import sglang.srt.managers.schedule_batch as sb

    monkeypatch.setattr(sb, "release_req", lambda **kw: released.append(kw["req"]))
    sched = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                            token_to_kv_pool_allocator=None, tree_cache=None)
    return sched, engine, released


def _device_bytes(engine: RotationEngine, slots: torch.Tensor) -> list[torch.Tensor]:
    dev = engine.device_pool
    return [b[slots.long()].clone() for b in (*dev.k_buffers, *dev.v_buffers)]


def _host_bytes(engine: RotationEngine, host_kv: Any) -> list[torch.Tensor]:
    data = engine.host_pool.data[list(host_kv.block_ids)]  # [blocks, layers, 2, bt, H, D]
    tok = data.permute(1, 2, 0, 3, 4, 5).reshape(LAYERS, 2, -1, HEADS, DIM)[:, :, : host_kv.num_tokens]
    return [tok[layer, 0] for layer in range(LAYERS)] + [tok[layer, 1] for layer in range(LAYERS)]


def test_untracked_request_rotates_out_all_but_the_last_token(setup: tuple) -> None:
    sched, engine, released = setup
    req = Req("r", list(range(20)), list(range(11)))  # 31 tokens; the last is the next input
    req.kv.kv_allocated_len = 31
    entry = rotation.rotate_out(sched, req, engine, now=1.0)
    assert entry is not None and entry.host_kv.num_tokens == 30 and released == [req]
    slots = sched.req_to_token_pool.req_to_token[1, :30]
    for dev, host in zip(_device_bytes(engine, slots), _host_bytes(engine, entry.host_kv)):
        assert torch.equal(dev.view(torch.int32), host.view(torch.int32))


def test_eager_synced_request_moves_only_its_tail(setup: tuple) -> None:
    sched, engine, _ = setup
    req = Req("r", list(range(20)), list(range(11)))
    req.kv.kv_allocated_len = 31
    rotation.eager_sync(sched, req, engine, max_bytes=None)  # 30 final tokens: 7 full blocks
    assert engine.bytes_eager_out == 7 * BT * engine.host_pool.bytes_per_token
    before = engine.bytes_out
    entry = rotation.rotate_out(sched, req, engine, now=1.0)
    assert entry is not None
    assert engine.bytes_out - before == 2 * engine.host_pool.bytes_per_token  # the 2-token tail
    slots = sched.req_to_token_pool.req_to_token[1, :30]
    for dev, host in zip(_device_bytes(engine, slots), _host_bytes(engine, entry.host_kv)):
        assert torch.equal(dev.view(torch.int32), host.view(torch.int32))


def test_full_host_pool_returns_none_and_keeps_the_request(setup: tuple) -> None:
    sched, engine, released = setup
    req = Req("big", list(range(200)), [1])
    req.kv.kv_allocated_len = 200
    sched.req_to_token_pool.req_to_token[1, :200] = 1 + torch.arange(200) % 63
    assert rotation.rotate_out(sched, req, engine, now=0.0) is None  # 50 blocks > 32
    assert released == [] and engine.host_pool.allocator.num_used == 0
