"""Iteration-level discrete-event replay of a workload through one scheduling policy.

One loop turn = one scheduler iteration of SGLang: arrivals join the waiting queue, the policy
plans, KV moves are applied (their link time delays the iteration), SGLang's PrefillAdder admits
from the plan's order, then either a prefill batch or one decode step of the running batch runs
(SGLang's default; with mixed_chunk a prefill batch also decodes the running batch) for the cost
model's time, and tokens are stamped with the iteration's end time (with the profile's
emit_after_next_step, the next iteration's: SGLang's overlap scheduler on a CPU).
"""

from __future__ import annotations

import math
import random
from array import array
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass, field

from superinfer_sgl.rotasched.output_share import OutputShare
from superinfer_sgl.rotasched.request_view import ReqState
from superinfer_sgl.sim.policies.base import Plan, Policy
from superinfer_sgl.sim.profile import Profile
from superinfer_sgl.sim.settings import SimConfig
from superinfer_sgl.sim.request import Phase, SimReq, new_req
from superinfer_sgl.sim.transfer import make_engine
from superinfer_sgl.sim.workload import Workload

# SGLang's new-token ratio schedule (used only without ignore_eos): init 0.7, floor 0.7 * 0.14,
# linear decay over 600 decode steps.
_RATIO_INIT, _RATIO_MIN, _RATIO_STEPS = 0.7, 0.098, 600
# Enum members as module constants: class attribute lookups are slow in the per-move paths.
_P_WAITING, _P_RUNNING, _P_ROTARY = Phase.WAITING, Phase.RUNNING, Phase.ROTARY
_S_WAITING, _S_RUNNING, _S_ROTARY = ReqState.WAITING, ReqState.RUNNING, ReqState.ROTARY


@dataclass
class SimStats:
    iterations: int = 0
    prefill_iterations: int = 0
    decode_iterations: int = 0
    rotations_out: int = 0
    resumes: int = 0
    retractions: int = 0
    shortage_rotations: int = 0  # decode shortages' victims moved to host (not retracted)
    host_full_fallbacks: int = 0
    peak_rotary: int = 0  # most requests parked in the host pool at once
    peak_host_tokens: int = 0
    bytes_out: float = 0.0
    bytes_in: float = 0.0
    eager_bytes: float = 0.0
    transfer_s: float = 0.0
    compute_s: float = 0.0
    sched_s: float = 0.0
    dropped: int = 0
    stalled: bool = False


