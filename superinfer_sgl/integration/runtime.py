"""RotaSched inside SGLang's scheduler: per-iteration LVF decisions turned into SGLang actions.

One RotaSchedRuntime lives on each scheduler (rank). Once per iteration, just before SGLang builds
its prefill batch, it observes every request's progress, asks the pure policy (rotasched.lvf) who
should run, rotates running requests out to host memory, brings rotary requests back through the
radix tree, and hands SGLang's PrefillAdder only the requests LVF admitted, in LVF's order.

It keeps the loop (observe, views, decide, rotate, admit) and SGLang's entry points; its state
lives in explicit collaborators it builds without I/O: `Clocks` (request clocks, measured step
costs), `RotaryStore` (rotary requests, resume locks, KV digests, prefetched slots) and
`Prefetcher`. `startup.create_runtime` opens the engine, metrics and TP broadcast and hands them in.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..config import SuperInferConfig
from ..duplexkv.engine import RotationEngine
from ..rotasched import Decision, DecisionSync, ReqState, VltParams
from ..rotasched import planner
from ..rotasched.goodput import GoodputParams
from ..rotasched.lvf import rank_order
from ..rotasched.pending import StepQueue
from ..rotasched.policy import LvfPolicy
from ..rotasched.views import CLIP_MAX_NEW_TOKENS, ViewRules
from . import chunk_room, rotation
from . import views as req_views
from .clocks import Clocks, step_prior
from .metrics import metered
from .prefetch import Prefetcher
from .rotary_store import RotaryStore, abort_match
from .rotation import RotationStats
from .step_figures import step_figures

logger = logging.getLogger(__name__)


class RotaSchedRuntime:
    def __init__(self, sched: Any, cfg: SuperInferConfig, *, engine: RotationEngine | None = None,
                 metrics: Any = None, broadcast: Callable[[object], object] | None = None,
                 link_bytes_per_s: float | None = None, disabled_reason: str | None = None,
                 clip: int = CLIP_MAX_NEW_TOKENS) -> None:
        """`engine`: None runs SGLang's own scheduling (rotation off, `disabled_reason` why);
        `broadcast`: rank 0's object to every TP rank (None: one rank); `link_bytes_per_s`: the KV
        link's measured speed, for the auto rotation budget; `clip`: SGLang's decode reserve clip
        (startup reads SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION)."""
        self.sched, self.cfg = sched, cfg
        self.engine, self.disabled_reason, self.metrics = engine, disabled_reason, metrics
        self.params = VltParams(cfg.vlt_alpha, cfg.vlt_beta_ttft, cfg.vlt_beta_tbt)
        self.policy_class = planner.POLICIES[cfg.policy]  # --policy; an object per step (_step_policy)
        on_cpu = str(getattr(getattr(sched, "server_args", None), "device", "cpu")) == "cpu"
        self.emit_late = on_cpu and bool(getattr(sched, "enable_overlap", False))  # docs/sim.md: result lag
        self.eager_sync = cfg.eager_sync if cfg.eager_sync is not None else not on_cpu  # config.py
        self.clocks = Clocks(cfg, step_prior(on_cpu), pool_tokens=getattr(sched, "max_total_num_tokens", 0),
                             link_bytes_per_s=link_bytes_per_s, clip=clip)
        self.stats = RotationStats()
        self.store = RotaryStore(sched, engine, self.stats, verify=cfg.verify_rotation)
        self.budget = self.clocks.rotation_budget(None)  # B_xfer: the paper's until a step is measured
        self.inbound_blocks = 0  # host blocks copied in by this step's resumes
        self.iteration = 0
        self._decision = Decision()  # the last step's decision (its prefill cap sizes the next chunk)
        self._alone: Any = None  # the last prefill batch run unmixed beside running requests (CostMeter)
        # Test knobs (config.TEST_KNOB_ENV): forced rotations and a minimum rotary hold.
        self.rotate_every, self.hold_rotary = cfg.test_rotate_interval, cfg.test_hold_rotary_iters
        self.broadcast: Callable[[object], object] = broadcast or (lambda obj: obj)
        self.sync = DecisionSync(getattr(sched, "tp_rank", 0), self.broadcast)
        # A running request's decode reserve (--running-reserve): a share of SGLang's only where
        # a rotation can answer a shortage.
        share = cfg.running_reserve if cfg.running_reserve is not None else self.policy_class.running_reserve
        self.running_share = share if engine is not None else 1.0
        self.rules = ViewRules(cfg.rotary_block_tokens, clip, self.running_share)
        # views rebuilt only for requests whose inputs changed (reuse=False: all, every step)
        self.step_views = req_views.StepViews(self.rules)
        self._reserved = 0.0  # the running batch's decode reserve, this step
        self.prefetcher = Prefetcher(sched, engine, self.store, self.stats, self.broadcast, self.hold_rotary,
                                     self.rules)

    # ---- the per-iteration step --------------------------------------------------------------
    def around_prefill(self, original: Callable[..., Any], sched: Any, running_batch: Any) -> Any:
        now = time.monotonic()
        self.iteration += 1
        self.clocks.measure_last_step(getattr(sched, "last_batch", None), now, self._alone)
        budget = self.clocks.rotation_budget(None if self.engine is None else self.engine.host_pool.bytes_per_block)
        live = [r for r in running_batch.reqs if not r.finished()]
        # waiting requests are observed once, when they enter the queue (a clock, their state)
        self.clocks.observe(live, self.step_views.watch.look(self.sched.waiting_queue), now)
        if self.engine is None:
            self.budget = budget
            plan = original(sched, running_batch)
        else:
            order = self._step(running_batch, live, now, budget)
            plan = self._admit_in_order(original, sched, running_batch, order)
        if self.metrics is not None:
            self.metrics.update(step_figures(self.sched, self.engine, self.clocks, self.store, self.stats,
                                             self.budget, self.params, self.cfg.max_best_effort_wait_ms / 1000.0,
                                             self.rules.clip))
        return plan

    def _step(self, running_batch: Any, live: list[Any], now: float, budget: int) -> list[Any]:
        """`budget`: this rank's rotation budget; the step runs on rank 0's (`DecisionSync`)."""
        if self.eager_sync:
            self._eager_sync(live)  # within the budget agreed at the last step
        queue = self._views(live, now)
        policy = self._step_policy()
        decision, self.budget = self.sync.decide(lambda: self._decide(queue, running_batch, now, policy, budget),
                                                 budget)
        self._decision = decision
        self.stats.decisions += 1
        self.stats.contended_decisions += decision.contention
        by_rid = {r.rid: r for r in live} if decision.rotate_out else {}
        out = [by_rid[rid] for rid in decision.rotate_out if rid in by_rid]
        out += self._forced(live, out)
        resumes = self._resumable(decision.resume)
        self.prefetcher.cancel_except(keep={e.req.rid for e in resumes})  # wrong guesses' slots are free again
        room = chunk_room.victims(self, running_batch, out, [e.req for e in resumes],
                                  planner.chunk_tokens(self.sched.chunked_prefill_size, decision),
                                  bool(getattr(self.sched, "is_mixed_chunk", False)))
        self.stats.chunk_room_rotations += len(room)
        out += room
        held = self._held_back(self._rotate(running_batch, out, resumes, now))
        # Resumed requests first (their KV is back and pinned by our lock), then admissions in
        # LVF's order, then the rest (planner.admission_order). Built from the decision alone so
        # every TP rank offers the same queue.
        locks = self.store.resume_locks
        watch = self.step_views.watch
        if out or resumes:  # resumed and recomputed requests joined the queue
            watch.look(self.sched.waiting_queue)
        waiting = watch.by_rid
        order = [waiting[rid] for rid in planner.admission_order(waiting.keys(), list(locks), decision)
                 if rid in waiting and rid not in held]
        if self.cfg.prefetch and self.store.entries:  # (nothing rotary: nothing to prefetch)
            rules = self.rules
            # the running batch's reserve after this step's outs left it (the same sum when none did)
            reserved = self._reserved if not out else sum(
                req_views.running_reserve(self.sched, r, rules.running_share, rules.clip)
                for r in running_batch.reqs if not r.finished())
            first = set(locks) | set(decision.admit)
            # the policy's own order: a prefetch bets on the request LVF resumes next
            self.prefetcher.start(
                lambda: rank_order([v for v in queue.pending if v.state is ReqState.ROTARY], now, self.params,
                                   policy),
                [r for r in order if r.rid in first], locks, reserved,
                self.budget - self.inbound_blocks, self.iteration)
        return order

    def _eager_sync(self, live: list[Any]) -> None:
        engine = self.engine
        assert engine is not None
        # eager copies share the outbound budget, counted in link bytes: its blocks are the default
        # format's, and a pool per format (EnginesByFormat) has blocks of other sizes too
        budget = self.budget * engine.host_pool.bytes_per_block
        for req in live:
            if budget <= 0:
                return
            if req_views.rotatable(self.sched, req):
                before = engine.bytes_eager_out
                rotation.eager_sync(self.sched, req, engine, max_bytes=budget)
                budget -= engine.bytes_eager_out - before

    def _views(self, live: list[Any], now: float) -> StepQueue:
        """Every running, waiting and rotary request's view (`req_views.StepViews`); the running
        batch's decode reserve is kept for this step's free blocks and prefetch room."""
        young = now - self.clocks.min_stint_s  # stints that began after this are not over yet
        queue, self._reserved = self.step_views.build(self.sched, live, self.clocks.by_rid,
                                                      self.store.resume_locks, self.store.entries, young)
        return queue

    def _step_policy(self) -> LvfPolicy:
        """The --policy for this step, with the step costs measured so far."""
        return self.policy_class.for_step(lambda: GoodputParams(
            self.clocks.meter.costs, self.cfg.max_best_effort_wait_ms / 1000.0, self.emit_late,
            self.cfg.ttft_shedding, self.clocks.outputs.share))

    def _decide(self, queue: StepQueue, running_batch: Any, now: float, policy: LvfPolicy, budget: int) -> Decision:
        free = req_views.free_blocks(self.sched, self.store.prefetch_tokens(), self._reserved, self.rules.block_tokens)
        return planner.plan_step(queue, free, budget, now, self.params, policy,
                                 self.sched.chunked_req is not None, bool(getattr(self.sched, "is_mixed_chunk", False)),
                                 self.cfg.mix_prefill, self.engine.room_blocks(budget))

    # ---- rotate ------------------------------------------------------------------------------
    def _forced(self, live: list[Any], chosen: list[Any]) -> list[Any]:
        if not self.rotate_every or self.iteration % self.rotate_every:
            return []
        # The first rotatable request in batch order: the same choice on every TP rank.
        for req in live:
            if req not in chosen and req_views.rotatable(self.sched, req):
                self.stats.forced_rotations += 1
                return [req]
        return []

    def _resumable(self, rids: tuple[str, ...]) -> list[rotation.RotaryEntry]:
        entries = [self.store.entries.get(rid) for rid in rids]
        return [e for e in entries if e is not None and self.iteration - e.paused_iter >= self.hold_rotary]

    def _held_back(self, recomputed: list[Any]) -> set[str]:
        """Rids of this step's recompute fallbacks that wait a step: under the overlap scheduler the
        last decode batch, which holds them, is still in flight (its result is processed after this
        batch is built, from a copy of its request list). SGLang skips that result for a retracted
        request only until the request's next prefill clears the flag: prefilled in this step, it
        would take the in-flight token and then sample the same token again (a repeated token,
        docs/reliability.md). SGLang's own retraction never readmits in the step it retracts."""
        if not recomputed or not getattr(self.sched, "enable_overlap", False):
            return set()
        return {r.rid for r in recomputed}

    def _rotate(self, running_batch: Any, outs: list[Any], resumes: list[rotation.RotaryEntry],
                now: float) -> list[Any]:
        """This step's rotations out and resumes, as one engine call (both directions at once);
        returns the requests sent back to recompute (the host pool could not take them)."""
        self.inbound_blocks = 0
        if not outs and not resumes:
            return []
        assert self.engine is not None
        if outs:
            gone = {id(r) for r in outs}
            running_batch.filter_batch(keep_indices=[i for i, r in enumerate(running_batch.reqs) if id(r) not in gone])
            running_batch.batch_is_full = False
        self.store.digest(outs)
        t0 = time.monotonic()
        step = rotation.rotate_step(self.sched, self.engine, outs, [self._incoming(e) for e in resumes], now)
        moved = len(step.rotated) + len(step.resumed)
        if moved:
            self.clocks.meter.observe_rotation((time.monotonic() - t0) / moved)
        self.stats.duplex_steps += bool(step.rotated and step.resumed)
        clocks = self.clocks.by_rid
        for req in step.recompute:
            self.store.recomputed(req.rid)
            clk = clocks.get(req.rid)  # none if SGLang's queue limit turned the requeue away
            if clk is not None:
                clk.recomputes += 1
                clk.set_state(ReqState.WAITING, now)
        for entry in step.rotated:
            self.store.park(entry, self.iteration)
            clk = clocks[entry.req.rid]
            clk.rotations += 1
            clk.set_state(ReqState.ROTARY, now)
        for inc, lock in step.resumed:
            self.inbound_blocks += len(inc.host_kv.block_ids)
            self.store.resumed(inc.entry, lock)
            clocks[inc.entry.req.rid].set_state(ReqState.WAITING, now)
        return step.recompute

    def _incoming(self, entry: rotation.RotaryEntry) -> rotation.Incoming:
        inc = rotation.incoming(entry, self.sched.token_to_kv_pool_allocator.page_size)
        p = self.store.take_prefetch(entry.req.rid)
        if p is not None:  # the engine finds the prefetch by (HostKV, slots) and copies nothing
            assert p.host_kv == inc.host_kv, (p.host_kv, inc.host_kv)
            inc.slots = p.slots
            self.stats.prefetch_hits += 1
        return inc

    # ---- admit -------------------------------------------------------------------------------
    def _admit_in_order(self, original: Callable[..., Any], sched: Any, running_batch: Any,
                        order: list[Any]) -> Any:
        """Let SGLang's PrefillAdder see only LVF's admissions, in LVF's order; keep the rest.
        SGLang appends to the queue it is handed (a request whose grammar just compiled, or that was
        aborted in the grammar queue, moves there inside this very call): it gets a copy, so such a
        request counts as added, not as one we offered, and stays queued (issue 17: it was lost)."""
        before = list(sched.waiting_queue)
        offered = {id(r) for r in order}
        configured = sched.chunked_prefill_size
        mixed = getattr(sched, "is_mixed_chunk", None)  # SGLang reads it only within this call
        try:
            sched.waiting_queue = list(order)
            alone = bool(mixed) and not planner.mixes(self._decision, list(self.store.resume_locks))
            if alone:
                sched.is_mixed_chunk = False  # nobody running needs this prefill mixed (planner.plan_step)
            # the policy's prefill cap: this step's chunk size, lowered so the step keeps tight TBT SLOs
            rows = len(running_batch.reqs) if getattr(sched, "is_mixed_chunk", False) else 0
            sched.chunked_prefill_size = chunk_room.step_chunk(
                sched, planner.chunk_tokens(configured, self._decision, rows), rows)
            plan = original(sched, running_batch)
            if alone and running_batch.reqs:  # the cost meter keeps its time apart
                self._alone = getattr(plan, "batch_to_run", None)
                self.stats.prefills_alone += self._alone is not None
        finally:
            sched.chunked_prefill_size = configured
            if mixed is not None:
                sched.is_mixed_chunk = mixed
            after = sched.waiting_queue
            kept = {id(r) for r in after}
            admitted = [r for r in order if id(r) not in kept]
            added = [r for r in after if id(r) not in offered]
            gone = {id(r) for r in admitted}
            sched.waiting_queue = [r for r in before if id(r) not in gone] + added if gone else before + added
        self.store.unlock_admitted(admitted)
        self.step_views.watch.note_removed(admitted)
        return plan

    # ---- SGLang's entry points (hooks.py) ----------------------------------------------------
    def has_work(self) -> bool:
        return self.store.has_work()

    def before_abort(self, recv_req: Any) -> None:
        """Aborted rotary requests go back to the waiting queue, where SGLang's own abort path
        finds them; what we hold for them is released."""
        match = abort_match(recv_req)
        self.store.abort(match)
        for rid in self.clocks.drop(match):
            self.store.forget(rid)
        self.step_views.reset()  # requests still queued get their clocks again

    def on_finished(self, req: Any) -> dict[str, object] | None:
        self.store.forget_kv([req])
        clk = self.clocks.finish(req, time.monotonic(), metered(req))
        if clk is None:
            return None
        if self.metrics is not None:
            self.metrics.finished(clk.slo_class, clk.ttft_met, clk.tbt_met)
        return clk.meta_info()

    def forget_kv(self, reqs: list[Any]) -> None:
        """SGLang retracted these requests to recompute them: their mirrors would be stale."""
        self.store.forget_kv(reqs)

    def release_aborted(self, req: Any) -> None:
        """SGLang let `req` go itself (`Scheduler._release_aborted_request`), on paths that never
        call `abort_request`: its queue limit (`--max-queued-requests`) turning away a queued
        request, or a requeue of ours, as an arrival of higher priority comes. Our lock on a
        resumed request's prefix, its clock and its mirror go with it. (Through `abort_request`,
        `before_abort` already released them: nothing left to do.)"""
        rid = req.rid
        self.store.release_lock(rid)
        if rid in self.clocks.by_rid and self.clocks.drop(rid.__eq__):
            self.store.forget(rid)
            self.step_views.reset()  # its view leaves the pending index

    def after_retract_pause(self) -> None:
        """SGLang paused generation in `retract` mode (its weight-update path: every running
        request's KV dropped, to be recomputed with the new weights). Ours goes the same way: rotary
        requests are requeued to recompute, resume locks released, every host mirror dropped, so no
        KV of the old weights comes back and nothing of ours keeps SGLang from flushing its cache
        (`is_fully_idle` counts our work)."""
        now = time.monotonic()
        requeued = self.store.recompute_all()
        for req in requeued:
            clk = self.clocks.by_rid.get(req.rid)
            if clk is not None:
                clk.recomputes += 1
                clk.set_state(ReqState.WAITING, now)
        self.step_views.reset()
        if requeued:
            logger.info("superinfer: generation paused (retract): %d rotary request(s) requeued to recompute",
                        len(requeued))

    def retract_decode(self, original: Callable[[Any], Any], batch: Any) -> Any:
        """SGLang's `ScheduleBatch.retract_decode(batch)` (a decode memory shortage): requests
        rotated out to host first, SGLang's retraction for what rotation cannot take
        (decode_shortage.py; `--decode-shortage`)."""
        from . import decode_shortage

        return decode_shortage.answer(self, original, batch)
