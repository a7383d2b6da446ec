"""RotaSched in the simulator: the production LVF (rotasched.lvf_decide) over views built by the
server's builder (rotasched.views: this module only reads a SimReq's numbers for it, as
integration/views.py reads SGLang's Req), executed the way the runtime executes a Decision.

The decision's rotate-outs go first, resumes restore KV into the (simulated) radix tree and requeue
the request, and SGLang's PrefillAdder sees the restored requests, then LVF's admissions, then the
rest of the queue.
"""

from __future__ import annotations

from superinfer_sgl.rotasched import Decision, ReqState, ReqView
from superinfer_sgl.rotasched.costs import CostMeter
from superinfer_sgl.rotasched.goodput import GoodputParams, StepCosts
from superinfer_sgl.rotasched.pending import PendingIndex, StepQueue
from superinfer_sgl.rotasched.planner import POLICIES, admission_order, chunk_tokens, mixes, plan_step, quantum_s
from superinfer_sgl.rotasched.shortage import victim_key
from superinfer_sgl.rotasched.views import (
    ADMISSION_RATIO,
    CLIP_MAX_NEW_TOKENS,
    ViewRules,
    blocks,
    free_blocks,
    reserve_tokens,
    rotary_need,
    waiting_need,
)
from superinfer_sgl.sim.policies.base import Plan, Policy, SimState, Victim, retraction_order
from superinfer_sgl.sim.request import SimReq


