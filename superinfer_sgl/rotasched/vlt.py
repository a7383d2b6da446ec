"""Virtual Lag Time (VLT): RotaSched's single urgency scale for all request states."""

from __future__ import annotations

import math
from dataclasses import dataclass

from superinfer_sgl.rotasched.state import ReqState, ReqView

_RUNNING = ReqState.RUNNING  # module constant: class attribute lookup is slow per view


@dataclass(frozen=True, slots=True)
class VltParams:
    """alpha weights paused (rotary) lag against waiting lag; betas grant SLO slack first."""

    alpha: float = 3.0
    beta_ttft: float = 0.5
    beta_tbt: float = 0.0

    def __post_init__(self) -> None:
        # Raised, not asserted: these come from the command line.
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"alpha must be finite and > 0, got {self.alpha}")
        for name in ("beta_ttft", "beta_tbt"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")


def vlt(view: ReqView, now: float, params: VltParams) -> float:
    """VLT of one request at `now`: > 0 urgent, 0 within slack, < 0 running (stint length)."""
    if view.state is _RUNNING:
        return view.run_start - now  # type: ignore[operator]  # set iff RUNNING
    if view.last_token is not None:
        # Rotary, or waiting again after a recompute fallback: a user is already
        # reading its output, so the TBT clock is the one that is ticking.
        lag = now - view.last_token - params.beta_tbt * view.tbt_slo
        return params.alpha * max(0.0, lag)
    return max(0.0, now - view.arrival - params.beta_ttft * view.ttft_slo)
