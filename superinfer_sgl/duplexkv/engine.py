"""DuplexKV rotation engine: move request KV between the device pool and block-first host blocks.

Three lanes (CUDA side streams; on a CPU the same code runs synchronously, see streams.py):
  out    device -> host for rotations out (save, save_request, rotate)
  in     host -> device for rotations in (load, rotate, prefetch), concurrent with `out`
  eager  device -> host for eager block syncs of running requests (sync_full_blocks)
Each copy is ordered after `after` (CUDA event(s) recorded after the forward pass that wrote the KV
and any GPU work that produced the slot indices) or, by default, after everything already queued on
the current stream. rotate()/prefetch() return a RotationHandle at once; save/load/save_request are
the synchronous wrappers (they wait on the handle's events). Each call's copies are timed per
direction (copy_timing.py: CUDA events on the lanes, read when reaped). See docs/duplexkv.md.

Block ownership is by the allocator's reference counts. References are held by: each HostKV handed
out (engine.free drops it), each request mirror (eager.py), each prefetch not yet consumed, and each
copy still in flight (dropped by _reap() once its event has completed, so a block is never handed out
again while a queued copy still reads or writes it).

GPU: streams, events, both directions at once and `in_after_out` ran in CUDA-marked unit tests."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from superinfer_sgl.duplexkv.copy_timing import CopyTimer, TimedCall
from superinfer_sgl.duplexkv.device_pool import DevicePoolView, check_compatible
from superinfer_sgl.duplexkv.eager import EagerMirror
from superinfer_sgl.duplexkv.host_pool import HostKV, HostKVPool
from superinfer_sgl.duplexkv.link_probe import pick_by_probe
from superinfer_sgl.duplexkv.prefetch import PrefetchTable
from superinfer_sgl.duplexkv.streams import After, CopyEvent, CopyLane, InflightCopies, RotationHandle, as_events
from superinfer_sgl.duplexkv.transfer import TRANSFERS, gather_batch, make_path, pick_transfer, scatter_batches

__all__ = ["TRANSFERS", "HostKV", "RotateIn", "RotateOut", "RotationEngine", "pick_transfer"]


class RotateOut(NamedTuple):
    """A request to rotate out. rid: a tracked request whose synced mirror is reused (None: copy all,
    no mirror). slots: its token slots, at least num_tokens of them (a whole req_to_token row is fine)."""

    rid: str | None
    slots: torch.Tensor
    num_tokens: int


class RotateIn(NamedTuple):
    """A HostKV to bring back into exactly host_kv.num_tokens device slots."""

    host_kv: HostKV
    slots: torch.Tensor


@dataclass
class _OutPlan:
    req: RotateOut
    reused: list[int]  # leading blocks the mirror already holds (its references move to the HostKV)
    need: int  # blocks to copy now: unsynced full blocks + the partial tail block
    pending: list[CopyEvent]  # in-flight eager copies into `reused`
    new: list[int] = field(default_factory=list)


# Programs (SMs) a kernel path may keep busy; the rest stay with the forward pass. H100, PCIe Gen5: 8 moved
# 93% of a pinned cudaMemcpy one way (triton-direct); 132 added nothing there, ~25% to triton-dma (results.md#gpu).
DEFAULT_MAX_PROGRAMS = 8


class RotationEngine:
    """Rotates request KV out to host blocks and back into device slots; keeps eager mirrors."""

    def __init__(self, device_pool: DevicePoolView, host_pool: HostKVPool, transfer: str = "auto",
                 max_programs: int | None = DEFAULT_MAX_PROGRAMS, ring: dict[str, int] | None = None) -> None:
        """ring: staging ring options of the ring paths (transfer.make_path); `auto` on CUDA: see below."""
        check_compatible(device_pool, host_pool)
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
        self.device_pool, self.host_pool = device_pool, host_pool
        self._max_programs, self._ring = max_programs, dict(ring or {})
        dev = device_pool.device
        self._out, self._in, self._eager = CopyLane(dev, priority=-1), CopyLane(dev, priority=-1), CopyLane(dev)
        self.mirror = EagerMirror(host_pool.allocator, host_pool.block_tokens)
        self._inflight = InflightCopies(host_pool.allocator)
        self._prefetched = PrefetchTable(host_pool.allocator)
        self.bytes_out = self.bytes_in = 0  # host payload bytes of rotations (not eager syncs, nor fp8 scales)
        self.rotations_out = self.rotations_in = 0
        self.bytes_eager_out = 0  # background eager syncs
        self.bytes_reused = 0  # bytes of rotations out served by mirror blocks instead of a copy
        self.eager_blocks_skipped = self.mirror_blocks_dropped = self.prefetch_hits = 0
        # Prefetch accounting: bytes copied by prefetch() (also counted in bytes_in, once), bytes of
        # rotations in served by a prefetch without a second copy, prefetches dropped unused.
        self.bytes_prefetched = self.bytes_prefetch_hits = self.prefetches_cancelled = 0
        self.copy_timer = CopyTimer()  # seconds per direction and of overlap, read as copies are reaped
        self.use_transfer(pick_transfer(dev) if transfer == "auto" else transfer)
        # auto on CUDA: the candidate paths' seconds for one duplex rotation; the fastest is kept (link_probe.py)
        self.transfer_probe: dict[str, float] = pick_by_probe(self) if transfer == "auto" and dev.type == "cuda" else {}

    def use_transfer(self, transfer: str) -> None:
        """Copy through `transfer` from now on, once the copies in flight have run (the startup probe)."""
        self.quiesce()
        self._path = make_path(transfer, self.device_pool, self.host_pool, self._max_programs, **self._ring)
        self.transfer = transfer

    def room_blocks(self, enough: int) -> int:
        """Host blocks rotations out may take (exact below `enough`, at least `enough` otherwise): free
        ones, and other requests' mirror blocks `_alloc` would drop."""
        free = self.host_pool.allocator.num_free
        return free if free >= enough else free + self.mirror.reclaimable(up_to=enough - free)

    # ---- synchronous convenience API (the runtime itself uses rotate() and prefetch())
    def save(self, slots: torch.Tensor) -> HostKV:
        """Copy the KV of `slots` (all layers, K and V) into newly allocated host blocks and wait.
        Raises HostPoolFull, with nothing allocated, when the host pool lacks blocks even after
        dropping other requests' mirrors."""
        slots = _check_slots(slots)
        return self._finish(self.rotate(out=[RotateOut(None, slots, slots.numel())])).saved[0]

    def load(self, host_kv: HostKV, slots: torch.Tensor) -> None:
        """Copy `host_kv` back into device `slots` (one per token) and wait; the host blocks stay
        allocated. Uses a matching prefetch() instead of copying again."""
        self._finish(self.rotate(inn=[RotateIn(host_kv, slots)]))

    def save_request(self, rid: str, slots: torch.Tensor, num_tokens: int) -> HostKV:
        """save() for a tracked request: reuses its synced mirror blocks and copies only the rest.
        The mirror's references move to the returned HostKV and the mirror is left empty."""
        return self._finish(self.rotate(out=[RotateOut(rid, slots, num_tokens)])).saved[0]

    def free(self, host_kv: HostKV) -> None:
        """Drop the caller's reference on `host_kv`; unconsumed prefetches of it or of any HostKV
        sharing its blocks (a prefix of it) are cancelled."""
        self._reap()
        self.prefetches_cancelled += self._prefetched.drop_overlapping(host_kv)
        self.host_pool.allocator.decref(host_kv.block_ids)

    # ---- full duplex and prefetch
    def rotate(self, out: Iterable[RotateOut | tuple] = (), inn: Iterable[RotateIn | tuple] = (),
               after: After = None, in_after: After = None, in_after_out: bool = False) -> RotationHandle:
        """Start one iteration's copies: every `out` device -> host on the out lane (one launch) and
        every `inn` host -> device on the in lane, concurrently. All or nothing: HostPoolFull or a bad
        argument leaves everything as it was. The saved HostKVs are in handle.saved, in order.

        in_after: more events the in copies wait for, besides `after` (e.g. a forward still writing
        slots that were just handed to a resume). in_after_out: order the in copies after this call's
        out copies; required when an incoming slot may be one an outgoing copy still reads (the caller
        freed the out slots before allocating the in slots). On a CPU both are no-ops (out runs first)."""
        self._reap()
        outs = [self._check_out(RotateOut(*o)) for o in out]
        ins = [self._check_in(RotateIn(*i)) for i in inn]
        plans = self._plan_out(outs)
        hits, copies = self._match_prefetched(ins)
        out_held = [b for p in plans for b in p.reused + p.new]
        in_held = [b for i in copies for b in i.host_kv.block_ids]
        self.host_pool.allocator.incref(out_held + in_held)
        timed = TimedCall()
        try:
            out_event = self._launch_out(plans, after, timed) if plans else None
            in_also = [*as_events(in_after), *([out_event] if in_after_out and out_event else [])]
            in_event = self._launch_in(copies, after, in_also, timed) if copies else None
        except BaseException:
            self._out.synchronize()
            self._in.synchronize()
            self.host_pool.allocator.decref(out_held + in_held + [b for p in plans for b in p.new])
            raise
        if out_event is not None:
            self._inflight.hold(out_event, out_held)
        if in_event is not None:
            self._inflight.hold(in_event, in_held)
        saved = tuple(self._commit_out(p) for p in plans)
        events = [e for e in (out_event, in_event) if e is not None] + self._commit_in(ins, hits)
        self.copy_timer.add(timed)
        self._reap()
        return RotationHandle(saved, tuple(events))

    def prefetch(
        self, host_kv: HostKV, slots: torch.Tensor, after: After = None, in_after: After = None
    ) -> RotationHandle:
        """Start copying `host_kv` into `slots` now; a later load()/rotate() of the same HostKV into the
        same slots (same tensor memory on CUDA, same values on a CPU) waits on this copy instead.
        `after`/`in_after` as in rotate()."""
        self._reap()
        inn = self._check_in(RotateIn(host_kv, slots))
        known = self._prefetched.find(host_kv, slots)
        if known is not None:
            return RotationHandle(events=(known,))
        blocks = list(host_kv.block_ids)
        self.host_pool.allocator.incref(blocks)  # held until the copy has run
        timed = TimedCall()
        try:
            event = self._launch_in([inn], after, as_events(in_after), timed)
        except BaseException:
            self.host_pool.allocator.decref(blocks)
            raise
        self._inflight.hold(event, blocks)
        self.copy_timer.add(timed)
        self._prefetched.add(host_kv, slots, event)
        moved = host_kv.num_tokens * self.host_pool.bytes_per_token
        self.bytes_in += moved
        self.bytes_prefetched += moved
        self._reap()
        return RotationHandle(events=(event,))

    def cancel_prefetch(self, host_kv: HostKV) -> None:
        """Forget an unconsumed prefetch of `host_kv` (e.g. the resume it was for did not happen);
        the device slots it wrote are the caller's to free."""
        self._reap()
        self.prefetches_cancelled += self._prefetched.drop(host_kv)

    def is_prefetched(self, host_kv: HostKV) -> bool:
        """Is a prefetch of `host_kv` still waiting to be consumed or cancelled?"""
        return self._prefetched.has(host_kv)

    # ---- eager block rotation
    def track(self, rid: str) -> None:
        """Give `rid` a (still empty) mirror; idempotent."""
        self.mirror.track(rid)

    def untrack(self, rid: str) -> None:
        """Forget `rid` (finished or aborted): its mirror's blocks are released."""
        self._reap()
        self.mirror.untrack(rid)

    def untrack_all(self) -> None:  # every mirror: the device KV they copied is being recomputed
        self._reap()
        list(map(self.mirror.untrack, self.mirror.rids()))

    def sync_full_blocks(self, rid: str, slots: torch.Tensor, num_tokens: int, after: After = None,
                         max_blocks: int | None = None) -> int:
        """Copy, in the background, every full block among the first num_tokens tokens (whose KV is
        final) that `rid`'s mirror lacks; never a partial block. Uses only free host blocks (at most
        max_blocks): when the pool is short it syncs fewer or none, as the mirror is only a cache.
        Ordered after `after` (the event of the forward that wrote the KV). Returns blocks started."""
        self._reap()
        slots = _check_slots(slots)
        missing = self.mirror.missing(rid, num_tokens)
        want = len(missing) if max_blocks is None else max(0, min(len(missing), max_blocks))
        count = min(want, self.host_pool.allocator.num_free)
        self.eager_blocks_skipped += want - count
        if count == 0:
            return 0
        bt = self.host_pool.block_tokens
        lo, hi = missing.start * bt, (missing.start + count) * bt
        if slots.numel() < hi:
            raise ValueError(f"{slots.numel()} slots given for {num_tokens} tokens")
        blocks = self.host_pool.allocator.alloc(count)
        self.host_pool.allocator.incref(blocks)  # held until the copy has run
        try:
            with self._eager.run(after):
                self._path.to_host(self._device_slots(self._eager, slots[lo:hi]), blocks)
            event = self._eager.record()
        except BaseException:
            self.host_pool.allocator.decref(blocks + blocks)
            raise
        self._inflight.hold(event, blocks)
        self.mirror.extend(rid, blocks, event)
        self.bytes_eager_out += count * self.host_pool.bytes_per_block
        self._reap()
        return count

    def invalidate(self, rid: str, from_token: int) -> None:
        """Tokens >= from_token of `rid` will be written again: the blocks holding them are no longer
        synced (their host copies are released, and a later sync copies them anew)."""
        self._reap()
        self.mirror.invalidate(rid, from_token)

    def keep_as_mirror(self, rid: str, host_kv: HostKV, valid_tokens: int | None = None) -> int:
        """After loading `host_kv` for `rid`, adopt its full blocks (those within valid_tokens: pass
        the tokens actually restored when the rest is recomputed) as the mirror, with a reference of
        the mirror's own; the caller still owns its HostKV reference. Returns blocks kept."""
        self._reap()
        return self.mirror.keep(rid, host_kv, valid_tokens)

    def drop_mirrors(self, n_blocks: int, exclude: Iterable[str] = ()) -> int:
        """Release mirror blocks of requests outside `exclude`, least recently synced first, until
        n_blocks blocks are free again; returns blocks freed."""
        self._reap()
        freed = self.mirror.drop(n_blocks, exclude)
        self.mirror_blocks_dropped += freed
        return freed

    def synced_tokens(self, rid: str) -> int:
        return len(self.mirror.get(rid).blocks) * self.host_pool.block_tokens

    # ---- accounting
    def counters(self) -> dict[str, int]:
        names = ("bytes_out", "bytes_in", "rotations_out", "rotations_in", "bytes_eager_out", "bytes_reused",
                 "eager_blocks_skipped", "mirror_blocks_dropped", "prefetch_hits", "bytes_prefetched",
                 "bytes_prefetch_hits", "prefetches_cancelled")
        return {n: getattr(self, n) for n in names}

    def held_refs(self) -> Counter[int]:
        """References the engine itself holds (mirrors, prefetches, copies in flight), per block;
        every other reference belongs to a HostKV handed out."""
        return self.mirror.refs() + self._inflight.refs() + self._prefetched.refs()

    def check_invariants(self) -> None:
        self.host_pool.allocator.check_invariants()
        for block, n in self.held_refs().items():
            assert self.host_pool.allocator.refcount(block) >= n, (block, n)

    def quiesce(self) -> None:
        """Wait for every copy in flight and release what they held (tests, shutdown)."""
        self._inflight.drain()
        self.mirror.prune()
        self.copy_timer.drain()

    # ---- internals: planning
    def _check_out(self, out: RotateOut) -> RotateOut:
        slots = _check_slots(out.slots)
        if not 0 <= out.num_tokens <= slots.numel():
            raise ValueError(f"num_tokens {out.num_tokens} outside [0, {slots.numel()} slots]")
        if out.rid is not None:
            self.mirror.get(out.rid)
        return out

    def _check_in(self, inn: RotateIn) -> RotateIn:
        hk, slots = inn.host_kv, _check_slots(inn.slots)
        if slots.numel() != hk.num_tokens or hk.block_tokens != self.host_pool.block_tokens:
            raise ValueError(
                f"{slots.numel()} slots for {hk.num_tokens} tokens "
                f"(block_tokens {hk.block_tokens} vs pool {self.host_pool.block_tokens})"
            )
        dead = [b for b in hk.block_ids if self.host_pool.allocator.refcount(b) == 0]
        if dead:
            raise ValueError(f"HostKV blocks {dead} are not allocated (freed already?)")
        return inn

    def blocks_short(self, out: Iterable[RotateOut | tuple] = (), inn: Iterable[RotateIn | tuple] = ()) -> int:
        """Host blocks rotate(out, inn) would lack (0: it fits), changing nothing (waits for copies in
        flight only if short); a bad argument raises as rotate() would. EnginesByFormat checks every
        format's part of a call before launching any."""
        self._reap()
        for i in inn:
            self._check_in(RotateIn(*i))
        plans, rids = self._plans([self._check_out(RotateOut(*o)) for o in out])
        need = sum(p.need for p in plans)
        if need > self.host_pool.allocator.num_free + self.mirror.reclaimable(rids):
            self.quiesce()  # copies in flight hold blocks too
        return max(0, need - self.host_pool.allocator.num_free - self.mirror.reclaimable(rids))

    def _plans(self, outs: list[RotateOut]) -> tuple[list[_OutPlan], list[str]]:
        rids = [o.rid for o in outs if o.rid is not None]
        if len(set(rids)) != len(rids):
            raise ValueError(f"a request appears twice in one rotation: {rids}")
        return [self._plan_one(o) for o in outs], rids

    def _plan_out(self, outs: list[RotateOut]) -> list[_OutPlan]:
        plans, rids = self._plans(outs)
        new = self._alloc(sum(p.need for p in plans), exclude=rids)
        for p in plans:
            p.new, new = new[: p.need], new[p.need :]
        return plans

    def _plan_one(self, out: RotateOut) -> _OutPlan:
        total = self.host_pool.blocks_for_tokens(out.num_tokens)
        if out.rid is None:
            return _OutPlan(out, [], total, [])
        mirror = self.mirror.get(out.rid)
        reused = mirror.blocks[: self.mirror.reusable(out.rid, out.num_tokens)]
        return _OutPlan(out, list(reused), total - len(reused), list(mirror.pending))

    def _alloc(self, n: int, exclude: Sequence[str]) -> list[int]:
        """n fresh blocks, dropping other requests' mirror blocks first if that makes them fit; else
        HostPoolFull with nothing allocated and no mirror touched."""
        alloc = self.host_pool.allocator
        if n > alloc.num_free + self.mirror.reclaimable(exclude):
            self.quiesce()  # copies in flight hold blocks too
        short = n - alloc.num_free
        if 0 < short <= self.mirror.reclaimable(exclude):
            self.mirror_blocks_dropped += self.mirror.drop(short, exclude)
        return alloc.alloc(n)

    def _match_prefetched(self, ins: list[RotateIn]) -> tuple[list[tuple[HostKV, CopyEvent]], list[RotateIn]]:
        hits: list[tuple[HostKV, CopyEvent]] = []
        copies: list[RotateIn] = []
        for inn in ins:
            event = self._prefetched.find(inn.host_kv, inn.slots)
            if event is not None and all(hk != inn.host_kv for hk, _ in hits):
                hits.append((inn.host_kv, event))
            else:
                copies.append(inn)
        return hits, copies

    # ---- internals: launching
    def _launch_out(self, plans: list[_OutPlan], after: After, timed: TimedCall) -> CopyEvent:
        """One launch for every tail; ordered after the eager copies whose blocks are reused."""
        bt = self.host_pool.block_tokens
        with self._out.run(after, also=[e for p in plans for e in p.pending]), \
                self.copy_timer.span(timed, "out", self._out.stream):
            parts = [(self._device_slots(self._out, p.req.slots[len(p.reused) * bt : p.req.num_tokens]), p.new)
                     for p in plans if p.new]
            if parts:
                self._path.to_host(*gather_batch(parts, bt))
        return self._out.record()

    def _launch_in(self, ins: list[RotateIn], after: After, also: Sequence[CopyEvent], timed: TimedCall) -> CopyEvent:
        with self._in.run(after, also=also), self.copy_timer.span(timed, "in", self._in.stream):
            parts = [(self._device_slots(self._in, i.slots), list(i.host_kv.block_ids))
                     for i in ins if i.host_kv.num_tokens]
            for slots, blocks in scatter_batches(parts, self.host_pool.block_tokens):
                self._path.to_device(blocks, slots)
        return self._in.record()

    def _device_slots(self, lane: CopyLane, slots: torch.Tensor) -> torch.Tensor:
        lane.keep_alive(slots)
        return slots.to(self.device_pool.device, torch.int64)

    # ---- internals: committing and releasing
    def _commit_out(self, plan: _OutPlan) -> HostKV:
        req, bt = plan.req, self.host_pool.block_tokens
        if req.rid is not None:
            taken = self.mirror.take(req.rid, req.num_tokens)
            assert taken == plan.reused, (taken, plan.reused)
        copied = max(0, req.num_tokens - len(plan.reused) * bt)
        self.bytes_out += copied * self.host_pool.bytes_per_token
        self.bytes_reused += (req.num_tokens - copied) * self.host_pool.bytes_per_token
        self.rotations_out += 1
        return HostKV(tuple(plan.reused + plan.new), req.num_tokens, bt)

    def _commit_in(self, ins: list[RotateIn], hits: list[tuple[HostKV, CopyEvent]]) -> list[CopyEvent]:
        """Count the copies; consume the prefetches used (their copies stay held until they have run)."""
        served = sum(hk.num_tokens for hk, _ in hits) * self.host_pool.bytes_per_token
        self.bytes_in += sum(i.host_kv.num_tokens for i in ins) * self.host_pool.bytes_per_token - served
        self.bytes_prefetch_hits += served
        self.rotations_in += len(ins)
        self.prefetch_hits += len(hits)
        for hk, _ in hits:
            self._prefetched.drop(hk)
        return [event for _, event in hits]

    def _reap(self) -> None:
        """Release what finished copies held (everything, on a CPU); never blocks."""
        self._inflight.reap()
        self.mirror.prune()
        self.copy_timer.reap()

    def _finish(self, handle: RotationHandle) -> RotationHandle:
        handle.synchronize()
        self._reap()
        return handle


def _check_slots(slots: torch.Tensor) -> torch.Tensor:
    if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be a 1-D int32/int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
    return slots
