"""Request views: the only thing the RotaSched policy sees of a request.

A view is an immutable snapshot taken once per scheduler iteration by the integration
layer; the policy never touches SGLang's Req objects, so it stays testable on a CPU.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, fields


NO_LIMIT = 1 << 30  # misses_left when the TBT budget is unknown


class ReqState(enum.IntEnum):
    """RotaSched lifecycle: waiting (no KV), running (KV on device), rotary (KV on host)."""

    WAITING = 0
    RUNNING = 1
    ROTARY = 2


@dataclass(frozen=True, slots=True, init=False)
class ReqView:
    """One request as LVF sees it. Times are seconds on the server's monotonic clock.

    `__init__` is written out (the dataclass one, frozen, pays an `object.__setattr__` lookup
    per field): same signature and defaults, same validation, still frozen. Views are built
    for every request every iteration, so this is most of their cost.
    """

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
    # What the goodput policy reads (the paper's rule ignores them):
    prefill_tokens: int = 0  # tokens its admission must compute (WAITING); 0 otherwise
    # Inter-token gaps it may still miss and meet its TBT SLO (share of gaps met); negative: TBT
    # already lost. NO_LIMIT when the server cannot tell.
    misses_left: int = NO_LIMIT
    ttft_met: bool | None = None  # None until its first token
    weight: float = 1.0  # its SLO class's weight: who wins when not everyone can
    # Outputs it may still produce (max_new_tokens less those produced), clipped as SGLang clips
    # its decode reserve (4096): past that a server cannot tell long from unbounded.
    outputs_left: int = 0
    # Its length is known (a fixed-length, ignore_eos request), not an upper bound: `outputs_left`
    # is exact up to the clip (a lower bound past it), what the goodput policy's TTFT shedding may
    # count as its decode work (goodput.shed); and its gap budget `misses_left`, counted from the
    # unclipped length, may be counted on (step_size.spare_misses).
    outputs_known: bool = False

    def __init__(
        self,
        rid: str,
        state: ReqState,
        arrival: float,
        last_token: float | None,
        run_start: float | None,
        ttft_slo: float,
        tbt_slo: float,
        blocks_needed: int,
        blocks_held: int,
        rotatable: bool = True,
        prefill_tokens: int = 0,
        misses_left: int = NO_LIMIT,
        ttft_met: bool | None = None,
        weight: float = 1.0,
        outputs_left: int = 0,
        outputs_known: bool = False,
    ) -> None:
        # Slot descriptors' setters (bound below the class): frozen stays frozen for others.
        _set_rid(self, rid)
        _set_state(self, state)
        _set_arrival(self, arrival)
        _set_last_token(self, last_token)
        _set_run_start(self, run_start)
        _set_ttft_slo(self, ttft_slo)
        _set_tbt_slo(self, tbt_slo)
        _set_blocks_needed(self, blocks_needed)
        _set_blocks_held(self, blocks_held)
        _set_rotatable(self, rotatable)
        _set_prefill_tokens(self, prefill_tokens)
        _set_misses_left(self, misses_left)
        _set_ttft_met(self, ttft_met)
        _set_weight(self, weight)
        _set_outputs_left(self, outputs_left)
        _set_outputs_known(self, outputs_known)
        self.__post_init__()

    def __post_init__(self) -> None:
        running = self.state is _RUNNING
        assert isinstance(self.rid, str) and self.rid, "rid must be a non-empty str"
        assert isinstance(self.state, ReqState), f"{self.rid}: state must be a ReqState"
        assert math.isfinite(self.arrival), f"{self.rid}: arrival must be finite"
        assert self.last_token is None or math.isfinite(self.last_token), self.rid
        assert (self.run_start is not None) == running, f"{self.rid}: run_start set iff RUNNING"
        assert self.run_start is None or math.isfinite(self.run_start), self.rid
        assert self.ttft_slo > 0 and math.isfinite(self.ttft_slo), f"{self.rid}: ttft_slo > 0"
        assert self.tbt_slo > 0 and math.isfinite(self.tbt_slo), f"{self.rid}: tbt_slo > 0"
        assert self.blocks_needed >= 0 and self.blocks_held >= 0, f"{self.rid}: negative blocks"
        assert self.prefill_tokens >= 0, f"{self.rid}: negative prefill_tokens"
        assert self.outputs_left >= 0, f"{self.rid}: negative outputs_left"
        assert self.weight > 0 and math.isfinite(self.weight), f"{self.rid}: weight > 0"
        assert not running or self.blocks_needed == 0, f"{self.rid}: RUNNING needs no blocks"
        assert running or self.blocks_held == 0, f"{self.rid}: only RUNNING holds blocks"
        # A rotary request was running past prefill, so its first token exists: the
        # rotary VLT is anchored on it.
        assert self.state is not _ROTARY or self.last_token is not None, (
            f"{self.rid}: ROTARY needs last_token"
        )


_RUNNING, _ROTARY = ReqState.RUNNING, ReqState.ROTARY  # class attribute lookups are slow
_setters = {f.name: ReqView.__dict__[f.name].__set__ for f in fields(ReqView)}
_set_rid, _set_state, _set_arrival = _setters["rid"], _setters["state"], _setters["arrival"]
_set_last_token, _set_run_start = _setters["last_token"], _setters["run_start"]
_set_ttft_slo, _set_tbt_slo = _setters["ttft_slo"], _setters["tbt_slo"]
_set_blocks_needed, _set_blocks_held = _setters["blocks_needed"], _setters["blocks_held"]
_set_rotatable, _set_prefill_tokens = _setters["rotatable"], _setters["prefill_tokens"]
_set_misses_left, _set_ttft_met, _set_weight = (_setters["misses_left"], _setters["ttft_met"],
                                                _setters["weight"])
_set_outputs_left, _set_outputs_known = _setters["outputs_left"], _setters["outputs_known"]
assert len(_setters) == 16, "a new ReqView field must be set in ReqView.__init__"
