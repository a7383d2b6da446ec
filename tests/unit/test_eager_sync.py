"""Eager block rotation: per-request mirrors of synced host blocks, tail-only rotation out, reuse
after resume, reclamation under host-pool pressure, and reference counts.

Runs the engine's orchestration on a CPU with the torch transfer path (lanes are synchronous there).
Every restored byte is compared exactly (integer views), and every test ends with no host block used.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from superinfer_sgl.duplexkv import DevicePoolView, HostKV, HostKVPool, HostPoolFull, RotationEngine

BT = 4
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def make_engine(blocks: int = 32, rows: int = 128, dtype: torch.dtype = torch.bfloat16) -> RotationEngine:
    dev = DevicePoolView.synthetic(rows, 2, 2, 4, dtype, DEVICE)
    host = HostKVPool(blocks, 2, 2, 4, BT, dtype, pin=None)
    bits(host.data).fill_(0x5A)
    return RotationEngine(dev, host, transfer="torch")


def buffers(engine: RotationEngine) -> list[torch.Tensor]:
    d = engine.device_pool
    return [b for layer in range(d.layers) for b in (d.k_buffers[layer], d.v_buffers[layer])]


def token_bytes(engine: RotationEngine, slots: torch.Tensor) -> torch.Tensor:
    """[tokens, layers * 2, row bytes] of the device KV at `slots`."""
    idx = slots.to(engine.device_pool.device, torch.int64)
    return torch.stack([bits(b)[idx].flatten(1) for b in buffers(engine)], dim=1).cpu()


def write(engine: RotationEngine, slots: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Fill `slots` with fresh random KV (as a forward pass would); returns the bytes written."""
    idx = slots.to(engine.device_pool.device, torch.int64)
    for b in buffers(engine):
        rows = torch.randint(0, 256, bits(b)[idx].shape, dtype=torch.uint8, generator=gen)
        bits(b)[idx] = rows.to(b.device)
    return token_bytes(engine, slots)


def poison(engine: RotationEngine, slots: torch.Tensor) -> None:
    """What a freed device slot looks like once another request wrote it."""
    idx = slots.to(engine.device_pool.device, torch.int64)
    for b in buffers(engine):
        bits(b)[idx] = 0xEE


def mirror_bytes(engine: RotationEngine, rid: str) -> torch.Tensor:
    """[synced tokens, layers * 2, row bytes] as the mirror's host blocks hold them."""
    blocks = engine.mirror.get(rid).blocks
    data = bits(engine.host_pool.data[blocks])  # [blocks, layers, 2, BT, heads, dim * elem]
    return data.permute(0, 3, 1, 2, 4, 5).reshape(len(blocks) * BT, 4, data.shape[-2] * data.shape[-1])


def assert_refs(engine: RotationEngine, live: list[HostKV]) -> None:
    """Every reference is accounted for: the engine's own plus one per live HostKV block."""
    engine.check_invariants()
    want = engine.held_refs() + Counter(b for hk in live for b in hk.block_ids)
    alloc = engine.host_pool.allocator
    assert {b: alloc.refcount(b) for b in range(alloc.num_blocks) if alloc.refcount(b)} == dict(want)


@dataclass
class Req:
    """A request growing in device slots [row]: its first n tokens have final KV, `kv` their bytes."""

    rid: str
    row: torch.Tensor
    kv: torch.Tensor
    n: int = 0

    def grow(self, engine: RotationEngine, k: int, gen: torch.Generator) -> None:
        self.kv = torch.cat([self.kv[: self.n], write(engine, self.row[self.n : self.n + k], gen)])
        self.n += k

    def rewrite_from(self, engine: RotationEngine, t: int, gen: torch.Generator) -> None:
        new = write(engine, self.row[t : self.n], gen)
        self.kv = torch.cat([self.kv[:t], new])


def new_req(engine: RotationEngine, rid: str, row: torch.Tensor) -> Req:
    engine.track(rid)
    return Req(rid, row, token_bytes(engine, row[:0]))


def evict(engine: RotationEngine, req: Req) -> tuple[HostKV, int]:
    """save_request + free the device slots; returns the HostKV and the bytes_out it cost."""
    before = engine.bytes_out
    hk = engine.save_request(req.rid, req.row, req.n)
    poison(engine, req.row[: req.n])
    return hk, engine.bytes_out - before


def restore(engine: RotationEngine, req: Req, hk: HostKV, row: torch.Tensor) -> None:
    engine.load(hk, row[: hk.num_tokens])
    req.row = row
    assert torch.equal(token_bytes(engine, row[: req.n]), req.kv[: req.n])


