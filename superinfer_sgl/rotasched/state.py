"""Request views: the only thing the RotaSched policy sees of a request.

A view is an immutable snapshot taken once per scheduler iteration by the integration
layer; the policy never touches SGLang's Req objects, so it stays testable on a CPU.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass


class ReqState(enum.IntEnum):
    """RotaSched lifecycle: waiting (no KV), running (KV on device), rotary (KV on host)."""

    WAITING = 0
    RUNNING = 1
    ROTARY = 2


@dataclass(frozen=True, slots=True)
class ReqView:
    """One request as LVF sees it. Times are seconds on the server's monotonic clock."""

    rid: str
    state: ReqState
    arrival: float  # reached the server; TTFT is measured from here
    last_token: float | None  # last output token; None until the first one
    run_start: float | None  # start of the current running stint; set iff RUNNING
    ttft_slo: float  # seconds
    tbt_slo: float  # seconds
    blocks_needed: int  # device blocks to admit/resume it now; 0 when RUNNING
    blocks_held: int  # device blocks rotating it out would free and move; 0 unless RUNNING
    rotatable: bool = True  # False e.g. mid chunked prefill; only matters when RUNNING

    def __post_init__(self) -> None:
        running = self.state is ReqState.RUNNING
        assert isinstance(self.rid, str) and self.rid, "rid must be a non-empty str"
        assert isinstance(self.state, ReqState), f"{self.rid}: state must be a ReqState"
        assert math.isfinite(self.arrival), f"{self.rid}: arrival must be finite"
        assert self.last_token is None or math.isfinite(self.last_token), self.rid
        assert (self.run_start is not None) == running, f"{self.rid}: run_start set iff RUNNING"
        assert self.run_start is None or math.isfinite(self.run_start), self.rid
        assert self.ttft_slo > 0 and math.isfinite(self.ttft_slo), f"{self.rid}: ttft_slo > 0"
        assert self.tbt_slo > 0 and math.isfinite(self.tbt_slo), f"{self.rid}: tbt_slo > 0"
        assert self.blocks_needed >= 0 and self.blocks_held >= 0, f"{self.rid}: negative blocks"
        assert not running or self.blocks_needed == 0, f"{self.rid}: RUNNING needs no blocks"
        assert running or self.blocks_held == 0, f"{self.rid}: only RUNNING holds blocks"
        # A rotary request was running past prefill, so its first token exists: the
        # rotary VLT is anchored on it.
        assert self.state is not ReqState.ROTARY or self.last_token is not None, (
            f"{self.rid}: ROTARY needs last_token"
        )