class Simulator:
    def __init__(self, workload: Workload, profile: Profile, policy: Policy,
                 config: SimConfig | None = None) -> None:
        self.workload, self.profile, self.policy = workload, profile, policy
        self.config = config or SimConfig()
        delay = self._delay = profile.server.request_overhead_s
        self.reqs = [new_req(s, policy.prefix_cache, delay) for s in workload.requests]
        self.engine = make_engine(policy.transfer, profile.link, profile.model, self.config.block_tokens)
        self.kv_bytes = profile.model.kv_bytes_per_token
        # The radix cache holds the shared prompt prefix once, outside every request's allocation.
        self.capacity = profile.server.kv_tokens - max([r.shared for r in self.reqs], default=0)
        self.waiting: list[SimReq] = []
        self.running: list[SimReq] = []
        self.rotary: dict[str, SimReq] = {}  # in rotate-out order
        self.chunked: SimReq | None = None
        self.used = 0  # device tokens allocated
        self.host_used = 0  # host tokens held by rotary requests
        self.now = 0.0
        self.iteration = 0
        self.new_token_ratio = 1.0 if self.config.ignore_eos else _RATIO_INIT
        # what finished requests of unknown length decoded of their max_new_tokens (the server's Clocks.outputs)
        self.output_share = OutputShare()
        self.gaps = array("d")  # every inter-token gap, seconds
        # emit_after_next_step: the last step's results (its tokens, the KV of the requests it
        # finished) are processed when the next step ends, or at the step's own end
        # (`_unsent_at`) when the server idles instead
        self._defer = profile.server.emit_after_next_step
        self._unsent: list[tuple[SimReq, int]] = []
        self._unsent_at = 0.0
        self._unfreed = 0  # device KV of requests finished in the last step, not yet freed
        self._trace_t = [t for t, _ in self.config.speed_trace]
        self._trace_f = [f for _, f in self.config.speed_trace]
        self.stats = SimStats()
        # The last iteration as the server times it: (seconds, prefill tokens, decode rows).
        # (seconds, prefill tokens, decode rows, a prefill run alone beside running requests)
        self.last_step: tuple[float, int, int, bool] | None = None
        self._jitter = _jitter(self.config.step_jitter, self.config.jitter_seed)
        self._next = 0  # next arrival index
        self._done = 0
        self._out = self._in = 0.0  # bytes moved this iteration
        self._pruned = True
        # Constants of the run, read on every move.
        self._bt = self.config.block_tokens
        self._host_cap = profile.server.host_kv_tokens
        self._eager = self.engine.eager_sync
        self._page = policy.page_tokens

    # ---- public ------------------------------------------------------------------------------
    @property
    def free_tokens(self) -> int:
        return self.capacity - self.used

    @property
    def host_free_tokens(self) -> int:
        """Host tokens rotary requests may still take (`move_out` recomputes a request beyond them)."""
        return max(0, self._host_cap - self.host_used)

    def run(self) -> Simulator:
        horizon = self.workload.duration + self.config.drain_s
        while self._done < len(self.reqs) and self.now <= horizon and not self.stats.stalled:
            self.step()
        self._send_unsent(self._unsent_at)
        return self

    def step(self) -> None:
        self._arrive()
        if not (self.waiting or self.running or self.rotary or self.chunked):
            self._idle()
            return
        self._out = self._in = 0.0
        plan = self.policy.plan(self)
        self._apply(plan)
        alone = self.config.mixed_chunk and not plan.mix and bool(self.running)  # (before the admissions)
        batch = self._admit(plan.admit, plan.chunk_tokens)
        tokens, pairs, restored = self._prefill(batch) if batch else (0, 0.0, 0)
        decoding = self._decode() if not batch or (self.config.mixed_chunk and plan.mix) else []
        if batch and decoding:
            self._mark_mixed(decoding)
        context = sum([r.kv for r in decoding])
        step = self.profile.step
        compute = step.seconds(tokens, pairs, len(batch), len(decoding), context)
        if restored:
            compute += step.per_resume_s * restored
        if self._jitter is not None:
            compute *= self._jitter()
        if self._trace_t:
            i = bisect_right(self._trace_t, self.now)
            compute *= self._trace_f[i - 1] if i else 1.0
        xfer = self.engine.seconds(self._out, self._in)
        dt = plan.sched_s + (max(xfer, compute) if self.config.lookahead else xfer + compute)
        if dt <= 0.0:
            self._idle()
            return
        self._account(plan, xfer, compute, bool(batch))
        self.last_step = (dt, tokens, len(decoding), alone and bool(batch))
        self.now += dt
        self._send_unsent(self.now)
        self._emit(decoding, joined=False)
        self._emit([r for r, _ in batch if r.kv == r.ctx], joined=True)

    # ---- arrivals and idling -----------------------------------------------------------------
    def _arrive(self) -> None:
        reqs, n = self.reqs, len(self.reqs)
        seen = self.now - self._delay  # sent by then, so at the scheduler by now
        while self._next < n and reqs[self._next].spec.arrival <= seen:
            r = reqs[self._next]
            self._next += 1
            if r.spec.prompt_tokens + r.spec.output_tokens > self.capacity:
                self._set(r, Phase.DROPPED)  # could never fit: a real server rejects it
                self.stats.dropped += 1
                self._done += 1
                continue
            self.waiting.append(r)

    def _idle(self) -> None:
        if self._unsent or self._unfreed:  # nothing to launch: the loop processes the last results now
            self._send_unsent(self._unsent_at)
            return
        if self._next < len(self.reqs):
            self.now = max(self.now, self.reqs[self._next].spec.arrival + self._delay)
        elif self._done < len(self.reqs):
            self.stats.stalled = True  # work left, none runnable, nothing to wait for

    # ---- moves -------------------------------------------------------------------------------
    def _apply(self, plan: Plan) -> None:
        for r in plan.retract:
            self.retract(r)
        for r in plan.rotate_out:
            self.move_out(r)
        self._prune_running()
        for r in plan.resume:
            self._move_in(r)

    def _set(self, r: SimReq, phase: Phase, state: ReqState | None = None) -> None:
        r.phase = phase
        r.view = None
        if state is not None:
            r.clock.set_state(state, self.now)

    def _leave_running(self, r: SimReq) -> None:
        # Leaves self.running until _prune_running(): one pass for many moves.
        self.used -= r.alloc
        r.alloc = 0
        self._pruned = False

    def _prune_running(self) -> None:
        if not self._pruned:
            self.running = [r for r in self.running if r.phase is _P_RUNNING]
            self._pruned = True

    def retract(self, r: SimReq) -> None:
        """Free a running request's KV; it waits to be recomputed (SGLang retract, vLLM recompute)."""
        assert r.phase is Phase.RUNNING, (r.rid, r.phase)
        self._leave_running(r)
        r.kv, r.host = r.shared, 0
        self._set(r, Phase.WAITING, ReqState.WAITING)
        r.recomputes += 1
        self.stats.retractions += 1
        if self.policy.retract_to_front:
            self.waiting.insert(0, r)
        else:
            self.waiting.append(r)

    def move_out(self, r: SimReq) -> None:
        """Rotate (or swap) a running request's KV to host; recompute if the host pool is full."""
        assert r.phase is _P_RUNNING, (r.rid, r.phase)
        bt, kv = self._bt, r.kv
        blocks = -(-kv // bt) * bt
        if self.host_used + blocks > self._host_cap:
            self.stats.host_full_fallbacks += 1
            self.retract(r)
            return
        synced = kv // bt * bt if self._eager else 0
        self._out += (kv - synced) * self.kv_bytes
        self._leave_running(r)
        self.host_used += blocks
        r.host = kv
        self._set(r, _P_ROTARY, _S_ROTARY)
        r.rotations += 1
        self.rotary[r.spec.rid] = r
        self.stats.rotations_out += 1
        if len(self.rotary) > self.stats.peak_rotary:
            self.stats.peak_rotary = len(self.rotary)
        if self.host_used > self.stats.peak_host_tokens:
            self.stats.peak_host_tokens = self.host_used

    def _move_in(self, r: SimReq) -> None:
        if r.phase is not _P_ROTARY:
            return
        host, page, bt = r.host, self._page, self._bt
        need = -(-host // page) * page
        if need > self.capacity - self.used:
            return  # device memory cannot be had now: it stays rotary (runtime: resume fails)
        self._in += host * self.kv_bytes
        del self.rotary[r.spec.rid]
        self.host_used -= -(-host // bt) * bt
        r.kv = host
        self._alloc(r)
        self.stats.resumes += 1
        if self.policy.resume_to_running:
            self._join_running(r)
        else:  # our runtime: restored into the radix tree, re-admitted with a 1-token extend
            r.restored = True
            self._set(r, _P_WAITING, _S_WAITING)
            self.waiting.append(r)

    # ---- batches -----------------------------------------------------------------------------
    def page_round(self, tokens: int) -> int:
        page = self._page
        return -(-tokens // page) * page

    def _alloc(self, r: SimReq) -> None:
        page = self._page
        new = -(-(r.kv - r.shared) // page) * page
        self.used += new - r.alloc
        r.alloc = new
        assert self.used <= self.capacity, f"{r.rid}: device KV over capacity ({self.used})"

    def _admit(self, offered: list[SimReq], step_chunk: int | None = None) -> list[tuple[SimReq, int]]:
        """SGLang's PrefillAdder: the chunked request first, then `offered` in order; stop at the
        first request that does not fit in memory (FCFS head-of-line), chunk the one that
        overflows the chunk budget (the server's chunk size, or the policy's for this step)."""
        pol, server = self.policy, self.profile.server
        room = pol.admission_room(self)
        chunk = (step_chunk or server.chunked_prefill_tokens) if pol.chunked_prefill else None
        budget = pol.max_prefill_tokens(self)
        slots = pol.max_running(self) - len(self.running)
        batch: list[tuple[SimReq, int]] = []
        if self.chunked is not None:
            ext = self.chunked.extend if chunk is None else min(self.chunked.extend, chunk)
            # SGLang's add_chunked_req fits the next chunk into the memory left (fit_chunk) and
            # takes it from the same budget; with none left the chunk waits.
            ext = min(ext, max(0, int(room)))
            if ext > 0:
                batch.append((self.chunked, ext))
                room -= ext
                budget -= ext
                chunk = None if chunk is None else chunk - ext
        for r in offered:
            if r.phase is not _P_WAITING:
                continue
            if len(batch) >= slots:
                break
            need = pol.admission_need(self, r)
            if need > room:
                break
            ext = r.spec.prompt_tokens + r.outputs - r.kv  # r.extend
            if chunk is not None and ext > chunk:
                if chunk > 0:
                    batch.append((r, chunk))
                break
            if ext > budget and batch:
                break
            batch.append((r, ext))
            room -= need
            budget -= ext
            chunk = None if chunk is None else chunk - ext
        if batch:
            taken = {id(r) for r, _ in batch}
            self.waiting = [r for r in self.waiting if id(r) not in taken]
        return batch

    def _prefill(self, batch: list[tuple[SimReq, int]]) -> tuple[int, float, int]:
        """Extend the batch; returns (tokens, attention pairs, restored requests re-admitted)."""
        tokens, pairs, restored = 0, 0.0, 0
        if any(r is self.chunked for r, _ in batch):
            self.chunked = None
        for r, ext in batch:
            pairs += ext * (r.kv + ext / 2.0)
            tokens += ext
            r.kv += ext
            self._alloc(r)
            r.prefill_iter = self.iteration
            if r.restored:
                r.restored = False
                restored += 1
            if r.kv < r.ctx:
                self._set(r, Phase.PREFILL)
                self.chunked = r
        if self.engine.eager_sync:
            self.stats.eager_bytes += tokens * self.kv_bytes
        return tokens, pairs, restored

    def _mark_mixed(self, decoding: list[SimReq]) -> None:
        """A mixed chunk is one extend batch: its decoding requests count as prefilled by it (the
        runtime does not rotate a request of an extend batch still in flight: integration.views.rotatable)."""
        it = self.iteration
        for r in decoding:
            r.prefill_iter = r.mixed_iter = it
            r.view = None

    def _decode(self) -> list[SimReq]:
        """One decode step for every running request; out of memory, the policy picks victims."""
        page = self._page
        short = sum([page for r in self.running if r.kv - r.shared + 1 > r.alloc]) - self.free_tokens
        if short > 0:
            for v in self.policy.decode_victims(self, short):
                (self.move_out if v.swap else self.retract)(v.req)
                if v.req.phase is _P_ROTARY:
                    self.stats.shortage_rotations += 1
            self._prune_running()
            self._after_retraction()
        for r in self.running:
            kv = r.kv = r.kv + 1
            if kv - r.shared > r.alloc:
                self._alloc(r)
        if self.engine.eager_sync:
            self.stats.eager_bytes += len(self.running) * self.kv_bytes
        if not self.config.ignore_eos and self.running:
            step = (_RATIO_INIT - _RATIO_MIN) / _RATIO_STEPS
            self.new_token_ratio = max(_RATIO_MIN, self.new_token_ratio - step)
        return list(self.running)

    def _after_retraction(self) -> None:
        if not self.config.ignore_eos:
            self.new_token_ratio = _RATIO_INIT  # SGLang re-estimates upwards after a retraction

    # ---- tokens ------------------------------------------------------------------------------
    def _join_running(self, r: SimReq) -> None:
        self._set(r, _P_RUNNING, _S_RUNNING)
        self.running.append(r)

    def _emit(self, reqs: list[SimReq], joined: bool) -> None:
        finished = False
        for r in reqs:
            r.outputs += 1
            if self._defer:
                self._unsent.append((r, r.outputs))
            else:
                self._send(r, r.outputs, self.now)
            if r.outputs >= r.spec.output_tokens:
                finished = True
                self._finish(r)
            elif joined:
                self._join_running(r)
        if finished:
            self.running = [r for r in self.running if r.phase is _P_RUNNING]

    def _send(self, r: SimReq, outputs: int, t: float) -> None:
        """The client sees r's tokens up to `outputs` at t."""
        if r.clock.last_token is not None:
            self.gaps.append(t - r.clock.last_token)
        r.clock.observe_outputs(outputs, t)

    def _send_unsent(self, t: float) -> None:
        """The last step's results processed: its tokens streamed at t, its finished requests'
        KV freed (emit_after_next_step)."""
        for r, outputs in self._unsent:
            self._send(r, outputs, t)
        self._unsent = []
        self._unsent_at = self.now
        self.used -= self._unfreed
        self._unfreed = 0

    def _finish(self, r: SimReq) -> None:
        self._set(r, Phase.FINISHED)
        if not self.config.ignore_eos:
            self.output_share.observe(r.outputs, r.spec.max_new_tokens)
        if self._defer:  # SGLang frees it while processing the results, after the next launch
            self._unfreed += r.alloc
        else:
            self.used -= r.alloc
        r.alloc = r.kv = 0
        self._done += 1

    def _account(self, plan: Plan, xfer: float, compute: float, prefill: bool) -> None:
        s = self.stats
        s.iterations += 1
        self.iteration += 1
        s.prefill_iterations += prefill
        s.decode_iterations += not prefill
        s.bytes_out += self._out
        s.bytes_in += self._in
        s.transfer_s += xfer
        s.compute_s += compute
        s.sched_s += plan.sched_s


def _jitter(cv: float, seed: int) -> Callable[[], float] | None:
    """Factors with mean 1 and coefficient of variation `cv` (lognormal: a step is never
    negative, and slow outliers are likelier than fast ones), or None for deterministic steps."""
    if cv <= 0:
        return None
    sigma = math.sqrt(math.log1p(cv * cv))
    rng = random.Random(seed)
    return lambda: rng.lognormvariate(-sigma * sigma / 2, sigma)
