"""Full duplex rotation (both directions in one call), batching, prefetch and rotation handles.

On a CPU the lanes run synchronously, so these tests check the orchestration: what is copied, into
which blocks, how often, and who holds which block; the Triton paths run under the interpreter.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "triton_kernels"))

from superinfer_sgl.duplexkv import (  # noqa: E402
    DevicePoolView,
    HostKV,
    HostKVPool,
    HostPoolFull,
    RotateIn,
    RotateOut,
    RotationEngine,
    RotationHandle,
)
from superinfer_sgl.duplexkv.transfer import gather_batch, scatter_batches  # noqa: E402

BT = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PATHS = ["torch", "naive", "triton-direct", "triton-dma", "triton-dma-serial", "triton-hybrid"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def make_engine(transfer: str = "torch", blocks: int = 24, rows: int = 128, ring: dict | None = None) -> RotationEngine:
    gen = torch.Generator().manual_seed(0)
    dev = DevicePoolView.synthetic(rows, 2, 2, 8, torch.bfloat16, DEVICE)
    for buf in dev.k_buffers + dev.v_buffers:
        bits(buf).copy_(torch.randint(0, 256, bits(buf).shape, dtype=torch.uint8, generator=gen))
    host = HostKVPool(blocks, 2, 2, 8, BT, torch.bfloat16, pin=None)
    bits(host.data).fill_(0x5A)
    return RotationEngine(dev, host, transfer=transfer, max_programs=4, ring=ring)


def rows_at(engine: RotationEngine, slots: torch.Tensor) -> list[torch.Tensor]:
    d = engine.device_pool
    return [bits(b)[slots.to(d.device)].clone() for b in d.k_buffers + d.v_buffers]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def spy(engine: RotationEngine) -> Counter[str]:
    """Count the transfer path's launches per direction."""
    calls: Counter[str] = Counter()
    path = engine._path
    to_host, to_device = path.to_host, path.to_device

    def host(*args):
        calls["to_host"] += 1
        return to_host(*args)

    def device(*args):
        calls["to_device"] += 1
        return to_device(*args)

    path.to_host, path.to_device = host, device
    return calls


def slots(*ranges: tuple[int, int]) -> torch.Tensor:
    return torch.cat([torch.arange(a, b) for a, b in ranges])


@pytest.mark.parametrize("transfer", PATHS)
def test_rotate_moves_both_directions_in_one_call_byte_exact(transfer):
    engine = make_engine(transfer)
    bpt = engine.device_pool.bytes_per_token
    # two rotary requests saved earlier (odd lengths: partial tail blocks), their device rows reused since
    back1, back2 = slots((0, 7)), torch.tensor([40, 3, 41, 9, 44, 45, 46, 47, 12, 13])
    want1, want2 = rows_at(engine, back1), rows_at(engine, back2)
    hk1, hk2 = engine.save(back1), engine.save(back2)
    # two running requests going out: one with a synced mirror, one plain
    engine.track("a")
    row_a, row_b = slots((60, 73)), torch.tensor([90, 80, 91, 81, 92, 82])
    engine.sync_full_blocks("a", row_a, 9)  # 2 full blocks synced
    out_a, out_b = rows_at(engine, row_a), rows_at(engine, row_b)
    in1, in2 = slots((100, 107)), slots((110, 120))
    before, calls = engine.counters(), spy(engine)
    handle = engine.rotate(out=[("a", row_a, 13), RotateOut(None, row_b, 6)], inn=[(hk1, in1), RotateIn(hk2, in2)])
    assert isinstance(handle, RotationHandle) and handle.done()
    handle.wait()
    handle.synchronize()
    assert calls == Counter(to_host=1, to_device=2)  # one gather; whole blocks + last tail, other tail
    after = engine.counters()
    assert after["bytes_out"] - before["bytes_out"] == (13 - 8 + 6) * bpt
    assert after["bytes_in"] - before["bytes_in"] == (7 + 10) * bpt
    assert (after["rotations_out"], after["rotations_in"]) == (before["rotations_out"] + 2, 2)
    assert same(rows_at(engine, in1), want1) and same(rows_at(engine, in2), want2)
    saved_a, saved_b = handle.saved
    engine.load(saved_a, slots((0, 13)))
    engine.load(saved_b, slots((20, 26)))
    assert same(rows_at(engine, slots((0, 13))), out_a) and same(rows_at(engine, slots((20, 26))), out_b)
    for hk in (hk1, hk2, saved_a, saved_b):
        engine.free(hk)
    engine.untrack("a")
    engine.check_invariants()
    assert engine.host_pool.allocator.num_used == 0


