"""DuplexKV on SGLang's MLA pool, and the pools it refuses (issue 37, item 3).

Built on SGLang 0.5.23's own pool classes on a CPU (small sizes, float32 and bf16):
MLATokenToKVPool (one latent buffer per layer) rotates losslessly through the engine and through the
runtime's real rotation path with SGLang's paged allocator and radix tree at page size 16; the host
block's size in bytes follows the latent row. Every pool DuplexKV does not rotate (a sliding-window
pool whose allocator registered no full-to-window map, hybrid linear, DSA, FP4/MXFP8 with scale
buffers, v_head_dim != head_dim) is refused at startup with its class named in the reason and in the
startup handshake, and rotation is off (supported SWAKVPools rotate: test_kv_pools_swa_runtime.py).
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch

from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.duplexkv.engine import RotationEngine
from superinfer_sgl.duplexkv.host_pool import HostKVPool
from superinfer_sgl.duplexkv.pool_layout import layout_of
from superinfer_sgl.integration import handshake
from superinfer_sgl.integration.kv_adapter import UnsupportedKVPool, device_pool_view
from superinfer_sgl.integration.startup import open_engine

memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
RANK, ROPE = 24, 8  # kv_lora_rank, qk_rope_head_dim: latent rows of 32 values
TRANSFER = "triton-direct" if os.environ.get("TRITON_INTERPRET") == "1" else "torch"


def _mla(layers: int, dtype: torch.dtype, page: int, size: int = 64) -> Any:
    return memory_pool.MLATokenToKVPool(size=size, page_size=page, dtype=dtype, kv_lora_rank=RANK,
                                        qk_rope_head_dim=ROPE, layer_num=layers, device="cpu",
                                        enable_memory_saver=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _randomize(buffers: list[torch.Tensor]) -> None:
    for b in buffers:
        _bits(b).copy_(torch.randint(0, 256, _bits(b).shape, dtype=torch.uint8))


# ---- MLA: the engine over SGLang's real pool ---------------------------------------------------
@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
def test_mla_rotation_is_lossless_per_layer(layers: int, dtype: torch.dtype, page: int) -> None:
    pool = _mla(layers, dtype, page)
    dev = device_pool_view(pool)
    assert dev.kind == "mla" and dev.layers == math.ceil(layers / 2) and dev.layer_shape == (64 + page, 1, RANK + ROPE)
    bt = 4
    host = HostKVPool(8, dev.layers, dev.kv_heads, dev.head_dim, bt, dev.dtype, pin=False)
    elem = torch.empty((), dtype=dtype).element_size()
    # one latent row per layer per token (an odd last layer is stored twice: pool_layout.py)
    assert host.bytes_per_token == 2 * math.ceil(layers / 2) * (RANK + ROPE) * elem
    assert layout_of(pool).payload_bytes_per_token == layers * (RANK + ROPE) * elem
    engine = RotationEngine(dev, host, TRANSFER)
    _randomize(pool.kv_buffer)
    src, dst = torch.tensor([3, 9, 4, 17, 30, 31, 2]), torch.arange(40, 47)
    before = [_bits(b[src]).clone() for b in pool.kv_buffer]
    others = [_bits(b).clone() for b in pool.kv_buffer]
    hk = engine.save(src)
    for b in pool.kv_buffer:  # the freed slots get other bytes meanwhile
        b[src] = torch.randn_like(b[src])
    engine.load(hk, dst)
    for layer, b in enumerate(pool.kv_buffer):
        assert torch.equal(_bits(b[dst]), before[layer]), layer
        untouched = torch.ones(b.shape[0], dtype=torch.bool)
        untouched[src], untouched[dst] = False, False
        assert torch.equal(_bits(b)[untouched], others[layer][untouched]), layer
        k, v = pool.get_kv_buffer(layer)  # SGLang's own K/V views see the same rows
        assert torch.equal(_bits(k[dst]), before[layer])
        assert torch.equal(_bits(v[dst]), before[layer][..., : RANK * b.element_size()])
    engine.free(hk)
    assert host.allocator.num_free == host.num_blocks


def test_the_startup_sizes_the_host_pool_from_the_latent_row() -> None:
    pool = _mla(4, torch.bfloat16, 16)
    setup = open_engine(_sched(pool), SuperInferConfig(rotary_pool_gb=0.001, rotation_budget_blocks=4))
    assert setup.engine is not None and setup.disabled_reason is None
    host = setup.engine.host_pool
    assert host.bytes_per_block == 16 * 4 * (RANK + ROPE) * 2  # 16 tokens x 4 latent layers x bf16
    info = _report(pool, SimpleNamespace(engine=setup.engine, disabled_reason=None))
    assert info["kv_pool"] == "MLATokenToKVPool" and info["rotation"] == "on (torch)"


# ---- MLA: the runtime's rotation path at page 16 (SGLang's paged allocator and radix tree) --------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prompt,outputs", [(37, 9), (20, 2)])
def test_mla_rotation_and_resume_through_the_runtime_at_page_16(monkeypatch: pytest.MonkeyPatch,
                                                                 dtype: torch.dtype, prompt: int, outputs: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    import test_runtime_duplex as trd
    from test_kv_pools import PAGE, _paged

    size = 128
    pool = _mla(3, dtype, PAGE, size)
    view = device_pool_view(pool)
    # the harness builds its engine on this pool instead of a synthetic MHA one
    monkeypatch.setattr(trd, "DevicePoolView", SimpleNamespace(synthetic=lambda *a, **k: view))
    monkeypatch.setattr(trd, "HostKVPool", lambda blocks, *a, pin, store_dtype: HostKVPool(
        blocks, view.layers, view.kv_heads, view.head_dim, trd.BT, view.dtype, pin=False))
    h = trd.Harness(monkeypatch, pool=size + PAGE)
    if not hasattr(h.sched, "new_token_ratio_tracker"):
        h.sched.new_token_ratio_tracker = SimpleNamespace(current=1.0)
    _paged(h, size)
    other = _run(h, pool, "a", 30, 5, pool_idx=1)
    b = _run(h, pool, "b", prompt, outputs, pool_idx=2)
    b_slots = h.sched.req_to_token_pool.req_to_token[2, : prompt + outputs].to(torch.int64)
    expected = [_bits(buf[b_slots]).clone() for buf in pool.kv_buffer]
    h.step(rotate_out=("b",))
    assert "b" in h.rt.store.entries
    filler = h.alloc.alloc(h.alloc.available_size() // PAGE * PAGE)  # b's pages get other bytes
    for buf in pool.kv_buffer:
        _bits(buf)[filler] = torch.randint(0, 256, _bits(buf)[filler].shape, dtype=torch.uint8)
    h.alloc.free(filler)
    h.step(resume=("b",))
    assert "b" not in h.rt.store.entries
    restored = (prompt + outputs - 1) // PAGE * PAGE  # a partial last page is recomputed by the extend
    tokens = (b.origin_input_ids + b.output_ids)[:restored]
    match = h.tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    assert match.device_prefix_len == restored
    slots = h.tree.path_device_indices(match.last_device_node)
    for layer, buf in enumerate(pool.kv_buffer):
        assert torch.equal(_bits(buf[slots]), expected[layer][:restored]), layer
    assert torch.all(slots[::PAGE] % PAGE == 0) and other.rid not in h.rt.store.entries


def _run(h: Any, pool: Any, rid: str, prompt: int, outputs: int, pool_idx: int) -> Any:
    """A running request on whole pages whose latent rows hold random bits (Harness.run, any dtype)."""
    from fakes import FakeReq, sampling
    from test_kv_pools import PAGE

    n = prompt + outputs
    slots = h.alloc.alloc(-(-n // PAGE) * PAGE)[:n]
    for buf in pool.kv_buffer:
        _bits(buf)[slots] = torch.randint(0, 256, _bits(buf)[slots].shape, dtype=torch.uint8)
    h.sched.req_to_token_pool.req_to_token[pool_idx, :n] = slots.to(torch.int32)
    kv = SimpleNamespace(req_pool_idx=pool_idx, holds_kv=True, kv_allocated_len=n)
    req = FakeReq(rid, list(range(100, 100 + prompt)), list(range(outputs)), kv, sampling(max_new_tokens=0))
    h.batch.reqs.append(req)
    return req


# ---- refused pools: named in the reason and the handshake, rotation off --------------------------
def _swa() -> Any:
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    return SWAKVPool(size=64, size_swa=32, page_size=1, dtype=torch.float32, head_num=1, head_dim=8,
                     swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu",
                     enable_memory_saver=False)


def _bare(cls: type) -> Callable[[], Any]:
    """An instance of a class SGLang cannot build on a CPU (CUDA-only buffers, a Mamba state pool):
    the refusal reads its class first."""
    return lambda: object.__new__(cls)


def _fp4_mha() -> Any:
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import FP4MXBlock16KVCacheMethod

    return _mha(quant_method=FP4MXBlock16KVCacheMethod())


def _mha(**kw: Any) -> Any:
    return memory_pool.MHATokenToKVPool(size=32, page_size=16, dtype=torch.bfloat16, head_num=1, head_dim=32,
                                        layer_num=2, device="cpu", enable_memory_saver=False, **kw)


def _dsa() -> Any:
    try:
        return memory_pool.DSATokenToKVPool(size=32, page_size=1, dtype=torch.bfloat16, kv_lora_rank=RANK,
                                            qk_rope_head_dim=ROPE, layer_num=1, device="cpu", index_head_dim=16,
                                            enable_memory_saver=False, kv_cache_dim=RANK + ROPE)
    except Exception:  # noqa: BLE001 - its indexer buffers may need CUDA; the class is what is refused
        return object.__new__(memory_pool.DSATokenToKVPool)


REFUSED: dict[str, tuple[Callable[[], Any], str, str]] = {
    "swa": (_swa, "SWAKVPool", "sliding-window pool whose allocator has not registered the full-to-window map"),
    "hybrid-linear": (_bare(memory_pool.HybridLinearKVPool), "HybridLinearKVPool", "recurrent"),
    "dsa": (_dsa, "DSATokenToKVPool", "indexer key cache"),
    "mha-fp4": (_fp4_mha, "MHATokenToKVPool", "scale buffers"),
    "mha-mxfp8": (lambda: memory_pool.MHATokenToKVPoolMXFP8(size=16, page_size=1, dtype=torch.bfloat16, head_num=1,
                                                            head_dim=32, layer_num=1, device="cpu",
                                                            enable_memory_saver=False),
                  "MHATokenToKVPoolMXFP8", "scale buffers"),
    "mla-fp4": (lambda: memory_pool.MLATokenToKVPoolFP4(size=16, page_size=1, dtype=torch.bfloat16,
                                                        kv_lora_rank=32, qk_rope_head_dim=16, layer_num=1,
                                                        device="cpu", enable_memory_saver=False),
                "MLATokenToKVPoolFP4", "scale buffers"),
    "mha-v-head-dim": (lambda: _mha(v_head_dim=16), "MHATokenToKVPool", "v_head_dim != head_dim"),
    "mla-layer-shard": (lambda: _with(_mla(2, torch.bfloat16, 1), layer_shard_enabled=True),
                        "MLATokenToKVPool", "sharded"),
}


def _with(pool: Any, **attrs: Any) -> Any:
    for k, v in attrs.items():
        setattr(pool, k, v)
    return pool


def _sched(pool: Any) -> SimpleNamespace:
    tree = SimpleNamespace(disable=False, supports_prefix_sharing=lambda: True)
    return SimpleNamespace(tree_cache=tree, token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool))


def _report(pool: Any, runtime: Any) -> dict[str, Any]:
    (_, report, _), *_ = handshake.hooks(SuperInferConfig(), ["x"])
    sched = _sched(pool)
    sched.tp_rank, sched._superinfer = 0, runtime
    info = report({}, sched)
    handshake.verify_scheduler_infos([info], SuperInferConfig())  # rotation off still serves
    return info[handshake.INIT_INFO_KEY]


@pytest.mark.parametrize("case", list(REFUSED))
def test_a_pool_we_cannot_rotate_is_named_and_rotation_is_off(case: str, caplog: pytest.LogCaptureFixture) -> None:
    build, name, why = REFUSED[case]
    pool = build()
    assert type(pool).__name__ == name
    with pytest.raises(UnsupportedKVPool, match=f"^{name}: .*{why}.*; rotation is off"):
        device_pool_view(pool)
    with caplog.at_level("INFO"):
        setup = open_engine(_sched(pool), SuperInferConfig(rotary_pool_gb=0.001, rotation_budget_blocks=4))
        assert setup.engine is None and setup.disabled_reason.startswith(f"{name}: ")
        info = _report(pool, SimpleNamespace(engine=None, disabled_reason=setup.disabled_reason))
    assert info["kv_pool"] == name and info["rotation"] == setup.disabled_reason
    assert f"rotation disabled: {name}: " in caplog.text  # the scheduler's log line
    assert f"scheduler 0: KV pool {name}, rotation {name}: " in caplog.text  # the launcher's
