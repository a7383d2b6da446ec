"""Per-request clocks: what VLT needs (arrival, last token, running stint) and SLO outcomes.

Pure Python: the integration layer feeds it observations (output length seen at time t, state
changes); it never looks at SGLang objects itself.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .slo import Slo
from .request_view import ReqState

# A request meets its TBT SLO when at least this share of its inter-token gaps do (the A/B
# harness uses the same definition for its joint attainment figure).
TBT_MET_SHARE = 0.9
_RUNNING = ReqState.RUNNING  # module constant: enum class attribute lookups are slow


@dataclass(slots=True)  # attribute reads and writes: every running request's, every step
class ReqClock:
    rid: str
    arrival: float
    slo: Slo
    slo_class: str | None = None
    state: ReqState = ReqState.WAITING
    run_start: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    outputs_seen: int = 0
    gaps: int = 0
    gaps_missed: int = 0
    rotations: int = 0
    recomputes: int = 0
    max_gap: float = 0.0
    # Bumped whenever what a running request's view reads of its clock changes (its state and
    # stint, its first token, a missed gap): a view built at the same version still holds.
    # (Its gaps left to miss, `misses_left(outputs_left)`, move only with a missed gap: each new
    # output adds one to `outputs_seen` and takes one off the outputs left.)
    version: int = 0

    def observe_outputs(self, n_out: int, now: float) -> None:
        """Record newly committed output tokens (n_out is the request's total so far).

        Several tokens seen at once (e.g. a skipped observation) count as one gap for the first
        and zero-length gaps for the rest, which is what a streaming client sees.
        """
        observe_outputs(((self, n_out),), now)

    def misses_left(self, outputs_left: int) -> int:
        """Gaps this request may still miss and meet its TBT SLO, if it produces `outputs_left`
        more tokens (an upper bound when EOS can stop it early: then this over-counts).
        Negative: its TBT is already lost."""
        total_gaps = max(0, self.outputs_seen + outputs_left - 1)
        return math.floor(total_gaps * (1.0 - TBT_MET_SHARE) + 1e-9) - self.gaps_missed

    def set_state(self, state: ReqState, now: float) -> None:
        if state == _RUNNING:
            if self.state != _RUNNING:
                self.run_start = now
                self.version += 1
        elif self.run_start is not None or self.state != state:
            self.run_start = None
            self.version += 1
        self.state = state

    @property
    def ttft_met(self) -> bool | None:
        if self.first_token is None:
            return None
        return (self.first_token - self.arrival) * 1000.0 <= self.slo.ttft_ms

    @property
    def tbt_share_met(self) -> float | None:
        if self.gaps == 0:
            return None
        return 1.0 - self.gaps_missed / self.gaps

    @property
    def tbt_met(self) -> bool | None:
        share = self.tbt_share_met
        return None if share is None else share >= TBT_MET_SHARE

    def meta_info(self) -> dict[str, object]:
        return {
            "superinfer_rotations": self.rotations,
            "superinfer_recomputes": self.recomputes,
            "superinfer_slo_class": self.slo_class,
            "superinfer_ttft_slo_ms": self.slo.ttft_ms,
            "superinfer_tbt_slo_ms": self.slo.tbt_ms,
            "superinfer_ttft_slo_met": self.ttft_met,
            "superinfer_tbt_slo_met": self.tbt_met,
            "superinfer_tbt_gaps_met_share": self.tbt_share_met,
        }


def observe_outputs(seen: Iterable[tuple[ReqClock, int]], now: float) -> None:
    """`ReqClock.observe_outputs` of each (clock, outputs so far) in `seen`, all at `now`: the
    server observes every running request every step, so the rule runs in one loop rather than
    a method call per request."""
    for clk, n_out in seen:
        new = n_out - clk.outputs_seen
        if new <= 0:
            continue
        if clk.first_token is None:
            clk.first_token = now
            clk.version += 1
            clk.gaps += new - 1  # tokens that arrived together: zero-length gaps
        else:
            last = clk.last_token
            gap = 0.0 if last is None else now - last
            clk.gaps += new  # this gap, and zero-length ones for tokens that arrived together
            if gap > clk.max_gap:
                clk.max_gap = gap
            if gap * 1000.0 > clk.slo.tbt_ms:
                clk.gaps_missed += 1
                clk.version += 1
        clk.last_token = now
        clk.outputs_seen = n_out
