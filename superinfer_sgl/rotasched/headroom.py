"""SLO headroom of one server: what a router or autoscaler reads to decide where load goes.

Pure Python over the policy's own request views (no SGLang, no torch): the integration layer
(`integration/step_figures.py`) builds the views from the running server and `integration/metrics.py`
exports the figures as Prometheus gauges. The same rules as the scheduler's tiers (`goodput.tier`,
`goodput.lost`), so a replica's "at risk" count is the requests past saving by those rules; not
counted: viable requests that TTFT shedding serves best-effort this step (a choice among savable
ones, not a loss yet):

- `queue_vlt_max`: the largest Virtual Lag Time among waiting and rotary requests, in seconds past
  each one's slack: VLT without the scheduler's weight on a paused request's lag (`alpha`, a
  ranking knob), so the gauge and an autoscaler's threshold on it mean the same whatever
  `--vlt-alpha` is (0 when every queued request is within its slack). It grows while a replica
  falls behind, before any request has finished late: the earliest overload signal a replica has.
- at risk: waiting or rotary requests that can no longer meet their TTFT/TBT SLOs even if served
  next (`goodput.tier` is not VIABLE, or a paused request with no gap to spare whose pause has
  already outlasted its TBT SLO: its next token is a miss), and running requests that already
  lost theirs (`goodput.lost`). A router should prefer replicas with none; a steady count means lost goodput.
- `AttainmentWindow`: SLO attainment over the last N finished requests of each class, per SLO
  (ttft, tbt, joint = both). A count window, not a time window, so it needs no clock tick while
  the server is idle (an idle server's last value stands, and is still true of its last N).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from superinfer_sgl.rotasched.goodput import GoodputParams, lost, tier
from superinfer_sgl.rotasched.policy import VIABLE
from superinfer_sgl.rotasched.request_view import ReqState, ReqView
from superinfer_sgl.rotasched.vlt import VltParams, vlts

DEFAULT_WINDOW = 100  # finished requests per class: +-10 points of attainment at 50%, 1 sigma ~5
DEFAULT_CLASS = "default"  # the label of requests without an SLO class (as in /metrics' counters)
SLOS = ("ttft", "tbt", "joint")


@dataclass(frozen=True, slots=True)
class Headroom:
    vlt_max_s: float  # largest VLT among waiting + rotary requests (0: none, or all within slack)
    waiting: int
    rotary: int
    at_risk_waiting: int  # waiting requests that cannot meet their SLOs even if admitted now
    at_risk_rotary: int  # rotary requests whose TBT (or TTFT) is already lost
    lost_running: int  # running requests that can no longer meet both SLOs

    @property
    def at_risk(self) -> int:
        return self.at_risk_waiting + self.at_risk_rotary


def headroom(views: Iterable[ReqView], now: float, params: VltParams, gp: GoodputParams) -> Headroom:
    """Headroom figures of one scheduler's requests at `now` (views of every state may be mixed)."""
    views = list(views)
    queued = [v for v in views if v.state is not ReqState.RUNNING]
    counts = {ReqState.WAITING: 0, ReqState.ROTARY: 0}
    risk = {ReqState.WAITING: 0, ReqState.ROTARY: 0}
    for v in queued:
        counts[v.state] += 1
        # tier() assumes nothing is queued ahead: "at risk" never over-counts a request that a
        # quieter moment would still serve in time.
        risk[v.state] += tier(v, now, gp) != VIABLE or _pause_lost(v, now)
    lost_running = sum(1 for v in views if v.state is ReqState.RUNNING and lost(v))
    return Headroom(
        vlt_max_s=max(vlts(queued, now, replace(params, alpha=1.0)), default=0.0),
        waiting=counts[ReqState.WAITING], rotary=counts[ReqState.ROTARY],
        at_risk_waiting=risk[ReqState.WAITING], at_risk_rotary=risk[ReqState.ROTARY],
        lost_running=lost_running,
    )


def _pause_lost(v: ReqView, now: float) -> bool:
    """A request that has started answering, out of gaps to spare, whose open gap already exceeds
    its TBT SLO (`misses_left` counts only the gaps observed, not the one still open)."""
    return v.last_token is not None and v.misses_left <= 0 and now - v.last_token > v.tbt_slo


class AttainmentWindow:
    """Per class, the SLO verdicts of its last `size` finished requests."""

    def __init__(self, size: int = DEFAULT_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"window size must be >= 1, got {size}")
        self.size = size
        self._by_class: dict[str, deque[tuple[bool | None, bool | None]]] = {}

    def add(self, slo_class: str | None, ttft_met: bool | None, tbt_met: bool | None) -> None:
        cls = slo_class or DEFAULT_CLASS
        self._by_class.setdefault(cls, deque(maxlen=self.size)).append((ttft_met, tbt_met))

    def attainment(self) -> dict[tuple[str, str], tuple[int, int]]:
        """{(class, slo): (met, judged)} over the window; a verdict of None (e.g. no TBT for a
        one-token output; joint needs both) is not judged. Pairs with nothing judged are absent."""
        out: dict[tuple[str, str], tuple[int, int]] = {}
        for cls, window in self._by_class.items():
            tally = {slo: [0, 0] for slo in SLOS}
            for ttft, tbt in window:
                joint = None if ttft is None or tbt is None else ttft and tbt
                for slo, met in (("ttft", ttft), ("tbt", tbt), ("joint", joint)):
                    if met is not None:
                        tally[slo][0] += met
                        tally[slo][1] += 1
            out.update({(cls, slo): (m, n) for slo, (m, n) in tally.items() if n})
        return out