def test_rotate_is_all_or_nothing_when_the_host_pool_is_full():
    engine = make_engine(blocks=4)
    kept = engine.save(slots((0, 8)))
    engine.track("a")
    engine.sync_full_blocks("a", slots((10, 14)), 4)
    snapshot, before = bits(engine.host_pool.data).clone(), engine.counters()
    with pytest.raises(HostPoolFull):  # 1 + 2 blocks needed, 1 free
        engine.rotate(out=[("a", slots((10, 15)), 5), (None, slots((20, 28)), 8)], inn=[(kept, slots((30, 38)))])
    assert engine.counters() == before and engine.synced_tokens("a") == 4
    assert torch.equal(bits(engine.host_pool.data), snapshot) and engine.host_pool.allocator.num_used == 3
    with pytest.raises(ValueError, match="twice"):
        engine.rotate(out=[("a", slots((10, 15)), 5), ("a", slots((10, 15)), 5)])
    engine.free(kept)
    with pytest.raises(ValueError, match="not allocated"):
        engine.load(kept, slots((30, 38)))
    engine.untrack("a")
    engine.check_invariants()
    assert engine.host_pool.allocator.num_used == 0


def test_prefetch_then_load_copies_once():
    engine = make_engine()
    src, dst = slots((0, 11)), slots((50, 61))
    want = rows_at(engine, src)
    hk = engine.save(src)
    calls = spy(engine)
    handle = engine.prefetch(hk, dst)
    assert handle.done() and handle.saved == ()
    assert engine.prefetch(hk, dst) is not None and calls["to_device"] == 1  # asking again: no new copy
    bits(engine.host_pool.data[list(hk.block_ids)]).fill_(0xEE)  # a second copy would bring this back
    engine.load(hk, dst.to(torch.int32))  # same slots, other dtype: still the prefetched copy
    assert same(rows_at(engine, dst), want)
    assert calls["to_device"] == 1 and engine.bytes_in == 11 * engine.device_pool.bytes_per_token
    assert (engine.prefetch_hits, engine.rotations_in) == (1, 1)
    engine.load(hk, dst)  # the prefetch was consumed: this one copies
    assert calls["to_device"] == 2 and engine.prefetch_hits == 1
    engine.free(hk)
    assert engine.host_pool.allocator.num_used == 0


def test_prefetch_is_used_by_rotate_and_only_for_the_same_slots():
    engine = make_engine()
    hk = engine.save(slots((0, 9)))
    want = rows_at(engine, slots((0, 9)))
    engine.prefetch(hk, slots((50, 59)))
    calls = spy(engine)
    engine.rotate(inn=[(hk, slots((70, 79)))]).synchronize()  # other slots: copied again
    assert calls["to_device"] >= 1 and engine.prefetch_hits == 0
    n = calls["to_device"]
    handle = engine.rotate(inn=[(hk, slots((50, 59)))])
    assert calls["to_device"] == n and engine.prefetch_hits == 1 and len(handle.events) == 1
    assert same(rows_at(engine, slots((50, 59))), want) and same(rows_at(engine, slots((70, 79))), want)
    engine.free(hk)
    engine.check_invariants()
    assert engine.host_pool.allocator.num_used == 0


def test_an_unused_prefetch_holds_its_blocks_until_the_host_kv_is_freed():
    engine = make_engine()
    hk = engine.save(slots((0, 6)))
    engine.prefetch(hk, slots((50, 56)))
    alloc = engine.host_pool.allocator
    assert [alloc.refcount(b) for b in hk.block_ids] == [2, 2]  # the caller's and the prefetch's
    engine.free(hk)
    assert alloc.num_used == 0
    again = engine.save(slots((10, 16)))  # may get the same block ids: an equal HostKV
    calls = spy(engine)
    engine.load(again, slots((50, 56)))  # must copy: the old prefetch is gone with its HostKV
    assert calls["to_device"] == 1 and same(rows_at(engine, slots((50, 56))), rows_at(engine, slots((10, 16))))
    engine.free(again)
    assert alloc.num_used == 0


def test_freeing_a_host_kv_cancels_prefetches_of_its_prefix():
    engine = make_engine()
    hk = engine.save(slots((0, 10)))
    prefix = HostKV(hk.block_ids[:2], 8, BT)  # what a resume restoring whole pages only loads
    engine.prefetch(prefix, slots((50, 58)))
    engine.free(hk)
    assert engine.host_pool.allocator.num_used == 0
    hk = engine.save(slots((0, 10)))
    engine.prefetch(hk, slots((50, 60)))
    engine.cancel_prefetch(hk)
    calls = spy(engine)
    engine.load(hk, slots((50, 60)))
    assert calls["to_device"] == 1 and engine.prefetch_hits == 0
    engine.free(hk)
    assert engine.host_pool.allocator.num_used == 0


@pytest.mark.parametrize("transfer", ["torch", "naive"])
def test_in_after_out_brings_kv_into_the_slots_being_saved(transfer):
    """A resume given the slots an outgoing request just freed: the in copy must run after the out
    copy has read them (in_after_out), so the saved KV is the old bytes and the device the new."""
    engine = make_engine(transfer)
    freed, elsewhere = slots((0, 10)), slots((30, 40))
    want_in = rows_at(engine, elsewhere)
    hk_in = engine.save(elsewhere)
    want_out = rows_at(engine, freed)
    handle = engine.rotate(out=[(None, freed, 10)], inn=[(hk_in, freed)], in_after_out=True)
    handle.synchronize()
    assert same(rows_at(engine, freed), want_in)
    engine.load(handle.saved[0], slots((60, 70)))
    assert same(rows_at(engine, slots((60, 70))), want_out)
    engine.free(hk_in)
    engine.free(handle.saved[0])
    assert engine.host_pool.allocator.num_used == 0