class RotaSched(Policy):
    """`direct_resume`: a what-if, not our runtime. Resumed requests join the decode batch at once
    (as vLLM's swap-in does, and the paper's implementation on vLLM) instead of being re-admitted
    through a prefill iteration with a one-token extend (our runtime's radix-tree path).
    `policy`: the server's --policy (`planner.POLICIES`). `shortage_rotates`: a decode memory
    shortage is answered as the server's `--decode-shortage rotate` does (`decode_victims`); else
    by SGLang's retraction (the paper-reproduction variants)."""

    def __init__(self, transfer: str, direct_resume: bool = False, policy: str = "paper",
                 name: str | None = None, shortage_rotates: bool = False) -> None:
        assert transfer in ("naive", "batched", "duplex"), transfer
        self.transfer = transfer
        self.resume_to_running = direct_resume
        self.policy = policy
        self.policy_class = POLICIES[policy]
        self.name = name or f"lvf-{transfer}" + ("-direct" if direct_resume else "")
        self.shortage_rotates = shortage_rotates
        self.last_decision: Decision | None = None
        self._short: bool | None = None
        self._by_rid: dict[str, SimReq] | None = None  # every request of the run, by rid
        self._meter: CostMeter | None = None  # SimConfig.measured_costs
        self._fed: tuple[float, int, int] | None = None  # the last step the meter was fed
        self._rules: ViewRules | None = None  # the run's (block size, running share)
        self._pending = PendingIndex()  # waiting and rotary views, kept between steps

    def plan(self, sim: SimState) -> Plan:
        cfg, now = sim.config, sim.now
        views = self._views(sim)
        free = free_blocks(sim.free_tokens, self._running_reserve(sim), cfg.block_tokens)
        policy = self.policy_class.for_step(lambda: self._goodput(sim))
        d = plan_step(self._queue(views), free, cfg.budget_blocks, now, cfg.vlt, policy, sim.chunked is not None,
                      cfg.mixed_chunk, cfg.mix_prefill, sim.host_free_tokens // cfg.block_tokens)
        self.last_decision = d
        by_rid = self._by_rid
        if by_rid is None:
            by_rid = self._by_rid = {r.spec.rid: r for r in sim.reqs}
        out = [by_rid[rid] for rid in d.rotate_out]
        resume = [sim.rotary[rid] for rid in d.resume]
        restored = [r.spec.rid for r in sim.waiting if r.restored] + list(d.resume)
        order = admission_order([r.spec.rid for r in sim.waiting], restored, d)
        sched = sim.profile.scheduler.lvf_s_per_view * len(views)
        return Plan(admit=[by_rid[rid] for rid in order], rotate_out=out, resume=resume, sched_s=sched,
                    chunk_tokens=chunk_tokens(sim.profile.server.chunked_prefill_tokens, d), mix=mixes(d, restored))

    def decode_victims(self, sim: SimState, short: int) -> list[Victim]:
        """The server's answer to a decode memory shortage (integration/decode_shortage.py):
        requests it may rotate out go to host, in `shortage.victim_key`'s order, until the step
        fits; what is still short, SGLang retracts in its own order (the engine retracts a
        victim the host pool cannot take, as the server falls back); the last request stays. A
        request may rotate unless a prefill still in flight writes its KV (prefilled by the last
        step, overlap scheduler), a decode row of the last mixed step allowed, as the server's
        `may_rotate`."""
        if not self.shortage_rotates:
            return super().decode_victims(sim, short)
        running, it = sim.running, sim.iteration
        sglang = retraction_order(running)
        turn = {r.spec.rid: i for i, r in enumerate(sglang)}
        movable = sorted((r for r in running if r.prefill_iter < it - 1 or r.mixed_iter == r.prefill_iter),
                         key=lambda r: victim_key(r.clock, r.remaining, turn[r.spec.rid]))
        victims: list[Victim] = []
        freed, keep = 0, len(running) - 1
        for r in movable:
            if freed >= short or len(victims) >= keep:
                return victims
            victims.append(Victim(r, swap=True))
            freed += r.alloc
        taken = {v.req.spec.rid for v in victims}
        for r in sglang:
            if freed >= short or len(victims) >= keep:
                break
            if r.spec.rid not in taken:
                victims.append(Victim(r, swap=False))
                freed += r.alloc
        return victims

    def _quantum(self, sim: SimState) -> float:
        """The rotation quantum: the configured one, else the server's default for this policy."""
        stint = sim.config.min_stint_s
        return quantum_s(self.policy, None if stint is None else stint * 1000.0, sim.profile.step.per_resume_s)

    def _goodput(self, sim: SimState) -> GoodputParams:
        """The step costs the server measures: what its CostMeter makes of the simulated steps
        (`SimConfig.measured_costs`, the default); or the profile's, exact for the current batch
        (what a server would measure at best)."""
        step, emit = sim.profile.step, sim.profile.server.emit_after_next_step
        if sim.config.measured_costs:
            return GoodputParams(self._measured(sim), sim.config.max_best_effort_wait_s, emit, sim.config.ttft_shedding,
                                 sim.output_share.share)
        decode = step.seconds(decode_reqs=max(1, len(sim.running)),
                              decode_context=sum([r.kv for r in sim.running]))
        # decode already holds the step's fixed time (base_s): a prefill adds only its own
        costs = StepCosts(step.per_prefill_token_s, step.prefill_base_s, decode, step.per_resume_s,
                          sim.config.step_jitter)
        return GoodputParams(costs, sim.config.max_best_effort_wait_s, emit, sim.config.ttft_shedding,
                             sim.output_share.share)

    def _measured(self, sim: SimState) -> StepCosts:
        """The server's meter, fed each simulated iteration once, as the server's `Clocks.measure_last_step`
        feeds it (starting, as the server does, from nothing measured; the rotation's cost is
        the profile's, which the server measures on every rotation)."""
        if self._meter is None:
            self._meter = CostMeter(StepCosts(0.0, 0.0, 0.0, sim.profile.step.per_resume_s))
        last = sim.last_step
        if last is not None and last is not self._fed:
            self._fed = last
            self._meter.observe_step(*last)
        return self._meter.costs

    # ---- admission (SGLang's PrefillAdder under our patch: patches/running_reserve.py) --------
    def rules(self, sim: SimState) -> ViewRules:
        if self._rules is None:
            share = sim.config.running_reserve
            self._rules = ViewRules(sim.config.block_tokens, CLIP_MAX_NEW_TOKENS,
                                    self.policy_class.running_reserve if share is None else share)
        return self._rules

    def running_ratio(self, sim: SimState) -> float:
        """The new-token ratio of a running request's reserve (rotasched.views.running_reserve_ratio)."""
        return self.rules(sim).running_ratio(sim.config.ignore_eos, sim.new_token_ratio)

    def admission_room(self, sim: SimState) -> float:
        return sim.free_tokens - self._running_reserve(sim)

    # ---- views (the builder's, over a SimReq's numbers) ----------------------------------------
    def _running_reserve(self, sim: SimState) -> float:
        ratio, clip = self.running_ratio(sim), CLIP_MAX_NEW_TOKENS
        # sum of reserve_tokens(left, ratio), inlined: this runs over the running batch every iteration
        held = sum([((left if (left := r.spec.max_new_tokens - r.outputs) < clip else clip) * ratio)
                    for r in sim.running])
        return held + (_reserve(sim.chunked, sim.new_token_ratio) if sim.chunked is not None else 0.0)

    def _views(self, sim: SimState) -> list[ReqView]:
        """The engine clears a request's cached view whenever it moves. While it stays put its
        blocks only change with SGLang's new-token ratio (or past the 4096-token reserve clip),
        so with ratio 1 (ignore_eos) and short outputs a cached view is reused unchecked (a running
        one only while its own reserve keeps every remaining output: `running_ratio` 1); and a
        running request, once rotatable, stays rotatable until it moves (its outputs and the
        iteration only grow, its prefill iteration and stint start are fixed)."""
        rules = self.rules(sim)
        bt, it, ratio, fixed = rules.block_tokens, sim.iteration, sim.new_token_ratio, sim.config.ignore_eos
        run_ratio = self.running_ratio(sim)
        exact = ratio == 1.0 and self._short_outputs(sim)
        exact_running = exact and run_ratio == 1.0
        young = sim.now - self._quantum(sim)
        views: list[ReqView] = []
        add = views.append
        running_view = rules.running
        # A policy that reads a running request's gap budget, which moves with every step.
        fresh = self.policy_class.reads_running_progress
        for r in sim.running:
            v = r.view
            if exact_running and not fresh and v is not None and v.rotatable:
                add(v)
                continue
            # Overlap scheduler: a request prefilled by the previous batch is still being written.
            rotatable = r.outputs > 0 and r.prefill_iter < it - 1 and r.clock.run_start <= young  # type: ignore[operator]
            if fresh:
                add(running_view(r.clock, r.ctx, r.remaining, run_ratio, rotatable, fixed))
                continue
            if v is None or v.rotatable is not rotatable or not exact_running:
                held = blocks(r.ctx + _reserve(r, run_ratio), bt)
                if v is None or v.rotatable is not rotatable or v.blocks_held != held:
                    v = r.view = running_view(r.clock, r.ctx, r.remaining, run_ratio, rotatable, fixed)
            add(v)
        if exact:
            for r in sim.waiting:  # kv > 0: a restored prefix awaiting admission
                v = r.view
                add(v if v is not None else _waiting_view(rules, r, ADMISSION_RATIO, fixed))
            for r in sim.rotary.values():
                v = r.view
                add(v if v is not None else _rotary_view(rules, r, ADMISSION_RATIO))
        else:
            for r in sim.waiting:
                add(_waiting_view(rules, r, ADMISSION_RATIO, fixed))
            for r in sim.rotary.values():
                add(_rotary_view(rules, r, ADMISSION_RATIO))
        return views

    def _queue(self, views: list[ReqView]) -> StepQueue:
        """The step's queue, its pending index kept between steps as the server keeps it (a view
        the engine did not rebuild is the same object: filed once)."""
        pending = self._pending
        running = [v for v in views if v.state is _RUNNING]
        now_pending = {v.rid: v for v in views if v.state is not _RUNNING}
        for rid in [rid for rid in pending.views if rid not in now_pending]:
            pending.drop(rid)
        for v in now_pending.values():
            pending.put(v)
        return StepQueue(running, pending)

    def _short_outputs(self, sim: SimState) -> bool:
        if self._short is None:
            self._short = all(r.spec.max_new_tokens <= CLIP_MAX_NEW_TOKENS for r in sim.reqs)
        return self._short


_RUNNING, _WAITING, _ROTARY = ReqState.RUNNING, ReqState.WAITING, ReqState.ROTARY


def _reserve(r: SimReq, ratio: float) -> float:
    """The request's decode reserve (rotasched.views.reserve_tokens)."""
    return reserve_tokens(r.spec.max_new_tokens - r.outputs, ratio)


def _waiting_view(rules: ViewRules, r: SimReq, ratio: float, fixed: bool) -> ReqView:
    """A waiting request's view, `kv` its resident tokens (a restored prefix or a shared one);
    the cached one while its need is unchanged."""
    spec, v = r.spec, r.view
    if v is None or v.blocks_needed != blocks(waiting_need(spec.prompt_tokens, r.outputs, r.kv, r.remaining, ratio),
                                              rules.block_tokens):
        v = r.view = rules.waiting(r.clock, spec.prompt_tokens, r.outputs, r.kv, r.remaining, ratio, fixed)
    return v


def _rotary_view(rules: ViewRules, r: SimReq, ratio: float) -> ReqView:
    """A rotary request's view, `host` its tokens on host; the cached one while its need is unchanged."""
    v = r.view
    if v is None or v.blocks_needed != blocks(rotary_need(r.host, r.remaining, ratio), rules.block_tokens):
        v = r.view = rules.rotary(r.clock, r.host, r.remaining, ratio)
    return v
