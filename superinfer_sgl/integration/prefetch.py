"""DuplexKV prefetch in the server: the next resume's KV on its way one iteration early.

After a step's rotations, the rotary request LVF ranks highest among those still rotary starts
copying back into device memory nobody this step needs (never evicting), within what is left of
the step's inbound rotation budget. If LVF resumes it next iteration the copy is already done; if
not, the slots are given back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..rotasched import ReqState, ReqView, vlt
from . import rotation
from .views import reserve

if TYPE_CHECKING:
    from .runtime import RotaSchedRuntime

# Rotary requests whose KV is prefetched at a time: each holds device slots until its resume.
PREFETCH_MAX_REQUESTS = 1


class Prefetcher:
    """The prefetches in flight (`prefetched`: rotary rid -> its slots and copy), for one runtime
    whose rotary set, budget and iteration count it reads."""

    def __init__(self, rt: RotaSchedRuntime) -> None:
        self.rt = rt
        self.prefetched: dict[str, rotation.Prefetched] = {}

    def tokens(self) -> int:
        """Device slots held for prefetches (free for admission: given back first)."""
        return sum(p.host_kv.num_tokens for p in self.prefetched.values())

    def take(self, rid: str) -> rotation.Prefetched | None:
        """The prefetch of a request that resumes now (its slots become the resume's)."""
        return self.prefetched.pop(rid, None)

    def start(self, views: list[ReqView], running_batch: Any, queue: list[Any], now: float) -> None:
        rt = self.rt
        if rt.engine is None:
            return
        room = self._room(running_batch, queue)
        budget = rt.budget - rt.inbound_blocks
        page = rt.sched.token_to_kv_pool_allocator.page_size
        for entry in self._candidates(views, now):
            if len(self.prefetched) >= PREFETCH_MAX_REQUESTS:
                return
            inc = rotation.incoming(entry, page)
            n, blocks = inc.host_kv.num_tokens, len(inc.host_kv.block_ids)
            if n == 0 or n > room or blocks > budget:
                continue
            entry.prefetch_tried = True
            p = rotation.prefetch(rt.sched, rt.engine, inc)
            if p is None:
                continue
            self.prefetched[entry.req.rid] = p
            rt.stats.prefetches += 1
            room -= n
            budget -= blocks

    def _candidates(self, views: list[ReqView], now: float) -> list[rotation.RotaryEntry]:
        """Requests still rotary after this step (LVF did not resume them, or they found no memory,
        or the hold knob kept them), eligible to resume next iteration, not rotated out this very
        step and not prefetched before in this stint (a miss is not chased): largest VLT first,
        then arrival, then rid (LVF's own order)."""
        rt = self.rt

        def eligible(rid: str) -> bool:
            e = rt.rotary.get(rid)
            return (e is not None and rid not in self.prefetched
                    and not e.prefetch_tried and e.paused_iter < rt.iteration
                    and rt.iteration + 1 - e.paused_iter >= rt.hold_rotary)

        ranked = sorted((-vlt(v, now, rt.params), v.arrival, v.rid) for v in views
                        if v.state == ReqState.ROTARY and eligible(v.rid))
        rids = [rid for _, _, rid in ranked]
        if len(rids) > 1:  # VLT reads each rank's clock: TP ranks adopt rank 0's order (same set)
            rids = list(rt.broadcast(rids))
        return [rt.rotary[rid] for rid in rids]

    def _room(self, running_batch: Any, queue: list[Any]) -> int:
        """Free device tokens left once this step's commitments are met: the decode reserve of the
        running batch, and the whole need of the requests offered for admission (resumed ones need
        one token plus their reserve)."""
        sched = self.rt.sched
        committed = sum(reserve(sched, r) for r in running_batch.reqs if not r.finished())
        for req in queue:
            resident = rotation.restorable_tokens(req) if req.rid in self.rt.resume_locks else 0
            committed += len(req.origin_input_ids) + len(req.output_ids) - resident + reserve(sched, req)
        return int(sched.token_to_kv_pool_allocator.available_size() - committed)

    def cancel_except(self, keep: set[str]) -> None:
        """Prefetches whose request does not resume now were a wrong guess: give their slots back."""
        for rid in [r for r in self.prefetched if r not in keep]:
            self.drop(rid)

    def drop(self, rid: str) -> None:
        assert self.rt.engine is not None
        rotation.cancel_prefetch(self.rt.sched, self.rt.engine, self.prefetched.pop(rid))
        self.rt.stats.prefetch_cancelled += 1