def test_prefetch_byte_counters():
    engine = make_engine()
    bpt = engine.device_pool.bytes_per_token
    hk = engine.save(slots((0, 11)))
    engine.prefetch(hk, slots((50, 61)))
    assert engine.is_prefetched(hk)
    assert (engine.bytes_in, engine.bytes_prefetched, engine.bytes_prefetch_hits) == (11 * bpt, 11 * bpt, 0)
    engine.rotate(inn=[(hk, slots((50, 61)))]).synchronize()  # served by the prefetch: no second copy
    assert not engine.is_prefetched(hk)
    assert (engine.bytes_in, engine.bytes_prefetched, engine.bytes_prefetch_hits) == (11 * bpt, 11 * bpt, 11 * bpt)
    engine.prefetch(hk, slots((70, 81)))
    engine.cancel_prefetch(hk)
    engine.prefetch(hk, slots((70, 81)))
    engine.free(hk)  # cancels the prefetch of what it frees
    assert engine.counters()["prefetches_cancelled"] == 2 and engine.bytes_prefetched == 33 * bpt
    assert engine.host_pool.allocator.num_used == 0


def test_empty_rotation_and_handle():
    engine = make_engine()
    handle = engine.rotate()
    assert handle == RotationHandle() and handle.done()
    handle.wait()
    handle.synchronize()
    empty = engine.rotate(out=[(None, torch.tensor([], dtype=torch.int64), 0)]).saved[0]
    assert empty == HostKV((), 0, BT)


def test_batches_pad_gathers_and_split_scatters():
    s = [torch.arange(0, 5), torch.arange(10, 18), torch.arange(20, 23)]
    b = [[0, 1], [2, 3], [4]]
    slots_cat, blocks = gather_batch(list(zip(s, b)), BT)
    assert blocks == [0, 1, 2, 3, 4]
    assert slots_cat.tolist() == [0, 1, 2, 3, 4, 4, 4, 4, *range(10, 18), 20, 21, 22]
    batches = scatter_batches(list(zip(s, b)), BT)
    assert [(x.tolist(), y) for x, y in batches] == [
        ([0, 1, 2, 3, *range(10, 18), 20, 21, 22], [0, 2, 3, 4]),
        ([4], [1]),
    ]
    assert scatter_batches([], BT) == []


# the CUDA tests' paths: the ring with many chunks of 4 blocks on 2 slots (512 B blocks here), with its
# defaults, the serial form, and the hybrid
CUDA_PATHS = [("triton-dma", dict(ring_slots=2, ring_slot_bytes=2048)), ("triton-dma", None),
              ("triton-dma-serial", None), ("triton-hybrid", dict(ring_slots=2, ring_slot_bytes=2048))]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transfer,ring", CUDA_PATHS)
def test_cuda_rotate_overlaps_and_orders_the_next_forward(transfer, ring):
    engine = make_engine(transfer, blocks=128, rows=1024, ring=ring)
    out_slots, in_slots = torch.arange(0, 200, device="cuda"), torch.arange(400, 600, device="cuda")
    want_in = rows_at(engine, torch.arange(200, 400, device="cuda"))
    hk_in = engine.save(torch.arange(200, 400, device="cuda"))
    want_out = rows_at(engine, out_slots)
    handle = engine.rotate(out=[(None, out_slots, 200)], inn=[(hk_in, in_slots)])
    handle.wait()  # the current stream now runs after both copies
    for buf in engine.device_pool.k_buffers + engine.device_pool.v_buffers:
        bits(buf)[out_slots] = 0  # a forward pass reusing the freed slots
    assert same(rows_at(engine, in_slots), want_in)
    handle.synchronize()
    engine.load(handle.saved[0], out_slots)
    assert same(rows_at(engine, out_slots), want_out)
    engine.free(hk_in)
    engine.free(handle.saved[0])
    engine.quiesce()
    assert engine.host_pool.allocator.num_used == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transfer,ring", CUDA_PATHS)
def test_cuda_in_after_out_orders_a_resume_into_slots_still_being_saved(transfer, ring):
    engine = make_engine(transfer, blocks=1100, rows=8192, ring=ring)
    freed, elsewhere = torch.arange(0, 2000, device="cuda"), torch.arange(4000, 6000, device="cuda")
    want_in = rows_at(engine, elsewhere)
    hk_in = engine.save(elsewhere)
    want_out = rows_at(engine, freed)
    handle = engine.rotate(out=[(None, freed, 2000)], inn=[(hk_in, freed)], in_after_out=True)
    handle.synchronize()
    assert same(rows_at(engine, freed), want_in)
    engine.load(handle.saved[0], torch.arange(6000, 8000, device="cuda"))
    assert same(rows_at(engine, torch.arange(6000, 8000, device="cuda")), want_out)
    engine.free(hk_in)
    engine.free(handle.saved[0])
    engine.quiesce()
    assert engine.host_pool.allocator.num_used == 0
