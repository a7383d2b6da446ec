"""Step costs measured as the server runs: what the goodput policy predicts TTFT and rotation stalls with.

The integration layer reports each scheduler iteration it timed (a decode step, a prefill of N
tokens, a rotation's extra time); the meter keeps exponentially weighted means and hands the
policy a `StepCosts`. Until a kind of step has been seen, its prior (from the launcher's startup
probe or the flags) stands. A prefill's time is split into a fixed part and a per-token part by a
least-squares line through the recent prefills (`observe_prefill`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SMOOTHING = 0.1  # weight of the newest observation: about the last 10 steps of each kind
# Smaller prefills are mostly fixed cost: they say little per token. Also the prefill cap's floor
# (step_size.MIN_PREFILL_CHUNK), so that a capped step is always measured.
MIN_PREFILL_TOKENS = 32
# The steps' spread (StepCosts.step_cv) is a property of the machine, not of the batch: averaged
# over about the last 50 steps of any kind, starting from the prior's (0: the cap starts as it
# was without a spread and tightens as the spread shows).
SPREAD_SMOOTHING = 0.02
SPREAD_CLIP = 1.0  # a step off by more (an idle turn, a stall) counts as off by this much
# A prefill's time is a line in its tokens: its intercept (StepCosts.prefill_base_s, when positive)
# is fitted by least squares through recent prefills' (tokens, seconds), over a longer window (about
# the last 50 prefills) than the per-token mean (the deviations from the intercept, per token), since
# it belongs to the model and machine (launches, the mixed step's extra pass, a decode floor's slack),
# not to the batch, and single steps spread noticeably on a shared CPU. It is fitted only once enough
# prefills of different sizes have been seen (with every prefill capped at one size the line is
# undetermined, and the prior stands). Without it the intercept is folded into the per-token cost:
# with a positive one (a GPU's fixed launch time) a small capped chunk is priced well under its time
# and a long prompt over it; with a negative one (a mixed step's prefill partly fills the decode
# step's floor) long prompts are priced under theirs.
BASE_SMOOTHING = 0.02
BASE_MIN_PREFILLS = 20
BASE_MIN_SIZE_CV = 0.25  # the sizes' spread (std / mean) the line needs


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What the server measured its steps to cost, in seconds (`CostMeter` keeps them current)."""

    prefill_s_per_token: float  # marginal prefill time per computed token
    prefill_base_s: float  # a prefill's fixed time on top of the decode step it rides with (mixed chunk)
    decode_step_s: float  # one decode iteration of the current batch (its fixed time included)
    rotation_s: float  # the server's extra time for one rotation (out and back), beyond its copies
    # Relative spread of single steps around these means (RMS of step / predicted - 1): noticeable
    # on a shared CPU; 0 when unmeasured or deterministic.
    step_cv: float = 0.0

    def __post_init__(self) -> None:
        for name in ("prefill_s_per_token", "prefill_base_s", "decode_step_s", "rotation_s", "step_cv"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be finite and >= 0, got {value}")


class _Line:
    """Running means of tokens, seconds, tokens^2 and tokens x seconds over recent prefills of one
    kind, and the intercept of their least-squares line (None: not fitted yet)."""

    __slots__ = ("moments", "seen", "intercept")

    def __init__(self, intercept: float | None) -> None:
        self.moments = [0.0, 0.0, 0.0, 0.0]
        self.seen = 0
        self.intercept = intercept


class CostMeter:
    def __init__(self, prior: StepCosts, smoothing: float = SMOOTHING) -> None:
        assert 0 < smoothing <= 1, smoothing
        self._a = smoothing
        self._per_token = prior.prefill_s_per_token
        # The line's intercept; may be negative: on a GPU a decode step sits on a floor (the
        # weights' read) that a small prefill partly fills for free, so the time a prefill adds
        # is ~per_token x (tokens - the floor's slack). The per-token cost is then the line's
        # slope, what a long prompt pays; the fixed time handed out is never below 0.
        self._line = _Line(prior.prefill_base_s)
        # Prefills the policy ran alone beside running requests (planner.plan_step): their own
        # line, since they pay the forward's fixed time that a mixed step's prefill does not;
        # until it is fitted, taken as a decode step plus the mixed line's intercept. One slope.
        self._alone = _Line(None)
        self._decode = prior.decode_step_s
        self._rotation = prior.rotation_s
        self._spread_sq = prior.step_cv ** 2  # running mean of (step / predicted - 1) ** 2
        self.observed = {"decode": 0, "prefill": 0, "rotation": 0}
        self._costs: StepCosts | None = None  # `costs`, until the next observation moves it

    def _mix(self, kind: str, old: float, new: float) -> float:
        """The first observation of a kind replaces its prior; later ones move the mean."""
        seen = self.observed[kind]
        self.observed[kind] = seen + 1
        self._costs = None
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

    def observe_prefill(self, tokens: int, seconds: float, decode_s: float = 0.0, alone: bool = False) -> None:
        """`seconds`: the prefill's share of its step; `decode_s`: the decode step it rode with
        (a mixed step), so that the spread is measured on the whole step, as the cap uses it;
        `alone`: run unmixed beside running requests (`observe_step`)."""
        if tokens >= MIN_PREFILL_TOKENS and math.isfinite(seconds) and seconds >= 0:
            line = self._alone if alone else self._line
            if self.observed["prefill"]:
                predicted = max(0.0, self._base(line) + self._per_token * tokens)
                self._spread(seconds + decode_s, predicted + decode_s)
            self._fit_base(line, tokens, seconds)
            per_token = max(0.0, seconds - self._base(line)) / tokens
            self._per_token = self._mix("prefill", self._per_token, per_token)

    def _base(self, line: _Line) -> float:
        if line.intercept is not None:
            return line.intercept
        return self._decode + max(0.0, self._line.intercept or 0.0)

    @staticmethod
    def _fit_base(line: _Line, tokens: int, seconds: float) -> None:
        """Move the moments (a plain mean over the first prefills, then exponentially weighted)
        and, once the sizes spread enough, take the line's intercept (at most the mean prefill's
        time). A line that does not rise with size says nothing: kept."""
        seen = line.seen
        line.seen += 1
        a = max(BASE_SMOOTHING, 1.0 / (seen + 1))
        m = line.moments
        for i, value in enumerate((tokens, seconds, tokens * tokens, tokens * seconds)):
            m[i] += a * (value - m[i])
        x, y, xx, xy = m
        var = xx - x * x
        if seen + 1 >= BASE_MIN_PREFILLS and var > (BASE_MIN_SIZE_CV * x) ** 2:
            slope = (xy - x * y) / var
            if slope > 0:
                line.intercept = min(y - slope * x, y)

    def observe_step(self, seconds: float, prefill_tokens: int, decode_rows: int, alone: bool = False) -> None:
        """One scheduler iteration as the server (and the simulator, `SimConfig.measured_costs`)
        times it: a decode step (`prefill_tokens` 0), or a prefill of `prefill_tokens`
        that also decoded `decode_rows` running requests (a mixed step): the prefill's share is
        the time beyond one decode step. `alone`: a prefill the policy ran without the decode rows
        a mixed step would have carried (planner.plan_step): its whole time, on its own line (it
        pays the forward's fixed time, which read as a mixed step's would make the policy's mixed
        steps look a decode step longer than they are)."""
        if prefill_tokens <= 0:
            self.observe_decode(seconds)
            return
        decode = self._decode if decode_rows > 0 else 0.0
        self.observe_prefill(prefill_tokens, seconds - decode, decode, alone)

    def observe_rotation(self, seconds: float) -> None:
        if math.isfinite(seconds) and seconds >= 0:
            self._rotation = self._mix("rotation", self._rotation, seconds)

    @property
    def costs(self) -> StepCosts:
        """The measured costs (read several times a step: built once per observation)."""
        if self._costs is None:
            self._costs = StepCosts(self._per_token, max(0.0, self._line.intercept or 0.0), self._decode,
                                    self._rotation, math.sqrt(self._spread_sq))
        return self._costs
