"""The staging ring (duplexkv/staging_ring.py) behind the pipelined triton-dma path, and how `auto`
picks a path by its probe (duplexkv/link_probe.py).

Without a GPU the ring's stream protocol is checked on a simulated device: every operation is queued
on its stream and the queues run in random interleavings that respect stream order and event waits
(what a GPU may do), with the torch reference kernels; a ring that skipped a wait is caught. The
engine-level tests run the real kernels under TRITON_INTERPRET=1; the CUDA-marked ones the compiled
kernels on real streams.
"""

from __future__ import annotations

import math
import os
import random
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "triton_kernels"))

from superinfer_kernels import gather_kv_blocks_reference, scatter_kv_blocks_reference  # noqa: E402

from superinfer_sgl.config import KV_TRANSFERS  # noqa: E402
from superinfer_sgl.duplexkv import DevicePoolView, HostKVPool, RotationEngine  # noqa: E402
from superinfer_sgl.duplexkv.link_probe import (  # noqa: E402
    PROBE_CANDIDATES,
    choose_transfer,
    pick_by_probe,
    probe_transfers,
)
from superinfer_sgl.duplexkv.staging_ring import StagingRing, runs  # noqa: E402
from superinfer_sgl.duplexkv.transfer import RING_PATHS, TRANSFERS, make_path  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def pools(rows: int, blocks: int, bt: int, layers: int = 2, heads: int = 2, dim: int = 8, device: str = "cpu",
          dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[DevicePoolView, HostKVPool]:
    gen = torch.Generator().manual_seed(seed)
    dev = DevicePoolView.synthetic(rows, layers, heads, dim, dtype, device)
    for buf in dev.k_buffers + dev.v_buffers:
        bits(buf).copy_(torch.randint(0, 256, bits(buf).shape, dtype=torch.uint8, generator=gen))
    host = HostKVPool(blocks, layers, heads, dim, bt, dtype, pin=None)
    bits(host.data).fill_(0x5A)
    return dev, host


def rows_at(dev: DevicePoolView, slots: torch.Tensor) -> list[torch.Tensor]:
    return [bits(b)[slots.to(dev.device)].clone() for b in dev.k_buffers + dev.v_buffers]


# ---------------------------------------------------------------- a simulated device: queued streams


class _Event:
    def __init__(self, stream: str) -> None:
        self.stream, self.done, self.callbacks = stream, False, []


class SimStreams:
    """StreamOps whose operations wait in per-stream queues until drain() runs them in a random
    interleaving that keeps each stream's order and every event wait, as a GPU may."""

    def __init__(self, drop_waits=lambda waiter, event: False) -> None:
        self.queues: dict[str, list[tuple[str, object]]] = {}
        self.lane = "lane0"
        self.drop_waits = drop_waits  # mutation: (waiting stream, event) -> skip this wait

    def current(self) -> str:
        return self.lane

    def helper(self, lane: str) -> str:
        return lane + "/helper"

    def run(self, stream: str, fn) -> None:  # type: ignore[no-untyped-def]
        self.queues.setdefault(stream, []).append(("op", fn))

    def record(self, stream: str) -> _Event:
        event = _Event(stream)
        self.queues.setdefault(stream, []).append(("record", event))
        return event

    def wait(self, stream: str, event: _Event | None) -> None:
        if event is not None and not self.drop_waits(stream, event):
            self.queues.setdefault(stream, []).append(("wait", event))

    def keep(self, t: torch.Tensor, stream: str) -> None:
        return None

    def synchronize(self, stream: str) -> None:
        return None

    def drain(self, rng: random.Random) -> None:
        while any(self.queues.values()):
            ready = [s for s, q in self.queues.items() if q and (q[0][0] != "wait" or q[0][1].done)]
            assert ready, "deadlock: every stream waits on an event never recorded"
            kind, item = self.queues[rng.choice(ready)].pop(0)
            if kind == "op":
                item()
            elif kind == "record":
                item.done = True
                for callback in item.callbacks:
                    callback()


def ref_gather(dev: DevicePoolView):  # type: ignore[no-untyped-def]
    return lambda slots, staged, ids: gather_kv_blocks_reference(dev.k_buffers, dev.v_buffers, slots, staged, ids)


def ref_scatter(dev: DevicePoolView):  # type: ignore[no-untyped-def]
    return lambda slots, staged, ids: scatter_kv_blocks_reference(dev.k_buffers, dev.v_buffers, slots, staged, ids)


def sim_round_trip(seed: int, ring_slots: int, slot_blocks: int, n_tokens: int, bt: int, drop_waits=None) -> bool:
    """Out then in through one ring on simulated streams; True when every byte came back."""
    rng = random.Random(seed)
    dev, host = pools(rows=160, blocks=40, bt=bt, seed=seed)
    sim = SimStreams(drop_waits or (lambda waiter, event: False))
    out_ring = StagingRing([host.data], "cpu", ring_slots, slot_blocks * host.bytes_per_block, streams=sim)
    in_ring = StagingRing([host.data], "cpu", ring_slots, slot_blocks * host.bytes_per_block, streams=sim)
    src = torch.tensor(rng.sample(range(80), n_tokens))
    dst = torch.tensor(rng.sample(range(80, 160), n_tokens))
    nb = math.ceil(n_tokens / bt)
    blocks = rng.sample(range(40), nb)  # scattered host blocks, with a run or two by chance
    want = rows_at(dev, src)
    out_ring.to_host(ref_gather(dev), src, blocks, bt)
    sim.drain(rng)
    in_ring.to_device(ref_scatter(dev), blocks, dst, bt)
    sim.drain(rng)
    return all(torch.equal(a, b) for a, b in zip(rows_at(dev, dst), want))


@pytest.mark.parametrize("ring_slots,slot_blocks,n_tokens,bt", [
    (2, 1, 1, 4),     # one token
    (2, 2, 17, 4),    # odd count, partial tail block, chunk boundary inside the transfer
    (3, 2, 45, 4),    # more blocks than slots x slot size: the ring wraps around
    (1, 3, 30, 5),    # one slot: every chunk waits for the one before
    (3, 1, 9, 1),     # one token per block (page size 1)
])
def test_ring_round_trips_byte_exact_in_any_stream_interleaving(ring_slots, slot_blocks, n_tokens, bt):
    for seed in range(6):
        assert sim_round_trip(seed, ring_slots, slot_blocks, n_tokens, bt), seed


@pytest.mark.parametrize("direction", ["out", "in"])
def test_the_simulation_catches_a_ring_that_reuses_a_slot_too_early(direction):
    """Drop the waits that guard a slot's reuse (out: the gather for the slot's DMA; in: the DMA into
    it for its scatter): some interleaving then corrupts bytes, so the test above has teeth."""
    def drop(waiter: str, event: _Event) -> bool:
        reuse = waiter.endswith("/helper") and not event.stream.endswith("/helper")  # out: helper waits on lane
        if direction == "in":
            reuse = not waiter.endswith("/helper") and event.stream.endswith("/helper")
        return reuse

    results = [sim_round_trip(seed, 2, 1, 40, 4, drop) for seed in range(20)]
    assert not all(results)


def test_two_lanes_sharing_a_ring_never_overwrite_each_others_slots():
    """The engine's out and eager lanes share the out ring: copies issued on both before any runs."""
    for seed in range(8):
        rng = random.Random(seed)
        dev, host = pools(rows=128, blocks=40, bt=4, seed=seed)
        sim = SimStreams()
        ring = StagingRing([host.data], "cpu", 2, host.bytes_per_block, streams=sim)
        a, b = torch.arange(0, 22), torch.arange(40, 61)
        sim.lane = "eager"
        ring.to_host(ref_gather(dev), a, list(range(0, 6)), 4)
        sim.lane = "out"
        ring.to_host(ref_gather(dev), b, [20, 21, 30, 31, 32, 7], 4)
        sim.drain(rng)
        check, _ = pools(rows=128, blocks=40, bt=4, seed=seed)
        for slots, blk in ((a, list(range(0, 6))), (b, [20, 21, 30, 31, 32, 7])):
            ref = torch.zeros_like(host.data)
            gather_kv_blocks_reference(check.k_buffers, check.v_buffers, slots, ref, torch.tensor(blk))
            for j, block in enumerate(blk):
                rows = min(4, slots.numel() - 4 * j)
                assert torch.equal(bits(host.data[block, :, :, :rows]), bits(ref[block, :, :, :rows])), (seed, block)


def test_the_lanes_event_covers_the_scatters():
    """What the engine holds host blocks until (the lane's event) must come after every scatter."""
    for seed in range(6):
        rng = random.Random(seed)
        dev, host = pools(rows=128, blocks=40, bt=4, seed=seed)
        sim = SimStreams()
        ring = StagingRing([host.data], "cpu", 2, host.bytes_per_block, streams=sim)
        src, dst = torch.arange(0, 30), torch.arange(64, 94)
        want = rows_at(dev, src)
        ring.to_host(ref_gather(dev), src, list(range(8)), 4)
        ring.to_device(ref_scatter(dev), list(range(8)), dst, 4)
        lane_done = sim.record("lane0")
        seen = []
        lane_done.callbacks.append(lambda: seen.append(all(torch.equal(x, y) for x, y in zip(rows_at(dev, dst), want))))
        sim.drain(rng)
        assert seen == [True], seed


def test_chunks_go_round_robin_across_calls_and_runs_split_at_gaps():
    _, host = pools(rows=8, blocks=40, bt=4)
    ring = StagingRing([host.data], "cpu", 3, 2 * host.bytes_per_block)
    assert list(ring.chunks(5)) == [(0, 2, 0), (2, 4, 1), (4, 5, 2)]
    assert list(ring.chunks(1)) == [(0, 1, 0)]
    assert list(runs([4, 5, 6, 9, 3, 4])) == [(0, 4, 3), (3, 9, 1), (4, 3, 2)]
    assert StagingRing([host.data], "cpu", 2, 1).slot_blocks == 1  # a block larger than a slot
    assert StagingRing([host.data], "cpu", 2, 10**12).slot_blocks == 40  # never more than the pool
    with pytest.raises(ValueError):
        StagingRing([host.data], "cpu", 0, 1)


# ---------------------------------------------------------------- the ring paths through the engine


def ring_engine(transfer: str, ring_slots: int, slot_blocks: int, bt: int = 4, dtype=torch.bfloat16,
                rows: int = 96, blocks: int = 24) -> RotationEngine:
    dev, host = pools(rows, blocks, bt, device=DEVICE, dtype=dtype)
    ring = dict(ring_slots=ring_slots, ring_slot_bytes=slot_blocks * host.bytes_per_block)
    return RotationEngine(dev, host, transfer=transfer, max_programs=4, ring=ring)


@pytest.mark.parametrize("transfer", RING_PATHS)
@pytest.mark.parametrize("ring_slots,slot_blocks,n,bt", [
    (2, 1, 1, 4), (2, 2, 13, 4), (2, 1, 23, 3), (3, 2, 31, 2),
])
def test_ring_paths_round_trip_bit_exact_across_chunks(transfer, ring_slots, slot_blocks, n, bt):
    engine = ring_engine(transfer, ring_slots, slot_blocks, bt)
    src = torch.randperm(48, generator=torch.Generator().manual_seed(n))[:n]
    dst = torch.arange(95 - n, 95)
    want = rows_at(engine.device_pool, src)
    hk = engine.save(src)
    assert len(hk.block_ids) == math.ceil(n / bt)
    engine.load(hk, dst)
    assert all(torch.equal(a, b) for a, b in zip(rows_at(engine.device_pool, dst), want))
    engine.free(hk)
    engine.check_invariants()


def test_ring_path_writes_the_torch_paths_host_bytes_duplex_and_fp8():
    """Both directions in one rotate() over more chunks than slots; fp8 blocks stage their scales too."""
    for dtype, rotary in ((torch.bfloat16, None), (torch.float32, "fp8")):
        engines = []
        for transfer in ("torch", "triton-dma"):
            dev, host = pools(96, 24, 4, device=DEVICE, dtype=torch.float32 if rotary else dtype)
            if rotary:  # finite values (random bits would hold NaNs), fp8 codes and scales
                gen = torch.Generator().manual_seed(1)
                for buf in dev.k_buffers + dev.v_buffers:
                    buf.copy_(torch.randn(buf.shape, generator=gen) * 3)
                host = HostKVPool(24, 2, 2, 8, 4, torch.float32, pin=None, store_dtype=torch.float8_e4m3fn)
            ring = dict(ring_slots=2, ring_slot_bytes=host.bytes_per_block) if transfer == "triton-dma" else {}
            engines.append(RotationEngine(dev, host, transfer=transfer, max_programs=4, ring=ring))
        got = []
        for engine in engines:
            parked = engine.save(torch.arange(40, 58))
            handle = engine.rotate(out=[(None, torch.arange(0, 22), 22)], inn=[(parked, torch.arange(70, 88))])
            handle.synchronize()
            host = engine.host_pool
            ids = list(handle.saved[0].block_ids[:5]) + list(parked.block_ids[:4])
            got.append((bits(host.data[ids]).clone(), host.scales[ids].clone() if host.quantized else None,
                        rows_at(engine.device_pool, torch.arange(70, 88))))
        (d0, s0, r0), (d1, s1, r1) = got
        assert torch.equal(d0, d1) and all(torch.equal(a, b) for a, b in zip(r0, r1))
        assert s0 is None or torch.equal(s0, s1)


def test_transfer_names_and_ring_options():
    assert set(KV_TRANSFERS) <= set(TRANSFERS) and {"triton-dma-serial", "triton-hybrid"} <= set(TRANSFERS)
    dev, host = pools(16, 4, 4)
    path = make_path("triton-dma", dev, host, 4, ring_slots=2, ring_slot_bytes=host.bytes_per_block)
    assert set(path.rings) == {"out", "in"} and path.rings["out"].slots == 2 and path.rings["in"].slot_blocks == 1
    assert set(make_path("triton-hybrid", dev, host, 4).rings) == {"in"}  # out is triton-direct's kernel
    assert not hasattr(make_path("naive", dev, host, 4, ring_slots=2), "rings")  # no ring: options ignored
    with pytest.raises(ValueError, match="ring_slot_bytes"):
        make_path("triton-dma", dev, host, 4, slot_mb=8)


# ---------------------------------------------------------------- auto: the probe and the choice


def test_choose_transfer_keeps_copy_engine_paths_unless_an_sm_path_is_clearly_faster():
    assert choose_transfer({"triton-dma": 1.0, "triton-dma-serial": 1.3, "triton-direct": 0.95}, "x") == "triton-dma"
    assert choose_transfer({"triton-dma": 1.0, "triton-direct": 0.8}, "x") == "triton-direct"
    assert choose_transfer({"triton-dma": 2.0, "triton-dma-serial": 1.5}, "x") == "triton-dma-serial"
    assert choose_transfer({"triton-dma": math.inf, "triton-hybrid": 1.0}, "x") == "triton-hybrid"
    assert choose_transfer({"triton-dma": math.inf}, "fallback") == "fallback" == choose_transfer({}, "fallback")


def test_probe_times_each_candidate_and_leaves_pools_path_and_counters_as_they_were():
    engine = ring_engine("triton-dma", 2, 1, rows=128, blocks=40)
    dev = engine.device_pool
    before = [bits(b).clone() for b in dev.k_buffers + dev.v_buffers]
    free = engine.host_pool.allocator.num_free
    seconds = probe_transfers(engine, candidates=("triton-dma", "torch", "no-such-path"), blocks=3, repeats=1)
    assert set(seconds) == {"triton-dma", "torch", "no-such-path"}
    assert math.isfinite(seconds["triton-dma"]) and math.isfinite(seconds["torch"]) and seconds["no-such-path"] == math.inf
    assert all(torch.equal(bits(b), old) for b, old in zip(dev.k_buffers + dev.v_buffers, before))
    assert engine.transfer == "triton-dma" and engine.host_pool.allocator.num_free == free
    assert engine.bytes_out == engine.bytes_in == engine.rotations_out == engine.rotations_in == 0
    engine.check_invariants()
    tiny = ring_engine("torch", 2, 1, rows=8, blocks=4)
    assert probe_transfers(tiny) == {}  # no room for a probe: auto keeps the device-kind pick


def test_probe_never_picks_a_path_that_changes_kv_bytes(monkeypatch):
    """The probe is also a correctness gate: a path whose save + restore changes bytes gets inf."""
    engine = ring_engine("torch", 2, 1, rows=128, blocks=40)
    real_load = engine.rotate

    def corrupting_rotate(*args, **kwargs):
        handle = real_load(*args, **kwargs)
        if engine.transfer == "triton-dma":
            handle.synchronize()
            engine.device_pool.k_buffers[0][1 + 3 * engine.host_pool.block_tokens] += 1  # a restored row
        return handle

    monkeypatch.setattr(engine, "rotate", corrupting_rotate)
    seconds = probe_transfers(engine, candidates=("triton-dma", "torch"), blocks=3, repeats=1)
    assert seconds["triton-dma"] == math.inf and math.isfinite(seconds["torch"])
    assert choose_transfer(seconds, "x") == "torch"


def test_pick_by_probe_moves_the_engine_to_the_chosen_path_and_it_still_round_trips():
    """What RotationEngine(transfer="auto") does on CUDA, run here on the interpreted kernels."""
    engine = ring_engine("torch", 2, 1, rows=128, blocks=40)
    seconds = pick_by_probe(engine)
    assert set(seconds) == set(PROBE_CANDIDATES) and engine.transfer == choose_transfer(seconds, "torch")
    src, dst = torch.tensor([3, 17, 5, 60, 61, 62, 9]), torch.arange(100, 107)
    want = rows_at(engine.device_pool, src)
    engine.load(engine.save(src), dst)
    assert all(torch.equal(a, b) for a, b in zip(rows_at(engine.device_pool, dst), want))


# ---------------------------------------------------------------- CUDA: real streams and events


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("transfer", RING_PATHS)
@pytest.mark.parametrize("ring_slots,slot_blocks", [(2, 1), (3, 4)])
def test_cuda_ring_duplex_with_an_eager_copy_sharing_the_out_ring(transfer, ring_slots, slot_blocks):
    engine = ring_engine(transfer, ring_slots, slot_blocks, rows=8192, blocks=1200)
    park, away, back, run = (torch.arange(a, a + 1001, device="cuda") for a in (0, 2000, 4000, 6000))
    want_back, want_away, want_run = rows_at(engine.device_pool, park), rows_at(engine.device_pool, away), \
        rows_at(engine.device_pool, run)
    parked = engine.save(park)
    engine.track("r")
    assert engine.sync_full_blocks("r", run, 1001) == 250  # eager lane, through the shared out ring
    handle = engine.rotate(out=[(None, away, 1001)], inn=[(parked, back)])
    handle.synchronize()
    engine.quiesce()
    assert all(torch.equal(a, b) for a, b in zip(rows_at(engine.device_pool, back), want_back))
    elsewhere = torch.arange(7000, 8001, device="cuda")
    engine.load(handle.saved[0], elsewhere)
    assert all(torch.equal(a, b) for a, b in zip(rows_at(engine.device_pool, elsewhere), want_away))
    mirror = engine.save_request("r", run, 1001)
    engine.load(mirror, park)
    assert all(torch.equal(a, b) for a, b in zip(rows_at(engine.device_pool, park), want_run))
    for hk in (parked, handle.saved[0], mirror):
        engine.free(hk)
    engine.untrack("r")
    engine.quiesce()
    assert engine.host_pool.allocator.num_used == 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_auto_picks_a_probed_path_and_leaves_the_pool_as_it_was():
    dev, host = pools(8192, 1200, 16, device="cuda")
    before = [bits(b).clone() for b in dev.k_buffers + dev.v_buffers]
    engine = RotationEngine(dev, host)
    assert set(engine.transfer_probe) == set(PROBE_CANDIDATES)
    assert engine.transfer in PROBE_CANDIDATES and math.isfinite(engine.transfer_probe[engine.transfer])
    assert all(torch.equal(bits(b), old) for b, old in zip(dev.k_buffers + dev.v_buffers, before))
    assert engine.host_pool.allocator.num_used == 0
