"""The int4 wiring: every transfer path on int4 host blocks, one engine per precision
(duplexkv/by_format.py), and the host-bytes gauge's rows by class and format."""
from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "triton_kernels"))

from superinfer_sgl.duplexkv import DevicePoolView, HostKVPool, RotationEngine, quant_int4 as q4  # noqa: E402
from superinfer_sgl.duplexkv.by_format import EnginesByFormat  # noqa: E402
from superinfer_sgl.duplexkv.engine import RotateOut  # noqa: E402
from superinfer_sgl.integration.step_figures import host_bytes  # noqa: E402

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
PATHS = ["torch", "triton-direct", "triton-dma", "triton-dma-serial"]


def device(dtype, layers=2, heads=3, dim=40, rows=48):
    gen = torch.Generator().manual_seed(5)
    dev = DevicePoolView.synthetic(rows, layers, heads, dim, dtype, "cpu")
    for buf in dev.k_buffers + dev.v_buffers:
        buf.copy_((torch.randn(buf.shape, generator=gen) * 3).to(dtype))
    return dev


def rows_of(dev, slots):
    return [b[slots].clone() for b in dev.k_buffers + dev.v_buffers]


def zero(dev, slots):
    for b in dev.k_buffers + dev.v_buffers:
        b[slots] = 0


@pytest.mark.parametrize("transfer", PATHS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_engine_rotates_int4_within_the_bound_and_paths_agree(transfer, dtype):
    dev = device(dtype)
    eng = RotationEngine(dev, HostKVPool(8, 2, 3, 40, 4, dtype, pin=False, kv_format="int4"), transfer, max_programs=4)
    slots = torch.tensor([7, 3, 30, 31, 32, 11, 1, 40, 41, 2])
    before = rows_of(dev, slots)
    hk = eng.save(slots)
    want = [q4.dequantize(q4.quantize(x), 40, dtype) for x in before]
    zero(dev, slots)
    eng.load(hk, slots)
    for x, y, w in zip(before, rows_of(dev, slots), want):
        assert torch.equal(y.view(torch.uint8), w.view(torch.uint8))  # the torch reference, bit for bit
        assert bool(((x.float() - y.float()).abs() <= q4.error_bound(x)).all())
    assert eng.bytes_out == 10 * 2 * 2 * 3 * q4.row_bytes(40)
    eng.free(hk)
    eng.check_invariants()


def test_mixed_formats_route_by_class_and_exact_classes_stay_bit_exact():
    dev = device(torch.bfloat16)
    pools = HostKVPool.for_formats(dev, 4, ["auto", "int4", "fp8_e4m3"], gb=0.001)
    eng = EnginesByFormat(dev, pools, "auto", "torch", class_formats={"gold": "auto", "batch": "int4", "std": "fp8_e4m3"})
    reqs = {"a": ("gold", torch.arange(0, 9)), "b": ("batch", torch.arange(9, 19)), "c": ("std", torch.arange(19, 26)),
            "d": (None, torch.arange(26, 30))}
    for rid, (cls, _) in reqs.items():
        eng.track_class(rid, cls)
    before = {rid: rows_of(dev, s) for rid, (_, s) in reqs.items()}
    # rotation 1: everything out in one call; 2: back in, with a exact request going out again meanwhile
    h = eng.rotate(out=[RotateOut(rid, s, s.numel()) for rid, (_, s) in reqs.items()])
    saved = dict(zip(reqs, h.saved))
    assert [hk.kv_format for hk in h.saved] == ["auto", "int4", "fp8_e4m3", "auto"]
    assert eng.host_bytes_held[("batch", "int4")] == 3 * pools["int4"].bytes_per_block
    assert eng.bytes_out_by[("gold", "auto")] == 9 * pools["auto"].bytes_per_token
    for _, s in reqs.values():
        zero(dev, s)
    h2 = eng.rotate(inn=[(saved[r], reqs[r][1]) for r in reqs], in_after_out=True)
    h2.synchronize()
    for rid in ("a", "d"):  # exact: every byte back
        for x, y in zip(before[rid], rows_of(dev, reqs[rid][1])):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))
    for x, y in zip(before["b"], rows_of(dev, reqs["b"][1])):
        assert not torch.equal(x, y) and bool(((x.float() - y.float()).abs() <= q4.error_bound(x)).all())
    # a prefix keeps its pool
    pre = saved["b"].prefix(4)
    assert pre.kv_format == "int4"
    for hk in saved.values():
        eng.free(hk)
    assert sum(eng.host_bytes_held.values()) == 0
    eng.check_invariants()
    assert eng.rotations_out == 4 and eng.counters()["rotations_in"] == 4


