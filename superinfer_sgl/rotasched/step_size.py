"""How much prefill a goodput step carries, and whether it rides with the decode batch: the
goodput policy's stall-free chunking (`GoodputLvf.prefill_cap`, `GoodputLvf.mixes`).

A mixed step (SGLang's mixed chunk) gives every running request its next token when the step's
prefill ends, so the prefill makes their next gap: the cap keeps it within the TBT SLO of those
that cannot spare a miss. An unmixed step gives the prefill's own first tokens sooner and makes
the running requests wait one decode step more; with `--mix-prefill needed` a step that leaves
nobody waiting mixes only when that would cost one of them its gap (planner.plan_step). Pure
functions of the running views and the measured step costs.
"""

from __future__ import annotations

import math

from superinfer_sgl.rotasched.costs import MIN_PREFILL_TOKENS, StepCosts
from superinfer_sgl.rotasched.request_view import ReqState, ReqView

# Tokens: the prefill cap never goes below this, so prefills always progress. No higher: on a slow
# (CPU) server the computed cap sits below a larger floor most of the time, which would override the
# cap it exists for; no lower: the cost meter learns the per-token cost from prefills of at least
# this size (costs.MIN_PREFILL_TOKENS), so capped steps keep that estimate current.
MIN_PREFILL_CHUNK = MIN_PREFILL_TOKENS
CAP_TBT_SHARE = 0.9  # the prefill cap aims a step at this share of the TBT SLO (prefill_cap) ...
# ... or lower where steps spread, so that ~98% of them stay within it: a request the cap protects
# may miss at most SPARE_MISSES more gaps for the rest of its life (its misses left never grow), so
# a step over its SLO one time in ten (z = 1.28) costs many such requests their TBT (docs/results.md,
# "Steps that spread")
GAP_JITTER_Z = 2.0
JITTER_Z = 1.28  # a first token's deadline (goodput.deadline_budget): ~90% of steps within it
SPARE_MISSES = 1  # the cap protects requests with at most this many gaps left to miss
# Where finished requests of unknown length decoded at least this share of their max_new_tokens
# (`rotasched.output_share`), their bounds are taken as their lengths (`spare_misses`).
BOUND_IS_LENGTH_SHARE = 0.9
_RUNNING = ReqState.RUNNING


def prefill_time_s(tokens: int, costs: StepCosts, chunk: int | None) -> float:
    """Time to prefill `tokens` prompt tokens: one step, or with this step's prefill cap `chunk`
    one capped step per `chunk` tokens, each riding a decode step of the running batch (mixed
    chunk). Counting a capped prefill as one step would admit requests that then miss their TTFT
    anyway."""
    steps = 1 if chunk is None or chunk <= 0 else max(1, math.ceil(tokens / chunk))
    return steps * costs.prefill_base_s + (steps - 1) * costs.decode_step_s + costs.prefill_s_per_token * tokens


def spare_misses(view: ReqView, eos_share: float = 0.0) -> int:
    """Gaps a running request can surely still miss and meet its TBT SLO: its budget
    (`ReqView.misses_left`) where its length is known; none where it may stop at EOS, since that
    budget counts gaps up to its max_new_tokens that it may never have (it may end at its next
    token: counted against the bound, a request asking for 1,024 tokens and ending at 100 looked
    free to miss ~100 gaps, and its TBT went to big prefills), unless such requests have been
    decoding nearly all they ask for (`eos_share`, what finished ones decoded of their bound, at
    least BOUND_IS_LENGTH_SHARE). Negative: its TBT is lost."""
    if view.outputs_known or view.misses_left < 0 or eos_share >= BOUND_IS_LENGTH_SHARE:
        return view.misses_left
    return 0


def protected(views: list[ReqView], costs: StepCosts, eos_share: float = 0.0) -> list[ReqView]:
    """The running requests a capped step protects: viable, first token met, at most SPARE_MISSES
    gaps left to miss (`spare_misses`), and a TBT SLO that a step of MIN_PREFILL_CHUNK prefill tokens keeps. Where
    even that step takes longer than the SLO (a saturated CPU, docs/results.md), chunking the
    prefills would only add steps, each one a missed gap and a later first token."""
    floor = costs.decode_step_s + costs.prefill_base_s + MIN_PREFILL_CHUNK * costs.prefill_s_per_token
    return [v for v in views if v.state is _RUNNING and v.ttft_met is True
            and 0 <= spare_misses(v, eos_share) <= SPARE_MISSES and v.tbt_slo >= floor]


def prefill_cap(views: list[ReqView], costs: StepCosts, eos_share: float = 0.0) -> int | None:
    """Prefill tokens one iteration may carry so that the step (one decode step plus the prefill)
    stays within `cap_share` of the TBT SLO of every `protected` running request; None when no
    such request runs (the configured chunk size stands). A mixed step's prefill makes every
    running request's next gap; without the cap one long chunk on a slow server is a missed gap
    for the whole batch. At least MIN_PREFILL_CHUNK.

    Why the margins: the costs are averages and a real step varies around them (a mixed step also
    grows the batch it decodes), so a step aimed exactly at the SLO misses about half the time;
    and a request protected only at its last spare gap loses its TBT to the first unforeseen stall
    (a rotation, a slow step). Where single steps spread (`StepCosts.step_cv`), the share shrinks
    further (`cap_share`)."""
    if costs.prefill_s_per_token <= 0:
        return None
    tight = [v.tbt_slo for v in protected(views, costs, eos_share)]
    if not tight:
        return None
    room = cap_share(costs.step_cv) * min(tight) - costs.decode_step_s - costs.prefill_base_s
    return max(MIN_PREFILL_CHUNK, int(room / costs.prefill_s_per_token))


def mix_needed(views: list[ReqView], prefill_tokens: int, costs: StepCosts, eos_share: float = 0.0) -> bool:
    """Whether this step's prefill of `prefill_tokens` should ride with the decode batch (SGLang's
    mixed chunk): only when a `protected` running request would otherwise miss its next gap.
    Unmixed, the prefill runs alone and the running requests' next token comes one decode step
    after it (taken as a mixed step's time plus a decode step); mixed, it comes with the prefill,
    whose own first tokens then come later by the decode rows' time (a few ms on a CPU: the
    low-load TTFT tax, docs/results.md). Nobody else needs it: a request with gaps to spare may
    spend one, as it does on stock SGLang."""
    alone = 2 * costs.decode_step_s + costs.prefill_base_s + costs.prefill_s_per_token * prefill_tokens
    share = cap_share(costs.step_cv)
    return any(alone > share * v.tbt_slo for v in protected(views, costs, eos_share))


def cap_share(step_cv: float) -> float:
    """The share of the TBT SLO a capped step is aimed at: CAP_TBT_SHARE, or less where steps
    spread so much that a step aimed there would exceed the SLO more than ~2% of the time (a
    step's time taken as its mean times 1 + step_cv x a standard normal); with no spread it is
    CAP_TBT_SHARE."""
    return min(CAP_TBT_SHARE, 1.0 / (1.0 + GAP_JITTER_Z * step_cv))
