"""What a simulation runs with besides the workload and the profile: the server's knobs (budget,
block size, VLT, quantum, best-effort bound, mixed chunk) and the replay's (drain, lookahead,
speed trace). Its own module so that policies can read it without importing the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.rotasched.planner import MIX_PREFILL
from superinfer_sgl.rotasched.vlt import VltParams


@dataclass(frozen=True)
class SimConfig:
    budget_blocks: int = 2400  # B_xfer: rotation blocks per iteration and direction
    block_tokens: int = 16  # --rotary-block-tokens
    vlt: VltParams = field(default_factory=VltParams)
    ignore_eos: bool = True  # outputs replayed at their trace length; SGLang then reserves exactly
    drain_s: float = 1800.0  # simulated time allowed after the last arrival
    lookahead: bool = False  # transfers overlap the iteration's compute (DuplexKV lookahead)
    mixed_chunk: bool = False  # SGLang --enable-mixed-chunk: a prefill batch also decodes
    mix_prefill: str = "always"  # our policies with mixed_chunk: the server's --mix-prefill
    # The runtime's rotation quantum (--min-stint-ms): a running request is not rotatable before
    # it has run this long in its current stint. 0: the paper's rule; None: the policy's default
    # (rotasched.planner.quantum_s), as the server's.
    min_stint_s: float | None = None
    # The machine's speed over the run: (from time s, factor) pairs sorted by time, multiplying
    # every step's compute from then on (a replay of a measured run: sim/steplog.speed_trace).
    # Empty: the profile's speed throughout.
    speed_trace: tuple[tuple[float, float], ...] = ()
    # Spread of single steps (coefficient of variation of each step's compute time around the
    # profile's, lognormal, seeded by jitter_seed): a CPU server's steps spread noticeably around
    # any model of them. 0: deterministic steps.
    step_jitter: float = 0.0
    jitter_seed: int = 0
    # The goodput policy's step costs: True (the server as shipped), a CostMeter fed every simulated
    # iteration as the server feeds its own (rotasched.costs: moving averages from nothing
    # measured, the prefill's fixed time fitted), so the simulator runs what the server learns,
    # and how well; False, the profile's, exact for the current batch (what a server would
    # measure at best: `sim run --profile-costs`).
    measured_costs: bool = True
    # The decode reserve of a running request, as a share of SGLang's (the server's
    # --running-reserve; planner.running_reserve_ratio). None: the policy's default.
    running_reserve: float | None = None
    # The goodput policy's starvation bound (the server's --max-best-effort-wait-ms).
    max_best_effort_wait_s: float = SuperInferConfig().max_best_effort_wait_ms / 1000.0
    # The goodput policy's TTFT shedding (the server's --ttft-shedding).
    ttft_shedding: bool = SuperInferConfig().ttft_shedding

    def __post_init__(self) -> None:
        assert self.budget_blocks >= 0 and self.block_tokens >= 1 and self.drain_s > 0, self
        assert 0 <= self.step_jitter < 10, self.step_jitter
        assert self.running_reserve is None or 0 < self.running_reserve <= 1, self.running_reserve
        assert self.mix_prefill in MIX_PREFILL, self.mix_prefill
        assert all(f > 0 for _, f in self.speed_trace), self.speed_trace
        assert [t for t, _ in self.speed_trace] == sorted(t for t, _ in self.speed_trace), self.speed_trace