def test_host_bytes_rows_by_class_and_format():
    dev = device(torch.float32)
    one = RotationEngine(dev, HostKVPool(8, 2, 3, 40, 4, torch.float32, pin=False, kv_format="int4"), "torch")
    assert host_bytes(one, SimpleNamespace(host_blocks=3)) == (("all", "int4", 3 * one.host_pool.bytes_per_block),)
    assert host_bytes(None, SimpleNamespace(host_blocks=0)) == ()
    pools = HostKVPool.for_formats(dev, 4, ["auto", "int4"], gb=0.001)
    eng = EnginesByFormat(dev, pools, "auto", "torch", class_formats={"batch": "int4"})
    eng.track_class("b", "batch")
    eng.track_class("x", None)
    h = eng.rotate(out=[RotateOut("b", torch.arange(0, 9), 9), RotateOut("x", torch.arange(9, 14), 5)])
    rows = dict(((cls, fmt), n) for cls, fmt, n in host_bytes(eng, SimpleNamespace(host_blocks=0)))
    assert rows == {("batch", "int4"): 3 * pools["int4"].bytes_per_block,
                    ("default", "auto"): 2 * pools["auto"].bytes_per_block}
    for hk in h.saved:
        eng.free(hk)
    assert all(n == 0 for _, _, n in host_bytes(eng, SimpleNamespace(host_blocks=0)))


def test_pool_usage_counts_every_formats_pool():
    from superinfer_sgl.integration.rotary_store import RotaryStore
    from superinfer_sgl.integration.rotation import RotationStats

    dev = device(torch.float32)
    pools = HostKVPool.for_formats(dev, 4, ["auto", "int4"], gb=0.001)
    eng = EnginesByFormat(dev, pools, "auto", "torch", class_formats={"batch": "int4"})
    store = RotaryStore(None, eng, RotationStats())
    total = pools["auto"].num_blocks + pools["int4"].num_blocks
    assert store.pool_usage() == (0, total)
    eng.track_class("b", "batch")
    room = min(pools["auto"].num_blocks, pools["int4"].num_blocks)
    assert eng.room_blocks(enough=1) == room  # the policy's room: the fullest format's
    h = eng.rotate(out=[RotateOut("b", torch.arange(0, 9), 9)])  # int4 blocks only
    assert store.pool_usage() == (3, total)
    assert eng.room_blocks(enough=1) == min(pools["auto"].num_blocks, pools["int4"].num_blocks - 3)
    eng.free(h.saved[0])
    assert store.pool_usage() == (0, total)


def test_untrack_all_drops_every_formats_mirrors():
    """A retract pause (SGLang's weight update) recomputes every request: the mirrors of each
    precision's engine go, their host blocks back in the pools."""
    dev = device(torch.float32)
    pools = HostKVPool.for_formats(dev, 4, ["auto", "int4"], gb=0.001)
    eng = EnginesByFormat(dev, pools, "auto", "torch", class_formats={"batch": "int4"})
    eng.track_class("b", "batch")
    eng.track_class("x", None)
    for rid, slots in (("b", torch.arange(0, 9)), ("x", torch.arange(9, 17))):
        eng.track(rid)
        assert eng.sync_full_blocks(rid, slots, slots.numel()) == 2
    eng.quiesce()
    assert pools["auto"].allocator.num_used == 2 and pools["int4"].allocator.num_used == 2
    eng.untrack_all()
    eng.quiesce()
    assert pools["auto"].allocator.num_used == 0 and pools["int4"].allocator.num_used == 0
    assert eng.format_of("b") == "auto"  # the class record went with the mirror
    eng.check_invariants()
