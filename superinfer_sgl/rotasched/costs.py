"""Step costs measured as the server runs: what goodput mode predicts TTFT and rotation stalls with.

The integration layer reports each scheduler iteration it timed (a decode step, a prefill of N
tokens, a rotation's extra time); the meter keeps exponentially weighted means and hands the
policy a `StepCosts`. Until a kind of step has been seen, its prior (from the launcher's startup
probe or the flags) stands.
"""

from __future__ import annotations

import math

from superinfer_sgl.rotasched.goodput import MIN_PREFILL_CHUNK, StepCosts

SMOOTHING = 0.1  # weight of the newest observation: about the last 10 steps of each kind
# Smaller prefills are mostly fixed cost: they say little per token. The prefill cap's floor, so
# that a capped step is always measured.
MIN_PREFILL_TOKENS = MIN_PREFILL_CHUNK
# The steps' spread (StepCosts.step_cv) is a property of the machine, not of the batch: averaged
# over about the last 50 steps of any kind, starting from the prior's (0: the cap starts as it
# was without a spread and tightens as the spread shows).
SPREAD_SMOOTHING = 0.02
SPREAD_CLIP = 1.0  # a step off by more (an idle turn, a stall) counts as off by this much


class CostMeter:
    def __init__(self, prior: StepCosts, smoothing: float = SMOOTHING) -> None:
        assert 0 < smoothing <= 1, smoothing
        self._a = smoothing
        self._per_token = prior.prefill_s_per_token
        self._base = prior.prefill_base_s
        self._decode = prior.decode_step_s
        self._rotation = prior.rotation_s
        self._spread_sq = prior.step_cv ** 2  # running mean of (step / predicted - 1) ** 2
        self.observed = {"decode": 0, "prefill": 0, "rotation": 0}

    def _mix(self, kind: str, old: float, new: float) -> float:
        """The first observation of a kind replaces its prior; later ones move the mean."""
        seen = self.observed[kind]
        self.observed[kind] = seen + 1
        return new if seen == 0 else old + self._a * (new - old)

    def _spread(self, seconds: float, predicted: float) -> None:
        """One step against what the means predicted for it before it was folded in."""
        if predicted > 0:
            rel = min(SPREAD_CLIP, abs(seconds / predicted - 1.0))
            self._spread_sq += SPREAD_SMOOTHING * (rel * rel - self._spread_sq)

    def observe_decode(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            if self.observed["decode"]:
                self._spread(seconds, self._decode)
            self._decode = self._mix("decode", self._decode, seconds)

    def observe_prefill(self, tokens: int, seconds: float, decode_s: float = 0.0) -> None:
        """`seconds`: the prefill's share of its step; `decode_s`: the decode step it rode with
        (a mixed step), so that the spread is measured on the whole step, as the cap uses it."""
        if tokens >= MIN_PREFILL_TOKENS and math.isfinite(seconds) and seconds >= 0:
            if self.observed["prefill"]:
                self._spread(seconds + decode_s, self._base + self._per_token * tokens + decode_s)
            per_token = max(0.0, seconds - self._base) / tokens
            self._per_token = self._mix("prefill", self._per_token, per_token)

    def observe_rotation(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self._rotation = self._mix("rotation", self._rotation, seconds)

    @property
    def costs(self) -> StepCosts:
        return StepCosts(self._per_token, self._base, self._decode, self._rotation, math.sqrt(self._spread_sq))
