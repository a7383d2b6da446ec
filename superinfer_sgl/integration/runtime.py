"""RotaSched inside SGLang's scheduler: per-iteration LVF decisions turned into SGLang actions.

One RotaSchedRuntime lives on each scheduler (rank). Once per iteration, just before SGLang builds
its prefill batch, it observes every request's progress, asks the pure policy (rotasched.lvf) who
should run, rotates running requests out to host memory, brings rotary requests back through the
radix tree, and hands SGLang's PrefillAdder only the requests LVF admitted, in LVF's order.

Its constructor does no I/O: `startup.create_runtime` opens the engine, metrics and TP broadcast
and hands them in.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..config import SuperInferConfig
from ..duplexkv.engine import RotationEngine
from ..rotasched import (
    DEFAULT_CLASSES,
    Decision,
    DecisionSync,
    ReqState,
    ReqView,
    Slo,
    SloClasses,
    SloError,
    VltParams,
    resolve_slo,
)
from ..rotasched import planner
from ..rotasched.costs import CostMeter
from ..rotasched.goodput import GoodputParams, StepCosts
from ..rotasched.clock import ReqClock
from ..rotasched.lvf import rank_order
from ..rotasched.policy import LvfPolicy
from ..rotasched.views import CLIP_MAX_NEW_TOKENS, ViewRules
from . import rotation
from .rotation import RotationStats
from . import views as req_views
from .http_slo import intake_delay_s
from .prefetch import Prefetcher

logger = logging.getLogger(__name__)

# What one rotation costs a CPU server before any is measured (the CPU profile's
# step.per_resume_s, profiles/cpu-smollm2-135m.json); on a GPU a rotation's extra time starts at 0.
CPU_ROTATION_S_PRIOR = 0.058
MAX_MEASURED_STEP_S = 5.0  # a longer gap between iterations is an idle turn, not a step
_RUNNING, _WAITING = ReqState.RUNNING, ReqState.WAITING  # enum class lookups are slow per request


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
        self.params = VltParams(cfg.vlt_alpha, cfg.vlt_beta_ttft, cfg.vlt_beta_tbt)
        self.policy_class = planner.POLICIES[cfg.policy]  # --policy; an object per step (_step_policy)
        on_cpu = str(getattr(getattr(sched, "server_args", None), "device", "cpu")) == "cpu"
        self.meter = CostMeter(StepCosts(0.0, 0.0, 0.0, CPU_ROTATION_S_PRIOR if on_cpu else 0.0))
        self.emit_late = on_cpu and bool(getattr(sched, "enable_overlap", False))  # docs/sim.md: result lag
        self.eager_sync = cfg.eager_sync if cfg.eager_sync is not None else not on_cpu  # config.py
        self._last_step_t: float | None = None
        self.default_slo = Slo(cfg.ttft_slo_ms, cfg.tbt_slo_ms)
        self.classes = SloClasses.parse(cfg.slo_classes or DEFAULT_CLASSES, default=self.default_slo)
        self.bt = cfg.rotary_block_tokens
        self.pool_tokens = getattr(sched, "max_total_num_tokens", 0)
        self.link_bytes_per_s = link_bytes_per_s
        self.budget = planner.rotation_budget(cfg.rotation_budget_blocks, self.pool_tokens, self.bt)
        self.clocks: dict[str, ReqClock] = {}
        self.rotary: dict[str, rotation.RotaryEntry] = {}
        self.inbound_blocks = 0  # host blocks copied in by this step's resumes
        self.resume_locks: dict[str, Any] = {}
        self.stats = RotationStats()
        self.iteration = 0
        self._decision = Decision()  # the last step's decision (its prefill cap sizes the next chunk)
        # Test knobs (config.TEST_KNOB_ENV): forced rotations, a minimum rotary hold, KV hashing.
        self.rotate_every = cfg.test_rotate_interval
        self.hold_rotary = cfg.test_hold_rotary_iters
        self.verify = cfg.verify_rotation
        self.digests: dict[str, tuple[int, str]] = {}
        self.broadcast: Callable[[object], object] = broadcast or (lambda obj: obj)
        self.sync = DecisionSync(getattr(sched, "tp_rank", 0), self.broadcast)
        self.engine, self.disabled_reason, self.metrics = engine, disabled_reason, metrics
        # A running fixed-length request's decode reserve (--running-reserve): below SGLang's
        # (all remaining outputs) only where a rotation can answer a shortage.
        share = cfg.running_reserve if cfg.running_reserve is not None else self.policy_class.running_reserve
        self.running_share = share if engine is not None else 1.0
        self.rules = ViewRules(self.bt, clip, self.running_share)
        # views rebuilt only for requests whose inputs changed (reuse=False: all, every step)
        self.step_views = req_views.StepViews(self.rules, self.policy_class.reads_running_progress)
        self._reserved = 0.0  # the running batch's decode reserve, this step
        # rotary requests whose KV is coming back early
        self.prefetcher = Prefetcher(sched, engine, self.rotary, self.stats, self.broadcast, self.hold_rotary,
                                     self.rules)

    # ---- policy ------------------------------------------------------------------------------
    @property
    def min_stint_s(self) -> float:
        """The rotation quantum (LVF victims only): the flag, else the policy's default."""
        return planner.quantum_s(self.cfg.policy, self.cfg.min_stint_ms, self.meter.costs.rotation_s)

    # ---- bookkeeping -------------------------------------------------------------------------
    def clock(self, req: Any, now: float) -> ReqClock:
        clk = self.clocks.get(req.rid)
        if clk is None:
            params = getattr(req.sampling_params, "custom_params", None)
            try:
                slo = resolve_slo(params, self.default_slo, self.classes)
            except SloError:  # validated in the tokenizer; never drop a request over it here
                slo = self.default_slo
            cls = params.get("slo_class") if isinstance(params, dict) else None
            clk = ReqClock(req.rid, now - intake_delay_s(params, time.time()), slo,
                           slo_class=cls if isinstance(cls, str) else None)
            self.clocks[req.rid] = clk
        return clk

    def observe(self, running: list[Any], now: float) -> None:
        clocks = self.clocks
        for req in running:
            clk = clocks.get(req.rid)
            if clk is None:
                clk = self.clock(req, now)
            clk.observe_outputs(len(req.output_ids), now)
            if clk.state is not _RUNNING:  # (set_state keeps a running stint's start)
                clk.set_state(_RUNNING, now)
        for req in self.sched.waiting_queue:
            clk = clocks.get(req.rid)
            if clk is None:
                clk = self.clock(req, now)
            elif clk.state is _WAITING and clk.outputs_seen == len(req.output_ids):
                continue  # waiting since its last observation, with no new output: nothing to record
            clk.observe_outputs(len(req.output_ids), now)
            clk.set_state(_WAITING, now)

    def has_work(self) -> bool:
        # (A prefetched request is still rotary, so its slots are covered too.)
        return bool(self.rotary or self.resume_locks)

    # ---- the per-iteration step --------------------------------------------------------------
    def around_prefill(self, original: Callable[..., Any], sched: Any, running_batch: Any) -> Any:
        now = time.monotonic()
        self.iteration += 1
        self._measure_last_step(sched, now)
        self.budget = self._rotation_budget()
        live = [r for r in running_batch.reqs if not r.finished()]
        self.observe(live, now)
        if self.engine is None:
            plan = original(sched, running_batch)
        else:
            order = self._step(running_batch, live, now)
            plan = self._admit_in_order(original, sched, running_batch, order)
        if self.metrics is not None:
            self.metrics.update(self)
        return plan

    def _step(self, running_batch: Any, live: list[Any], now: float) -> list[Any]:
        if self.eager_sync:
            self._eager_sync(live, running_batch)
        views, by_rid = self._views(running_batch, live, now)
        policy = self._step_policy()
        decision = self.sync.decide(lambda: self._decide(views, running_batch, now, policy))
        self._decision = decision
        self.stats.decisions += 1
        self.stats.contended_decisions += decision.contention
        out = [by_rid[rid] for rid in decision.rotate_out if rid in by_rid]
        out += self._forced(running_batch, live, out)
        resumes = self._resumable(decision.resume)
        self.prefetcher.cancel_except(keep={e.req.rid for e in resumes})
        self._rotate(running_batch, out, resumes, now)
        # Resumed requests first (their KV is back and pinned by our lock), then admissions in
        # LVF's order, then the rest (planner.admission_order). Built from the decision alone so
        # every TP rank offers the same queue.
        queue = self.sched.waiting_queue
        rids = [r.rid for r in queue]
        by_rid_waiting = dict(zip(rids, queue))
        order = [by_rid_waiting[rid] for rid in planner.admission_order(rids, list(self.resume_locks), decision)
                 if rid in by_rid_waiting]
        if self.cfg.prefetch:
            rules = self.rules
            # the running batch's reserve after this step's outs left it (the same sum when none did)
            reserved = self._reserved if not out else sum(
                req_views.running_reserve(self.sched, r, rules.running_share, rules.clip)
                for r in running_batch.reqs if not r.finished())
            first = set(self.resume_locks) | set(decision.admit)
            # the policy's own order: a prefetch bets on the request LVF resumes next
            self.prefetcher.start(
                lambda: rank_order([v for v in views if v.state is ReqState.ROTARY], now, self.params, policy),
                [r for r in order if r.rid in first], self.resume_locks, reserved,
                self.budget - self.inbound_blocks, self.iteration)
        return order

    def _eager_sync(self, live: list[Any], running_batch: Any) -> None:
        budget = self.budget  # eager copies share the outbound budget
        for req in live:
            if budget <= 0:
                return
            if req_views.rotatable(self.sched, req):
                assert self.engine is not None
                before = self.engine.bytes_eager_out
                rotation.eager_sync(self.sched, req, self.engine, max_blocks=budget)
                budget -= (self.engine.bytes_eager_out - before) // self.engine.host_pool.bytes_per_block

    def _step_policy(self) -> LvfPolicy:
        """The --policy for this step, with the step costs measured so far."""
        return self.policy_class.for_step(lambda: GoodputParams(
            self.meter.costs, self.cfg.max_best_effort_wait_ms / 1000.0, self.emit_late))

    def _decide(self, views: list[ReqView], running_batch: Any, now: float, policy: LvfPolicy) -> Decision:
        free = req_views.free_blocks(self.sched, self.prefetcher.tokens(), self._reserved, self.bt)
        return planner.plan_step(views, free, self.budget, now, self.params,
                                 policy, self.sched.chunked_req is not None)

    def _rotation_budget(self) -> int:
        """B_xfer: the flag, else what the measured link moves in one measured decode step."""
        per_step = None
        if self.link_bytes_per_s is not None and self.meter.observed["decode"] and self.engine is not None:
            per_step = (self.link_bytes_per_s * self.meter.costs.decode_step_s
                        / self.engine.host_pool.bytes_per_block)
        return planner.rotation_budget(self.cfg.rotation_budget_blocks, self.pool_tokens, self.bt, per_step)

    def _measure_last_step(self, sched: Any, now: float) -> None:
        """Time from the previous iteration's start to this one's is the previous batch's step (an
        idle turn in between shows as a long one, which the bound below drops)."""
        last, start = getattr(sched, "last_batch", None), self._last_step_t
        self._last_step_t = now
        if last is None or start is None or now - start > MAX_MEASURED_STEP_S:
            return
        mode = last.forward_mode
        if mode.is_decode():
            self.meter.observe_step(now - start, 0, 1)
        elif mode.is_extend():
            # A mixed step also decoded its running requests (one token each, counted in
            # extend_num_tokens).
            rows = len(getattr(last, "decoding_reqs", None) or []) if mode.is_mixed() else 0
            tokens = int(getattr(last, "extend_num_tokens", 0) or 0) - rows
            if tokens > 0:
                self.meter.observe_step(now - start, tokens, rows)

    def _admit_in_order(self, original: Callable[..., Any], sched: Any, running_batch: Any,
                        order: list[Any]) -> Any:
        """Let SGLang's PrefillAdder see only LVF's admissions, in LVF's order; keep the rest.
        SGLang appends to the queue it is handed (a request whose grammar just compiled, or that was
        aborted in the grammar queue, moves there inside this very call): it gets a copy, so such a
        request counts as added, not as one we offered, and stays queued (issue 17: it was lost)."""
        before = list(sched.waiting_queue)
        offered = {id(r) for r in order}
        configured = sched.chunked_prefill_size
        try:
            sched.waiting_queue = list(order)
            # the policy's prefill cap: this step's chunk size, lowered so the step keeps tight TBT SLOs
            rows = len(running_batch.reqs) if getattr(sched, "is_mixed_chunk", False) else 0
            sched.chunked_prefill_size = planner.chunk_tokens(configured, self._decision, rows)
            plan = original(sched, running_batch)
        finally:
            sched.chunked_prefill_size = configured
            after = sched.waiting_queue
            kept = {id(r) for r in after}
            admitted = [r for r in order if id(r) not in kept]
            added = [r for r in after if id(r) not in offered]
            gone = {id(r) for r in admitted}
            sched.waiting_queue = [r for r in before if id(r) not in gone] + added if gone else before + added
        self._unlock_admitted(admitted)
        return plan

    def _unlock_admitted(self, admitted: list[Any]) -> None:
        # Admitted requests now hold their own tree lock on the restored prefix.
        for req in admitted:
            if req.rid in self.digests and req.rid in self.resume_locks:
                self._verify(req)
            lock = self.resume_locks.pop(req.rid, None)
            if lock is not None:
                self.sched.tree_cache.unlock(lock)

    def _verify(self, req: Any) -> None:
        n, digest = self.digests.pop(req.rid)
        # Only the first req.prefix_len rows of the admitted request's req_to_token row are KV it
        # reads from the tree; the rows after them are slots of the extend this very step builds,
        # not written yet (hashing them reported false changes for logprob requests). A shorter
        # match than the digest covers means those tokens are recomputed: nothing to compare.
        matched = getattr(req, "prefix_len", n)
        if matched < n:
            self.stats.kv_unverified += 1
            logger.warning("superinfer: KV of %s not verified: admission matched %d of the %d restored tokens "
                           "(the rest is recomputed)", req.rid, matched, n)
            return
        if rotation.device_kv_digest(self.sched, req, n) == digest:
            self.stats.kv_verified += 1
        else:
            self.stats.kv_mismatches += 1
            logger.error("superinfer: KV of %s changed across rotation (%d tokens)", req.rid, n)

    # ---- views for the policy (integration/views.py) ----------------------------------------
    @property
    def prefetched(self) -> dict[str, rotation.Prefetched]:
        return self.prefetcher.prefetched

    def _views(self, running_batch: Any, live: list[Any], now: float) -> tuple[list[ReqView], dict[str, Any]]:
        """Every running, waiting and rotary request's view (`req_views.StepViews`); the running
        batch's decode reserve is kept for this step's free blocks and prefetch room."""
        young = now - self.min_stint_s  # stints that began after this are not over yet
        views, self._reserved = self.step_views.build(self.sched, live, self.clocks, self.resume_locks,
                                                      self.rotary, young)
        return views, {r.rid: r for r in live}

    # ---- actions -----------------------------------------------------------------------------
    def _forced(self, running_batch: Any, live: list[Any], chosen: list[Any]) -> list[Any]:
        if not self.rotate_every or self.iteration % self.rotate_every:
            return []
        # The first rotatable request in batch order: the same choice on every TP rank.
        for req in live:
            if req not in chosen and req_views.rotatable(self.sched, req):
                self.stats.forced_rotations += 1
                return [req]
        return []

    def _resumable(self, rids: tuple[str, ...]) -> list[rotation.RotaryEntry]:
        entries = [self.rotary.get(rid) for rid in rids]
        return [e for e in entries if e is not None and self.iteration - e.paused_iter >= self.hold_rotary]

    def _rotate(self, running_batch: Any, outs: list[Any], resumes: list[rotation.RotaryEntry],
                now: float) -> None:
        """This step's rotations out and resumes, as one engine call (both directions at once)."""
        self.inbound_blocks = 0
        if not outs and not resumes:
            return
        assert self.engine is not None
        if outs:
            gone = {id(r) for r in outs}
            running_batch.filter_batch(keep_indices=[i for i, r in enumerate(running_batch.reqs) if id(r) not in gone])
            running_batch.batch_is_full = False
        if self.verify:
            for req in outs:
                # only what admission will read back (a logprob request extends past its logprob start)
                n = rotation.adoptable_tokens(req, rotation.restorable_tokens(req))
                self.digests[req.rid] = (n, rotation.device_kv_digest(self.sched, req, n))
        t0 = time.monotonic()
        step = rotation.rotate_step(self.sched, self.engine, outs, [self._incoming(e) for e in resumes], now)
        moved = len(step.rotated) + len(step.resumed)
        if moved:
            self.meter.observe_rotation((time.monotonic() - t0) / moved)
        self.stats.duplex_steps += bool(step.rotated and step.resumed)
        self._record(step, now)

    def _record(self, step: rotation.StepResult, now: float) -> None:
        for req in step.recompute:
            clk = self.clocks[req.rid]
            clk.recomputes += 1
            clk.set_state(ReqState.WAITING, now)
            self.stats.recompute_fallbacks += 1
            self.digests.pop(req.rid, None)  # recomputed, not restored: nothing to verify
        for entry in step.rotated:
            entry.paused_iter = self.iteration
            self.rotary[entry.req.rid] = entry
            clk = self.clocks[entry.req.rid]
            clk.rotations += 1
            clk.set_state(ReqState.ROTARY, now)
            self.stats.rotations_out += 1
        for inc, lock in step.resumed:
            self.inbound_blocks += len(inc.host_kv.block_ids)
            self._resumed(inc.entry, lock, now)

    def _incoming(self, entry: rotation.RotaryEntry) -> rotation.Incoming:
        inc = rotation.incoming(entry, self.sched.token_to_kv_pool_allocator.page_size)
        p = self.prefetcher.take(entry.req.rid)
        if p is not None:  # the engine finds the prefetch by (HostKV, slots) and copies nothing
            assert p.host_kv == inc.host_kv, (p.host_kv, inc.host_kv)
            inc.slots = p.slots
            self.stats.prefetch_hits += 1
        return inc

    def _resumed(self, entry: rotation.RotaryEntry, lock: Any, now: float) -> None:
        rid = entry.req.rid
        del self.rotary[rid]
        assert self.engine is not None
        self.engine.free(entry.host_kv)  # the mirror kept its own references to what it reuses
        self.resume_locks[rid] = lock
        self.sched.waiting_queue.append(entry.req)
        self.clocks[rid].set_state(ReqState.WAITING, now)
        self.stats.resumes += 1

    # ---- SGLang paths that must know the rotary queue ----------------------------------------
    def before_abort(self, recv_req: Any) -> None:
        """Hand rotary requests being aborted back to the waiting queue, where SGLang's own abort
        path finds them, and release what we hold for them."""
        def match(rid: str) -> bool:
            return bool(recv_req.abort_all) or rid.startswith(recv_req.rid)

        for rid in [r for r in self.prefetched if match(r)]:
            self.prefetcher.drop(rid)  # before its HostKV is freed: the slots are ours to give back
        for rid in [r for r in self.rotary if match(r)]:
            entry = self.rotary.pop(rid)
            self.stats.aborted_rotary += 1
            if self.engine is not None:
                self.engine.free(entry.host_kv)
            self.sched.waiting_queue.append(entry.req)
        for rid in [r for r in self.resume_locks if match(r)]:
            self.sched.tree_cache.unlock(self.resume_locks.pop(rid))
        for rid in [r for r in self.clocks if match(r)]:
            if self.engine is not None:
                self.engine.untrack(rid)
            del self.clocks[rid]
            self.digests.pop(rid, None)

    def on_finished(self, req: Any) -> dict[str, object] | None:
        if self.engine is not None:
            self.engine.untrack(req.rid)
        clk = self.clocks.pop(req.rid, None)
        if clk is None:
            return None
        clk.observe_outputs(len(req.output_ids), time.monotonic())
        if self.metrics is not None:
            self.metrics.finished(clk.slo_class, clk.ttft_met, clk.tbt_met)
        return clk.meta_info()

    def forget_kv(self, reqs: list[Any]) -> None:
        """SGLang retracted these requests to recompute them: their mirrors would be stale."""
        if self.engine is not None:
            for req in reqs:
                self.engine.untrack(req.rid)

    def pool_usage(self) -> dict[str, int]:
        if self.engine is None:
            return {"host_blocks_used": 0, "host_blocks_total": 0}
        alloc = self.engine.host_pool.allocator
        return {"host_blocks_used": alloc.num_used, "host_blocks_total": self.engine.host_pool.num_blocks}
