"""Step costs measured as the server runs: what goodput mode predicts TTFT and rotation stalls with.

The integration layer reports each scheduler iteration it timed (a decode step, a prefill of N
tokens, a rotation's extra time); the meter keeps exponentially weighted means and hands the
policy a `StepCosts`. Until a kind of step has been seen, its prior (from the launcher's startup
probe or the flags) stands.
"""

from __future__ import annotations

import math

from superinfer_sgl.rotasched.goodput import StepCosts

SMOOTHING = 0.1  # weight of the newest observation: about the last 10 steps of each kind
MIN_PREFILL_TOKENS = 32  # smaller prefills are mostly fixed cost: they say little per token


class CostMeter:
    def __init__(self, prior: StepCosts, smoothing: float = SMOOTHING) -> None:
        assert 0 < smoothing <= 1, smoothing
        self._a = smoothing
        self._per_token = prior.prefill_s_per_token
        self._base = prior.prefill_base_s
        self._decode = prior.decode_step_s
        self._rotation = prior.rotation_s
        self.observed = {"decode": 0, "prefill": 0, "rotation": 0}

    def _mix(self, kind: str, old: float, new: float) -> float:
        """The first observation of a kind replaces its prior; later ones move the mean."""
        seen = self.observed[kind]
        self.observed[kind] = seen + 1
        return new if seen == 0 else old + self._a * (new - old)

    def observe_decode(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self._decode = self._mix("decode", self._decode, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_PREFILL_TOKENS and math.isfinite(seconds) and seconds >= 0:
            per_token = max(0.0, seconds - self._base) / tokens
            self._per_token = self._mix("prefill", self._per_token, per_token)

    def observe_rotation(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self._rotation = self._mix("rotation", self._rotation, seconds)

    @property
    def costs(self) -> StepCosts:
        return StepCosts(self._per_token, self._base, self._decode, self._rotation)
