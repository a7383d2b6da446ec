"""Clocks and costs: every request's SLO clock (`rotasched.clock.ReqClock`), the step costs the
server measures as it runs (`rotasched.costs.CostMeter`), with what follows from them: the rotation
quantum (`min_stint_s`) and the auto rotation budget, and the share of max_new_tokens that
requests which may stop at EOS decode (`rotasched.output_share.OutputShare`).

It reads of SGLang's requests only their rid, output count, `custom_params`, and at the end their
`ignore_eos`, `max_new_tokens` and finish reason, and of a finished batch its forward mode and
token counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from operator import attrgetter
from typing import Any

from ..config import SuperInferConfig
from ..rotasched import DEFAULT_CLASSES, ReqState, Slo, SloClasses, SloError, resolve_slo
from ..rotasched import planner
from ..rotasched.clock import ReqClock, observe_outputs
from ..rotasched.costs import CostMeter
from ..rotasched.goodput import StepCosts
from ..rotasched.output_share import OutputShare
from ..rotasched.views import CLIP_MAX_NEW_TOKENS
from .http_slo import intake_delay_s
from .views import same_objects

# What one rotation costs a CPU server before any is measured (the CPU profile's
# step.per_resume_s, profiles/cpu-smollm2-135m.json); on a GPU a rotation's extra time starts at 0.
CPU_ROTATION_S_PRIOR = 0.058
MAX_MEASURED_STEP_S = 5.0  # a longer gap between iterations is an idle turn, not a step
_RUNNING, _WAITING = ReqState.RUNNING, ReqState.WAITING  # enum class lookups are slow per request
_OUTPUT_IDS = attrgetter("output_ids")


def step_prior(on_cpu: bool) -> StepCosts:
    """The step costs assumed until the server has measured its own."""
    return StepCosts(0.0, 0.0, 0.0, CPU_ROTATION_S_PRIOR if on_cpu else 0.0)


class Clocks:
    """`by_rid`: rid -> clock of every request the scheduler has seen and not yet let go;
    `meter`: the measured step costs (from `prior` until a step of each kind is timed);
    `link_bytes_per_s`: the KV link's speed measured at startup (None: not measured);
    `outputs`: the share of their max_new_tokens that finished requests of unknown length decoded
    (`clip`: SGLang's decode reserve clip)."""

    def __init__(self, cfg: SuperInferConfig, prior: StepCosts, *, pool_tokens: int = 0,
                 link_bytes_per_s: float | None = None, clip: int = CLIP_MAX_NEW_TOKENS) -> None:
        self.default_slo = Slo(cfg.ttft_slo_ms, cfg.tbt_slo_ms)
        self.classes = SloClasses.parse(cfg.slo_classes or DEFAULT_CLASSES, default=self.default_slo)
        self.by_rid: dict[str, ReqClock] = {}
        self.meter = CostMeter(prior)
        self.outputs = OutputShare(clip)
        self.link_bytes_per_s = link_bytes_per_s
        self._cfg, self._pool_tokens = cfg, pool_tokens
        self._last_step_t: float | None = None
        # the running batch at the last observation and its clocks (forgotten when clocks go)
        self._running: list[Any] = []
        self._running_clocks: list[ReqClock] = []

    # ---- request clocks ----------------------------------------------------------------------
    def clock(self, req: Any, now: float) -> ReqClock:
        clk = self.by_rid.get(req.rid)
        if clk is None:
            params = getattr(req.sampling_params, "custom_params", None)
            try:
                slo = resolve_slo(params, self.default_slo, self.classes)
            except SloError:  # validated in the tokenizer; never drop a request over it here
                slo = self.default_slo
            cls = params.get("slo_class") if isinstance(params, dict) else None
            clk = ReqClock(req.rid, now - intake_delay_s(params, time.time()), slo,
                           slo_class=cls if isinstance(cls, str) else None)
            self.by_rid[req.rid] = clk
        return clk

    def observe(self, running: list[Any], waiting: Iterable[Any], now: float) -> None:
        """Outputs and states of the running batch's unfinished requests and of waiting requests
        (the runtime hands those that entered the queue since its last step)."""
        clocks = self.by_rid
        if same_objects(running, self._running):  # the batch of the last step: its clocks as found
            found = self._running_clocks
        else:
            found = [clocks.get(req.rid) or self.clock(req, now) for req in running]
            self._running, self._running_clocks = list(running), found
        observe_outputs(zip(found, map(len, map(_OUTPUT_IDS, running))), now)
        for clk in found:
            if clk.state is not _RUNNING:  # (set_state keeps a running stint's start)
                clk.set_state(_RUNNING, now)
        for req in waiting:
            clk = clocks.get(req.rid)
            if clk is None:
                clk = self.clock(req, now)
            elif clk.state is _WAITING and clk.outputs_seen == len(req.output_ids):
                continue  # waiting since its last observation, with no new output: nothing to record
            clk.observe_outputs(len(req.output_ids), now)
            clk.set_state(_WAITING, now)

    def finish(self, req: Any, now: float, client: bool = True) -> ReqClock | None:
        """The clock of a request that ended, its last outputs observed (None: never seen); one
        that could stop at EOS teaches `outputs` its share, unless it was aborted or no client sent
        it (`client` False: a health probe, the warm-up)."""
        clk = self.by_rid.pop(req.rid, None)
        self._running = []
        outputs = len(req.output_ids)
        if clk is not None:
            clk.observe_outputs(outputs, now)
        params = req.sampling_params
        if client and not params.ignore_eos and params.max_new_tokens is not None and not _aborted(req):
            self.outputs.observe(outputs, params.max_new_tokens)
        return clk

    def drop(self, match: Callable[[str], bool]) -> list[str]:
        """Forget the clocks of the matching rids (aborted requests); returns those rids."""
        gone = [rid for rid in self.by_rid if match(rid)]
        for rid in gone:
            del self.by_rid[rid]
        self._running = []
        return gone

    # ---- step costs --------------------------------------------------------------------------
    @property
    def min_stint_s(self) -> float:
        """The rotation quantum (LVF victims only): the flag, else the policy's default."""
        return planner.quantum_s(self._cfg.policy, self._cfg.min_stint_ms, self.meter.costs.rotation_s)

    def rotation_budget(self, bytes_per_block: int | None) -> int:
        """B_xfer: the flag, else what the measured link moves in one measured decode step
        (`bytes_per_block`: the host pool's; None without rotation)."""
        per_step = None
        if self.link_bytes_per_s is not None and self.meter.observed["decode"] and bytes_per_block is not None:
            per_step = self.link_bytes_per_s * self.meter.costs.decode_step_s / bytes_per_block
        cfg = self._cfg
        return planner.rotation_budget(cfg.rotation_budget_blocks, self._pool_tokens, cfg.rotary_block_tokens,
                                       per_step)

    def measure_last_step(self, last: Any, now: float, alone: Any = None) -> None:
        """Time from the previous iteration's start to this one's is the previous batch's step
        (`last`: SGLang's last batch; an idle turn in between shows as a long one, which the bound
        drops; `alone`: the last prefill batch the policy kept unmixed beside running requests,
        `CostMeter.observe_step`)."""
        start, self._last_step_t = self._last_step_t, now
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
                self.meter.observe_step(now - start, tokens, rows, alone is not None and last is alone)


def _aborted(req: Any) -> bool:
    """Its finish reason is SGLang's abort (a client's, or a rejected request): its outputs say
    nothing about where it would have stopped."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    return isinstance(getattr(req, "finished_reason", None), FINISH_ABORT)
