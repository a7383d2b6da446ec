"""DuplexKV prefetch in the server: the next resume's KV on its way one iteration early.

After a step's rotations, the rotary request the policy ranks highest among those still rotary
starts copying back into device memory nobody this step needs (never evicting), within what is
left of the step's inbound rotation budget. If LVF resumes it next iteration the copy is already
done; if not, the slots are given back.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from typing import Any

from ..duplexkv.engine import RotationEngine
from ..rotasched import ReqView
from ..rotasched.views import ViewRules
from . import rotation
from .rotary_store import RotaryStore
from .views import waiting_need

# Rotary requests whose KV is prefetched at a time: each holds device slots until its resume.
PREFETCH_MAX_REQUESTS = 1


class Prefetcher:
    """Starts prefetches into the rotary store's `prefetched` and cancels the wrong guesses.

    Its collaborators: SGLang's scheduler (allocator, tree), the rotation engine (None: rotation is
    off, nothing is prefetched), the rotary store (its entries read, its prefetches written), the
    counters, and the TP broadcast (rank 0's choice wins); `hold_rotary` and `rules` are the
    runtime's (the test hold knob; the running share and the reserve clip)."""

    def __init__(self, sched: Any, engine: RotationEngine | None, store: RotaryStore,
                 stats: rotation.RotationStats, broadcast: Callable[[object], object],
                 hold_rotary: int = 0, rules: ViewRules | None = None) -> None:
        self.sched, self.engine, self.store, self.stats = sched, engine, store, stats
        self.broadcast, self.hold_rotary = broadcast, hold_rotary
        self.rules = rules or ViewRules(1)

    def start(self, rank: Callable[[], Sequence[ReqView]], queue: list[Any], restored: Container[str],
              running_reserved: float, budget: int, iteration: int) -> None:
        """`rank()`: the step's rotary views in the policy's order (`lvf.rank_order`); `queue`: the
        requests offered for admission this step, `restored` the rids among them whose KV is back;
        `running_reserved`: the running batch's decode reserve; `budget`: inbound rotation blocks
        left this step."""
        if self.engine is None:
            return
        room = self._room(queue, restored, running_reserved)
        if room <= 0 and getattr(self.sched, "tp_size", 1) <= 1:
            return  # no candidate fits (with TP every rank still meets the others in the broadcast)
        ranked = rank()
        prefetched = self.store.prefetched
        page = self.sched.token_to_kv_pool_allocator.page_size
        for entry in self._candidates(ranked, iteration):
            if len(prefetched) >= PREFETCH_MAX_REQUESTS:
                return
            inc = rotation.incoming(entry, page)
            n, blocks = inc.host_kv.num_tokens, len(inc.host_kv.block_ids)
            if n == 0 or n > room or blocks > budget:
                continue
            entry.prefetch_tried = True
            p = rotation.prefetch(self.sched, self.engine, inc)
            if p is None:
                continue
            prefetched[entry.req.rid] = p
            self.stats.prefetches += 1
            room -= n
            budget -= blocks

    def _candidates(self, ranked: Sequence[ReqView], iteration: int) -> list[rotation.RotaryEntry]:
        """Requests still rotary after this step (LVF did not resume them, or they found no memory,
        or the hold knob kept them), eligible to resume next iteration, not rotated out this very
        step and not prefetched before in this stint (a miss is not chased), in `ranked`'s order."""
        entries, prefetched = self.store.entries, self.store.prefetched

        def eligible(rid: str) -> bool:
            e = entries.get(rid)
            return (e is not None and rid not in prefetched
                    and not e.prefetch_tried and e.paused_iter < iteration
                    and iteration + 1 - e.paused_iter >= self.hold_rotary)

        rids = [v.rid for v in ranked if eligible(v.rid)]
        if len(rids) > 1:  # the order reads each rank's clock: TP ranks adopt rank 0's (same set)
            rids = list(self.broadcast(rids))  # type: ignore[call-overload]
        return [entries[rid] for rid in rids]

    def _room(self, queue: list[Any], restored: Container[str], running_reserved: float) -> int:
        """Free device tokens left once this step's commitments are met: the decode reserve of the
        running batch, and the whole need of the requests offered for admission (resumed ones need
        one token plus their reserve)."""
        sched, clip = self.sched, self.rules.clip
        committed = running_reserved
        for req in queue:
            committed += waiting_need(sched, req, req.rid in restored, clip)
        return int(sched.token_to_kv_pool_allocator.available_size() - committed)

    def cancel_except(self, keep: set[str]) -> None:
        """Prefetches whose request does not resume now were a wrong guess: give their slots back."""
        for rid in [r for r in self.store.prefetched if r not in keep]:
            self.store.drop_prefetch(rid)