GEN = torch.Generator().manual_seed(1)


def test_sync_after_each_full_block_never_copies_a_partial_block():
    engine = make_engine()
    req = new_req(engine, "a", torch.randperm(128)[:40])
    bpt = engine.device_pool.bytes_per_token
    for n in range(1, 19):
        req.grow(engine, 1, GEN)
        engine.sync_full_blocks("a", req.row, req.n)
        assert engine.synced_tokens("a") == n // BT * BT
        assert engine.bytes_eager_out == n // BT * BT * bpt
        assert torch.equal(mirror_bytes(engine, "a"), req.kv[: n // BT * BT])
        assert_refs(engine, [])
    assert engine.sync_full_blocks("a", req.row, req.n) == 0  # nothing new: no copy
    assert (engine.bytes_out, engine.rotations_out) == (0, 0)
    engine.untrack("a")
    assert engine.host_pool.allocator.num_used == 0


@pytest.mark.parametrize("n,synced_at", [(19, 19), (19, 9), (16, 16), (3, 3), (0, 0)])
def test_save_request_moves_only_the_unsynced_tail(n, synced_at):
    engine = make_engine()
    bpt = engine.device_pool.bytes_per_token
    req = new_req(engine, "a", torch.randperm(128)[:24])
    req.grow(engine, synced_at, GEN)
    engine.sync_full_blocks("a", req.row, req.n)
    mirror = list(engine.mirror.get("a").blocks)
    req.grow(engine, n - synced_at, GEN)
    hk, moved = evict(engine, req)
    assert moved == (n - synced_at // BT * BT) * bpt
    assert engine.bytes_reused == synced_at // BT * BT * bpt
    assert hk.num_tokens == n and len(hk.block_ids) == math.ceil(n / BT)
    assert list(hk.block_ids[: len(mirror)]) == mirror  # synced blocks first, then the new ones
    assert engine.synced_tokens("a") == 0  # the mirror's references moved to the HostKV
    assert_refs(engine, [hk])
    restore(engine, req, hk, torch.randperm(128)[:24])
    engine.free(hk)
    engine.untrack("a")
    assert engine.host_pool.allocator.num_used == 0


@pytest.mark.parametrize("resync", [False, True])
def test_invalidated_block_rewritten_never_brings_stale_bytes_back(resync):
    engine = make_engine()
    bpt = engine.device_pool.bytes_per_token
    req = new_req(engine, "a", torch.randperm(128)[:24])
    req.grow(engine, 14, GEN)
    engine.sync_full_blocks("a", req.row, req.n)  # blocks 0..2 synced
    stale = mirror_bytes(engine, "a").clone()
    engine.invalidate("a", 6)  # tokens 6.. are written again: block 1 and 2 are dirty
    assert engine.synced_tokens("a") == 4
    req.rewrite_from(engine, 6, GEN)
    assert not torch.equal(req.kv[6:12], stale[6:12])
    if resync:
        assert engine.sync_full_blocks("a", req.row, req.n) == 2
        assert torch.equal(mirror_bytes(engine, "a"), req.kv[:12])
    hk, moved = evict(engine, req)
    assert moved == (14 - (12 if resync else 4)) * bpt
    restore(engine, req, hk, torch.randperm(128)[:24])  # byte-identical to the rewritten KV
    assert_refs(engine, [hk])
    engine.free(hk)
    engine.untrack("a")
    assert engine.host_pool.allocator.num_used == 0


def test_resumed_request_keeps_its_host_copy_and_rotates_out_again_for_the_tail_only():
    engine = make_engine()
    bpt = engine.device_pool.bytes_per_token
    req = new_req(engine, "a", torch.randperm(128)[:24])
    req.grow(engine, 14, GEN)
    engine.sync_full_blocks("a", req.row, req.n)
    hk, _ = evict(engine, req)
    restore(engine, req, hk, torch.randperm(128)[:24])
    assert engine.keep_as_mirror("a", hk) == 3
    alloc = engine.host_pool.allocator
    assert [alloc.refcount(b) for b in hk.block_ids] == [2, 2, 2, 1]  # mirror + HostKV; tail: HostKV only
    assert_refs(engine, [hk])
    engine.free(hk)  # the scheduler lets go of the rotary copy; the mirror still holds the full blocks
    assert [alloc.refcount(b) for b in hk.block_ids[:3]] == [1, 1, 1] and alloc.num_used == 3
    hk2, moved = evict(engine, req)
    assert moved == 2 * bpt  # only the tail block that was not full
    assert hk2.block_ids[:3] == hk.block_ids[:3]
    restore(engine, req, hk2, torch.randperm(128)[:24])
    engine.free(hk2)
    engine.untrack("a")
    assert alloc.num_used == 0


def test_keep_as_mirror_only_keeps_blocks_within_the_restored_tokens():
    engine = make_engine()
    req = new_req(engine, "a", torch.randperm(128)[:24])
    req.grow(engine, 14, GEN)
    hk, _ = evict(engine, req)
    assert engine.keep_as_mirror("a", hk, valid_tokens=9) == 2  # tokens 9.. are recomputed on resume
    engine.free(hk)
    assert engine.synced_tokens("a") == 8 and engine.host_pool.allocator.num_used == 2
    engine.untrack("a")
    assert engine.host_pool.allocator.num_used == 0


def test_eager_sync_is_skipped_not_failed_when_the_pool_is_full():
    engine = make_engine(blocks=2)
    req = new_req(engine, "a", torch.randperm(128)[:24])
    req.grow(engine, 16, GEN)
    assert engine.sync_full_blocks("a", req.row, req.n) == 2  # 4 wanted, 2 free
    assert engine.eager_blocks_skipped == 2 and engine.synced_tokens("a") == 8
    assert engine.sync_full_blocks("a", req.row, req.n) == 0
    with pytest.raises(HostPoolFull):  # its own mirror is never dropped to make room for itself
        engine.save_request("a", req.row, req.n)
    assert engine.synced_tokens("a") == 8 and engine.rotations_out == 0
    assert_refs(engine, [])
    engine.untrack("a")
    assert engine.host_pool.allocator.num_used == 0


def test_other_requests_mirrors_are_dropped_before_the_pool_is_full():
    engine = make_engine(blocks=6)
    a = new_req(engine, "a", torch.arange(0, 24))
    b = new_req(engine, "b", torch.arange(24, 48))
    a.grow(engine, 16, GEN)
    engine.sync_full_blocks("a", a.row, a.n)  # 4 blocks, synced first (least recently)
    b.grow(engine, 10, GEN)
    engine.sync_full_blocks("b", b.row, b.n)  # 2 blocks: the pool is now full
    assert engine.host_pool.allocator.num_free == 0
    hk_b, _ = evict(engine, b)  # needs one block for its tail: taken from a's mirror end
    assert engine.synced_tokens("a") == 12 and engine.mirror_blocks_dropped == 1
    assert torch.equal(mirror_bytes(engine, "a"), a.kv[:12])  # what is left is still a valid prefix
    hk_x = engine.save(torch.arange(60, 68))  # a plain save of 2 blocks reclaims too
    assert engine.synced_tokens("a") == 4 and engine.mirror_blocks_dropped == 3
    assert_refs(engine, [hk_b, hk_x])
    with pytest.raises(HostPoolFull):  # 2 blocks needed, 1 reclaimable: nothing is dropped
        engine.save(torch.arange(70, 78))
    assert engine.synced_tokens("a") == 4
    restore(engine, b, hk_b, torch.arange(80, 104))
    for hk in (hk_b, hk_x):
        engine.free(hk)
    engine.untrack("a")
    engine.untrack("b")
    assert engine.host_pool.allocator.num_used == 0


def test_room_blocks_counts_free_blocks_and_mirrors_a_rotation_may_drop():
    engine = make_engine(blocks=6)
    assert engine.room_blocks(enough=4) == 6
    a = new_req(engine, "a", torch.arange(0, 24))
    a.grow(engine, 16, GEN)
    engine.sync_full_blocks("a", a.row, a.n)  # 4 of the 6 blocks mirror a's KV
    assert engine.room_blocks(enough=2) == 2  # enough free: the mirrors are not counted
    assert engine.room_blocks(enough=3) == 3  # short: a's mirror blocks counted until there is enough
    assert engine.room_blocks(enough=7) == 6  # exact below enough: every block free or droppable
    assert engine.mirror.reclaimable(up_to=10) == engine.mirror.reclaimable() == 4
    hk = engine.save(torch.arange(60, 68))  # a plain save of 2 blocks: what the room said it may
    assert engine.room_blocks(enough=5) == 4 and engine.synced_tokens("a") == 16
    engine.free(hk)
    engine.untrack("a")
    assert engine.room_blocks(enough=6) == 6


def test_own_mirror_is_never_dropped_even_when_it_is_the_oldest():
    engine = make_engine(blocks=4)
    a, b = new_req(engine, "a", torch.arange(0, 24)), new_req(engine, "b", torch.arange(24, 48))
    b.grow(engine, 9, GEN)
    engine.sync_full_blocks("b", b.row, b.n)  # b: 2 blocks, least recently synced
    a.grow(engine, 8, GEN)
    engine.sync_full_blocks("a", a.row, a.n)  # a: 2 blocks; the pool is full
    hk, moved = evict(engine, b)  # needs 1 block for its tail: from a, never from b itself
    assert moved == engine.device_pool.bytes_per_token
    assert (engine.synced_tokens("a"), engine.mirror_blocks_dropped) == (4, 1)
    restore(engine, b, hk, torch.arange(50, 74))
    engine.free(hk)
    engine.untrack("a")
    engine.untrack("b")
    assert engine.host_pool.allocator.num_used == 0


def test_least_recently_synced_mirror_goes_first_and_shared_blocks_do_not_count():
    engine = make_engine(blocks=4)
    a, b = new_req(engine, "a", torch.arange(0, 24)), new_req(engine, "b", torch.arange(24, 48))
    a.grow(engine, 8, GEN)
    b.grow(engine, 8, GEN)
    engine.sync_full_blocks("a", a.row, a.n)
    engine.sync_full_blocks("b", b.row, b.n)
    assert engine.drop_mirrors(1) == 1
    assert (engine.synced_tokens("a"), engine.synced_tokens("b")) == (4, 8)
    a.grow(engine, 4, GEN)
    engine.sync_full_blocks("a", a.row, a.n)  # a is now the most recently synced
    assert engine.drop_mirrors(1) == 1
    assert (engine.synced_tokens("a"), engine.synced_tokens("b")) == (8, 4)
    hk = engine.save_request("b", b.row, b.n)  # b's remaining block now also belongs to a HostKV
    engine.keep_as_mirror("b", hk)
    assert engine.mirror.reclaimable(exclude=["a"]) == 0  # shared with a live HostKV: frees nothing
    engine.free(hk)
    assert engine.mirror.reclaimable(exclude=["a"]) == 2
    engine.untrack("a")
    engine.untrack("b")
    assert engine.host_pool.allocator.num_used == 0


def test_bad_arguments():
    engine = make_engine()
    with pytest.raises(ValueError, match="not tracked"):
        engine.sync_full_blocks("x", torch.arange(8), 8)
    with pytest.raises(ValueError, match="not tracked"):
        engine.save_request("x", torch.arange(8), 8)
    engine.track("x")
    engine.track("x")  # idempotent
    with pytest.raises(ValueError, match="slots"):
        engine.sync_full_blocks("x", torch.arange(6), 8)
    with pytest.raises(ValueError, match="num_tokens"):
        engine.save_request("x", torch.arange(6), 8)
    with pytest.raises(ValueError, match="from_token"):
        engine.invalidate("x", -1)
    with pytest.raises(ValueError, match="block_tokens"):
        engine.keep_as_mirror("x", HostKV((), 0, BT + 1))
    assert engine.host_pool.allocator.num_used == 0
    engine.untrack("x")
    engine.untrack("x")  # idempotent


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sync_is_ordered_after_the_forward_event():
    engine = make_engine()
    req = new_req(engine, "a", torch.randperm(128, device="cuda")[:24])
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        req.grow(engine, 16, GEN)
        written = torch.cuda.Event()
        written.record(forward)
    assert engine.sync_full_blocks("a", req.row, req.n, after=written) == 4
    engine.quiesce()
    assert torch.equal(mirror_bytes(engine, "a"), req.kv[:16])
    hk, moved = evict(engine, req)
    assert moved == 0
    engine.free(hk)
    engine.untrack("a")
    assert engine.host_pool.allocator.num_used == 0


# ---------------------------------------------------------------- randomized, against a simple model


class EagerMachine(RuleBasedStateMachine):
    """Two requests growing, syncing, being rewritten, rotated out and back in, against a model:
    the expected bytes of every token, the synced block count, and the HostKVs alive."""

    CAP = 24

    def __init__(self) -> None:
        super().__init__()
        self.engine = make_engine(blocks=7, rows=200)
        self.gen = torch.Generator().manual_seed(7)
        self.free_rows = list(range(200))
        self.reqs: dict[str, Req] = {}
        self.synced: dict[str, int] = {}  # model: blocks synced per running request
        self.rotary: dict[str, HostKV] = {}
        self.bpt = self.engine.device_pool.bytes_per_token

    def take_row(self, seed: int) -> torch.Tensor:
        perm = torch.randperm(len(self.free_rows), generator=torch.Generator().manual_seed(seed))[: self.CAP]
        row = torch.tensor([self.free_rows[i] for i in perm.tolist()])
        taken = set(row.tolist())
        self.free_rows = [r for r in self.free_rows if r not in taken]
        return row

    def give_row(self, row: torch.Tensor) -> None:
        poison(self.engine, row)
        self.free_rows += row.tolist()

    def running(self) -> list[str]:
        return [r for r in self.reqs if r not in self.rotary]

    @initialize(seed=st.integers(0, 1000), n=st.integers(0, 12))
    def start_two(self, seed: int, n: int) -> None:
        for rid in ("a", "b"):
            self.start(rid, seed)
            self.reqs[rid].grow(self.engine, n, self.gen)

    @rule(rid=st.sampled_from(["a", "b", "c"]), seed=st.integers(0, 1000))
    def start(self, rid: str, seed: int) -> None:
        if rid in self.reqs:
            return
        self.reqs[rid] = new_req(self.engine, rid, self.take_row(seed))
        self.synced[rid] = 0

    @precondition(lambda self: self.running())
    @rule(data=st.data(), k=st.integers(1, 9), then_sync=st.booleans())
    def append(self, data: st.DataObject, k: int, then_sync: bool) -> None:
        """Decode steps (or a prefill chunk), usually followed by the iteration's eager sync."""
        req = self.reqs[data.draw(st.sampled_from(self.running()))]
        req.grow(self.engine, min(k, self.CAP - req.n), self.gen)
        if then_sync:
            self.sync_req(req)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def sync(self, data: st.DataObject) -> None:
        self.sync_req(self.reqs[data.draw(st.sampled_from(self.running()))])

    def sync_req(self, req: Req) -> None:
        free = self.engine.host_pool.allocator.num_free
        started = self.engine.sync_full_blocks(req.rid, req.row, req.n)
        assert started == min(req.n // BT - self.synced[req.rid], free)
        self.synced[req.rid] += started

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def invalidate_and_rewrite(self, data: st.DataObject) -> None:
        req = self.reqs[data.draw(st.sampled_from(self.running()))]
        t = data.draw(st.integers(max(0, req.n - 3 * BT), req.n))  # rewrites hit recent tokens
        self.engine.invalidate(req.rid, t)
        req.rewrite_from(self.engine, t, self.gen)
        self.synced[req.rid] = min(self.synced[req.rid], t // BT)

    @precondition(lambda self: self.running())
    @rule(data=st.data())
    def rotate_out(self, data: st.DataObject) -> None:
        req = self.reqs[data.draw(st.sampled_from(self.running()))]
        before = self.engine.counters()
        try:
            hk, moved = evict(self.engine, req)
        except HostPoolFull:
            assert self.engine.counters()["bytes_out"] == before["bytes_out"]
            assert self.engine.synced_tokens(req.rid) == self.synced[req.rid] * BT
            return
        reused = min(self.synced[req.rid], math.ceil(req.n / BT))
        assert moved == max(0, req.n - reused * BT) * self.bpt
        for other in self.running():  # reclamation may have cut other mirrors, never grown them
            if other != req.rid:
                now = self.engine.synced_tokens(other) // BT
                assert now <= self.synced[other]
                self.synced[other] = now
        self.give_row(req.row)
        self.rotary[req.rid], self.synced[req.rid] = hk, 0

    @precondition(lambda self: self.rotary)
    @rule(data=st.data(), keep=st.booleans(), seed=st.integers(0, 1000))
    def resume(self, data: st.DataObject, keep: bool, seed: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.rotary)))
        hk = self.rotary.pop(rid)
        restore(self.engine, self.reqs[rid], hk, self.take_row(seed))
        if keep:
            self.synced[rid] = self.engine.keep_as_mirror(rid, hk)
        self.engine.free(hk)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs.pop(rid)
        if rid in self.rotary:
            self.engine.free(self.rotary.pop(rid))
        else:
            self.give_row(req.row)
        self.engine.untrack(rid)

    @invariant()
    def consistent(self) -> None:
        assert_refs(self.engine, list(self.rotary.values()))
        for rid in self.running():
            assert self.engine.synced_tokens(rid) == self.synced[rid] * BT
            assert torch.equal(mirror_bytes(self.engine, rid), self.reqs[rid].kv[: self.synced[rid] * BT])

    def teardown(self) -> None:
        for rid in list(self.reqs):
            self.finish_rid(rid)
        assert self.engine.host_pool.allocator.num_used == 0

    def finish_rid(self, rid: str) -> None:
        self.reqs.pop(rid)
        if rid in self.rotary:
            self.engine.free(self.rotary.pop(rid))
        self.engine.untrack(rid)


TestEagerStateful = EagerMachine.TestCase
TestEagerStateful.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
