"""Virtual Lag Time (VLT): RotaSched's single urgency scale for all request states."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from superinfer_sgl.rotasched.request_view import ReqState, ReqView

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
    return vlts((view,), now, params)[0]


def vlts(views: Iterable[ReqView], now: float, params: VltParams) -> list[float]:
    """VLT of each view at `now`, in order: the one definition of VLT (`vlt` calls it).

    One loop instead of a call per view: LVF ranks every request every iteration.
    """
    alpha, beta_ttft, beta_tbt = params.alpha, params.beta_ttft, params.beta_tbt
    out: list[float] = []
    append = out.append
    for view in views:
        if view.state is _RUNNING:
            append(view.run_start - now)  # type: ignore[operator]  # set iff RUNNING
        elif view.last_token is not None:
            # Rotary, or waiting again after a recompute fallback: a user is already
            # reading its output, so the TBT clock is the one that is ticking.
            lag = now - view.last_token - beta_tbt * view.tbt_slo
            append(alpha * lag if lag > 0.0 else 0.0)  # alpha * max(0, lag); alpha > 0
        else:
            lag = now - view.arrival - beta_ttft * view.ttft_slo
            append(lag if lag > 0.0 else 0.0)  # max(0, lag)
    return out
