"""The goodput policy (`GoodputLvf`, --policy goodput): LVF serving first the requests that can
still meet both SLOs.

The paper's Largest-VLT-First serves the most late request first. Under overload that is
earliest-deadline-first's domino effect: capacity goes to requests that have already missed their
TTFT, so the ones that could still make it miss too. The goodput policy keeps VLT as the urgency
scale but ranks by what a request can still gain:

- viable: it can still meet both SLOs. A waiting request without a first token is viable while
  `now + queue ahead of it + its own prefill + one decode step <= arrival + TTFT SLO`, all from
  measured step costs (`StepCosts`); a started one while its TTFT was met and it has gaps left it
  may miss (`ReqView.misses_left`, from the SLO's share of gaps met).
- best-effort: not viable. Still served (taking only memory that is free, never displacing
  anyone), longest remaining output first, in a queue (the first that does not fit waits for
  memory, as SGLang's own FCFS queue does), and promoted ahead of everyone once it has waited
  `max_best_effort_wait_s` (the starvation bound: from then on it is first in line for memory).
- shed: viable by itself, but not beside the viable requests ahead of it: when the deadline-first
  walk of the viable waiting requests reaches one that would miss its TTFT behind the work
  already kept ahead, the kept request with the most work per unit of class weight (prompt plus
  its decoding's share of the device: its outputs where its length is known, else the share of
  them that finished requests of unknown length decoded) leaves the viable tier for
  best-effort (rotasched/shedding.py: Moore and Hodgson's rule, which keeps the most jobs on time
  on one machine; --ttft-shedding).
Within the other tiers, earliest deadline first (`rank_key`: the slack of the SLO clock that is
ticking, stretched by the SLO class's weight); VLT still decides who is urgent, i.e. who may take
memory that rotation frees. EDF is what LVF's order is for one SLO (the oldest request is the
most late), so single-class runs rank as before; across classes it puts a fresh request of a
tight class before a loose one that still has seconds to spare, where LVF's absolute lag put the
loose one first once it passed half its TTFT SLO. EDF's weakness, the overload domino, is what
the tiers remove: a request that can no longer make its deadline leaves the viable tier.
Rotate-out victims are only requests that can no longer meet their SLOs (rotating one out costs
goodput nothing), and only when the stall the rotation adds to the step keeps every running
request with no gap to spare within its TBT SLO. Likewise prefill: an iteration carries at most
as many prefill tokens as keep that step within the TBT SLO of every such request
(`prefill_cap`: stall-free chunking).

The rules are functions of one view each; `GoodputLvf` hands them to LVF as its policy hooks
(rotasched/policy.py).
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar

from superinfer_sgl.rotasched.costs import StepCosts
from superinfer_sgl.rotasched.pending import PendingIndex, sorted_runs
from superinfer_sgl.rotasched.policy import BEST_EFFORT, PROMOTED, VIABLE, Ranks, Row
from superinfer_sgl.rotasched.request_view import ReqState, ReqView
from superinfer_sgl.rotasched.shedding import SHED_WINDOW, shed
from superinfer_sgl.rotasched.step_size import (
    JITTER_Z,
    MIN_PREFILL_CHUNK,
    mix_needed,
    prefill_cap,
    prefill_time_s,
    protected,
    spare_misses,
)
from superinfer_sgl.rotasched.vlt import VltParams, vlts

DEFAULT_MAX_BEST_EFFORT_WAIT_S = 60.0
ROTATION_AMORTIZE = 20
RUNNING_RESERVE = 0.4  # planner.running_reserve_ratio's share (docs/architecture.md)
_WAITING, _RUNNING = ReqState.WAITING, ReqState.RUNNING


@dataclass(frozen=True, slots=True)
class GoodputParams:
    costs: StepCosts
    max_best_effort_wait_s: float = DEFAULT_MAX_BEST_EFFORT_WAIT_S
    # The server streams a step's tokens only when the following step ends (SGLang's overlap
    # scheduler on a CPU, where the launch is the forward itself: docs/sim.md), so a request whose
    # prefill ended last step gets its first token when this step ends (`deadline_budget`).
    emit_after_next_step: bool = False
    ttft_shedding: bool = True  # `shed` (--ttft-shedding)
    # The share of its outputs left that a request which may stop at EOS is expected to decode
    # (`rotasched.output_share.OutputShare`, learned from finished requests): what `shed` counts
    # for one not yet started. 0: its prompt only.
    eos_output_share: float = 0.0

    def __post_init__(self) -> None:
        if not (self.max_best_effort_wait_s > 0):  # inf allowed: no promotion
            raise ValueError(f"max_best_effort_wait_s must be > 0, got {self.max_best_effort_wait_s}")
        if not (0.0 <= self.eos_output_share <= 1.0):
            raise ValueError(f"eos_output_share must be in [0, 1], got {self.eos_output_share}")


def lost(view: ReqView) -> bool:
    """It can no longer meet both SLOs, whatever is scheduled (TTFT missed, or TBT lost)."""
    return view.ttft_met is False or view.misses_left < 0


def ttft_reachable(view: ReqView, now: float, ahead_tokens: int, costs: StepCosts,
                   chunk: int | None = None) -> bool:
    """A request without a first token could still get it in time, prefilled after
    `ahead_tokens` prompt tokens of other prefills, in steps of at most `chunk` prefill tokens
    (its first token is sampled by the last step and streamed one step later)."""
    done = now + prefill_time_s(ahead_tokens + view.prefill_tokens, costs, chunk) + costs.decode_step_s
    return done <= view.arrival + view.ttft_slo


def slack(view: ReqView, now: float) -> float:
    """Seconds left on the SLO clock that is ticking for a waiting or rotary request: its TTFT
    deadline before its first token, after it the current gap's TBT deadline (a rotary request,
    or one waiting again after a recompute fallback). Negative: that deadline has passed."""
    if view.last_token is None:
        return view.arrival + view.ttft_slo - now
    return view.last_token + view.tbt_slo - now


def rank_key(view: ReqView, now: float, tier: int = VIABLE) -> float:
    """Order within a tier, smallest first (ties: oldest arrival first). Viable and promoted
    requests: earliest deadline first, with the class weight shrinking a request's slack (or
    stretching how late it is) so heavier classes go first.

    Best-effort requests: longest remaining output first (`ReqView.outputs_left`). They have no
    SLO left to meet, and every one completes; what their order still decides is when the run's
    work ends. A request with L outputs left decodes for L steps whatever runs beside it, so the
    long ones started last set the make-span (served oldest first, a few long lost requests end
    up decoding alone at the end of a run, and output throughput drops)."""
    if tier == BEST_EFFORT:
        return -float(view.outputs_left)
    s = slack(view, now)
    return s / view.weight if s >= 0 else s * view.weight


def tier(view: ReqView, now: float, gp: GoodputParams, chunk: int | None = None) -> int:
    """PROMOTED, VIABLE or BEST_EFFORT for a waiting or rotary request (nothing queued ahead;
    `chunk`: this step's prefill cap)."""
    if view.last_token is None:
        viable = ttft_reachable(view, now, 0, gp.costs, chunk)
        since = view.arrival
    else:
        viable = not lost(view)
        since = view.last_token
    if viable:
        return VIABLE
    return PROMOTED if now - since >= gp.max_best_effort_wait_s else BEST_EFFORT


def victim_key(view: ReqView, stint_s: float) -> tuple[float, float] | None:
    """Sort key of a rotate-out candidate (smallest first), or None: only requests that can no
    longer meet their SLOs are rotated out (nothing left to lose), lower class weight first, then
    the longest stint. A viable victim would pay the paused gap, and the resume's extend stalls
    every running request once more: in the simulator, victims with gaps to spare cost more joint
    attainment than the admissions they made room for gained (docs/architecture.md)."""
    if not lost(view):
        return None
    return (view.weight, -stint_s)


def rotation_affordable(running: list[ReqView], costs: StepCosts, eos_share: float = 0.0) -> bool:
    """The stall a rotation adds to the next step keeps every viable running request that has no
    gap to spare (`spare_misses`) within its TBT SLO."""
    gap = costs.decode_step_s + costs.rotation_s
    return all(gap <= v.tbt_slo for v in running if spare_misses(v, eos_share) == 0 and not lost(v))


def deadline_budget(views: list[ReqView], admitted: list[ReqView], now: float, gp: GoodputParams,
                    cap: int | None) -> int | None:
    """Prefill tokens this step may carry so that the requests whose first token it produces still
    get it by their TTFT deadline; None: no limit below `cap` (this step's prefill cap, None:
    uncapped). Each such request bounds the step at `room` tokens, what fits between now and its
    deadline in one mixed step (its decode step and fixed prefill time, the step's measured spread
    allowed for: ~90% of such steps within it, step_size.JITTER_Z); at least MIN_PREFILL_CHUNK.

    Who that is: every request of `admitted` (this step's admissions, in the order the executor
    offers them) whose whole prompt fits in the step, since all prompts prefilled in one step get
    their first token when it ends, those admitted behind a request as much as those ahead of it;
    and, where the server streams a step's tokens after the next step (`emit_after_next_step`),
    every running request still waiting for its first token. A request that cannot make its
    deadline in this step sets no limit (it can no longer be helped here), nor does one whose prompt
    spills into a later step (it is planned again there). Without it a short interactive prompt
    sharing its step with prompts admitted behind it gets its first token after its deadline."""
    costs = gp.costs
    if costs.prefill_s_per_token <= 0:
        return None
    stretch = 1.0 + JITTER_Z * costs.step_cv
    fixed = costs.decode_step_s + costs.prefill_base_s

    def room(view: ReqView) -> float:
        return ((view.arrival + view.ttft_slo - now) / stretch - fixed) / costs.prefill_s_per_token

    limit = math.inf if cap is None else cap
    if gp.emit_after_next_step:
        for v in views:
            if v.state is _RUNNING and v.last_token is None and (r := room(v)) >= 0:
                limit = min(limit, max(MIN_PREFILL_CHUNK, math.floor(r)))
    total = 0
    for v in admitted:
        total += v.prefill_tokens
        if total > limit:
            break
        if v.last_token is None and (r := room(v)) >= total:
            limit = min(limit, max(MIN_PREFILL_CHUNK, math.floor(r)))
    if limit == math.inf or (cap is not None and limit >= cap):
        return None
    return int(limit)


@dataclass(frozen=True, slots=True)
class GoodputLvf:
    """The goodput policy's hooks for one step (rotasched/policy.py's `LvfPolicy`); `chunk`: the
    step's prefill cap, which sets how long the chosen prefills take (None: uncapped)."""

    params: GoodputParams
    chunk: int | None = None
    decode_share_s: float = 0.0  # `shed`'s, set by `batched`

    name: ClassVar[str] = "goodput"
    queues_best_effort: ClassVar[bool] = True  # longest-output-first: the largest would starve
    reads_running_progress: ClassVar[bool] = True  # victims and the cap read gaps left
    # A running fixed-length request keeps back this share of its remaining outputs, not all of
    # them: the batch holds more requests, and LVF rotates one out when memory runs short.
    running_reserve: ClassVar[float] = RUNNING_RESERVE

    @staticmethod
    def quantum_s(rotation_s: float) -> float:
        """ROTATION_AMORTIZE rotations' worth of the measured rotation cost: a rotation takes at
        most 1/ROTATION_AMORTIZE of the victim's stint."""
        return ROTATION_AMORTIZE * rotation_s

    @classmethod
    def for_step(cls, measured: Callable[[], GoodputParams]) -> GoodputLvf:
        return cls(measured())

    def rank(self, views: Sequence[ReqView], lags: Sequence[float], now: float) -> Ranks:
        """By tier, then earliest deadline first (best-effort: longest output left first); the
        viable waiting requests `shed` drops are best-effort."""
        params, chunk = self.params, self.chunk
        tiers = [tier(v, now, params, chunk) for v in views]
        if params.ttft_shedding:
            fresh = sorted((rank_key(v, now), v.arrival, v.rid, v) for v, t in zip(views, tiers)
                           if t == VIABLE and v.last_token is None)
            dropped = shed((row[3] for row in fresh), now, params.costs, chunk, self.decode_share_s, SHED_WINDOW,
                           params.eos_output_share)
            tiers = [BEST_EFFORT if v.rid in dropped else t for v, t in zip(views, tiers)]
        return tiers, [rank_key(v, now, t) for v, t in zip(views, tiers)]

    def defers(self, view: ReqView, now: float, ahead_tokens: int) -> bool:
        """A prefill that cannot get its first token in time behind those chosen before it."""
        return view.last_token is None and not ttft_reachable(view, now, ahead_tokens, self.params.costs,
                                                              self.chunk)

    def victim_candidates(self, running: list[ReqView]) -> list[ReqView]:
        """The lost ones (`victim_key`; `lost`, inlined: this reads every running view)."""
        return [v for v in running if v.ttft_met is False or v.misses_left < 0]

    def victims(self, views: Sequence[ReqView], movable: Sequence[ReqView],
                stints: Sequence[float]) -> list[ReqView]:
        """Lost requests only (`victim_key`), and only while a rotation's stall is affordable."""
        if not rotation_affordable([v for v in views if v.state is _RUNNING], self.params.costs,
                                   self.params.eos_output_share):
            return []
        keyed = []
        for v, lag in zip(movable, stints):
            key = victim_key(v, -lag) if lag < 0 else None
            if key is not None:
                keyed.append((key, v.arrival, v.rid, v))
        keyed.sort()
        return [row[3] for row in keyed]

    def head_rows(self, pending: PendingIndex, now: float, vlt_params: VltParams) -> Iterator[Row]:
        """`rank`'s order of the pending views, (tier, key, arrival, rid) ascending, produced only as
        far as the head scan reads it (`GoodputBook`): the promoted requests (only those waiting
        longer than the bound are looked at), then the viable ones merged from their classes'
        deadline orders (a request not yet started is looked at only while its TTFT deadline has
        not passed), then the best-effort ones by outputs left. Each request's tier is `tier`'s,
        computed when the walk reaches it; those `shed` drops (`_shed`, read first) are
        best-effort."""
        book = pending.book(GoodputBook)
        views, params, chunk = pending.views, self.params, self.chunk
        tiers: dict[str, int] = {}

        def row(view: ReqView, t: int) -> Row:
            return (t, rank_key(view, now, t), view.arrival, view.rid, view, vlts((view,), now, vlt_params)[0] > 0)

        def tier_of(view: ReqView) -> int:
            t = tiers.get(view.rid)
            if t is None:
                t = tiers[view.rid] = tier(view, now, params, chunk)
            return t

        def viable(rows: list[tuple[float, float, str]], started: bool) -> Iterator[Row]:
            # rank_key grows with the deadline within a class (sorted_runs: equal keys)
            first = 0 if started else bisect.bisect_left(rows, (now,))
            for _, _, rid in itertools.islice(rows, first, None):
                view = views[rid]
                if started or tier_of(view) == VIABLE:
                    yield row(view, VIABLE)

        if params.ttft_shedding:
            for rid in self._shed(book, views, now):
                tiers[rid] = BEST_EFFORT  # where the best-effort walk finds it, and `viable` skips it
        promoted = []
        for since, _, rid in book.by_since:
            if not now - since >= params.max_best_effort_wait_s:
                break
            view = views[rid]
            if tier_of(view) == PROMOTED:
                promoted.append(row(view, PROMOTED))
        promoted.sort()
        yield from promoted
        yield from heapq.merge(*(sorted_runs(viable(rows, started)) for (_, started), rows in book.deadlines.items()))
        for _, _, rid in book.by_outputs:
            view = views[rid]
            if tier_of(view) == BEST_EFFORT:
                yield row(view, BEST_EFFORT)

    def _shed(self, book: GoodputBook, views: dict[str, ReqView], now: float) -> set[str]:
        """`shed` over the viable requests without a first token in `rank`'s order, read off the
        book's deadline lists as far as the window (keys only: no rows are built for them; viable
        is `tier`'s test for them, inlined)."""
        costs, chunk = self.params.costs, self.chunk

        def keyed(rows: list[tuple[float, float, str]], weight: float) -> Iterator[tuple[int, float, float, str]]:
            # rank_key of a request not yet started, its deadline not passed
            for d, a, rid in itertools.islice(rows, bisect.bisect_left(rows, (now,)), None):
                yield VIABLE, (d - now) / weight, a, rid

        runs = [sorted_runs(keyed(rows, weight)) for (weight, started), rows in book.deadlines.items() if not started]
        fresh: list[ReqView] = []
        for _, _, _, rid in heapq.merge(*runs) if len(runs) > 1 else runs[0] if runs else ():
            view = views[rid]
            if ttft_reachable(view, now, 0, costs, chunk):
                fresh.append(view)
                if len(fresh) == SHED_WINDOW:
                    break
        return shed(fresh, now, costs, chunk, self.decode_share_s, SHED_WINDOW, self.params.eos_output_share)

    def batched(self, running: list[ReqView]) -> GoodputLvf:
        """`shed`'s decode share for a running batch of `running`: a decode step's time over its
        requests, each output token's share of the device."""
        share = self.params.costs.decode_step_s / max(1, len(running))
        return dataclasses.replace(self, decode_share_s=share) if self.params.ttft_shedding else self

    def prefill_cap(self, views: list[ReqView]) -> int | None:
        return prefill_cap(views, self.params.costs, self.params.eos_output_share)

    def capped(self, chunk: int) -> GoodputLvf:
        return dataclasses.replace(self, chunk=chunk)

    def mixes(self, views: list[ReqView], prefill_tokens: int | None) -> bool:
        """`mix_needed`; `prefill_tokens` None: unknown (a split prompt's rest), so any protected
        request needs it."""
        if prefill_tokens is None:
            return bool(protected(views, self.params.costs, self.params.eos_output_share))
        return mix_needed(views, prefill_tokens, self.params.costs, self.params.eos_output_share)

    def step_cap(self, views: list[ReqView], admitted: list[ReqView], now: float,
                 cap: int | None) -> int | None:
        """Lowered where this step's first tokens need it (`deadline_budget`)."""
        if not admitted and not self.params.emit_after_next_step:
            return cap
        budget = deadline_budget(views, admitted, now, self.params, cap)
        return cap if budget is None else budget


class GoodputBook:
    """The goodput order's structures over a `PendingIndex` (`GoodputLvf.head_rows` reads them):

    - `deadlines[(weight, started)]`: (deadline, arrival, rid), the deadline of the SLO clock that
      is ticking (`slack` = deadline - now). Within one weight `rank_key` grows with the deadline at
      any `now`, so each list is its class's viable order, whatever the time; requests not yet
      started whose deadline has passed cannot be viable, and are skipped with one bisection.
      Started requests that lost their SLOs are never viable and are not filed here.
    - `by_outputs`: (-outputs left, arrival, rid) of every request: the best-effort order.
    - `by_since`: (since, arrival, rid) of every request that may be promoted (all but the started
      ones still viable): those waiting longest first.

    Sorted lists (bisect): a request is filed or unfiled when it arrives, leaves or changes what it
    is filed by, at C speed even for tens of thousands (the policy stays stdlib-only).
    """

    def __init__(self) -> None:
        self.deadlines: dict[tuple[float, bool], list[tuple[float, float, str]]] = {}
        self.by_outputs: list[tuple[float, float, str]] = []
        self.by_since: list[tuple[float, float, str]] = []

    def filing(self, view: ReqView) -> Hashable:
        return (view.weight, view.arrival, view.last_token, view.ttft_slo, view.tbt_slo, view.outputs_left,
                lost(view) if view.last_token is not None else None)

    @staticmethod
    def _deadline(view: ReqView) -> tuple[tuple[float, bool], float] | None:
        if view.last_token is None:
            return (view.weight, False), view.arrival + view.ttft_slo
        if lost(view):
            return None
        return (view.weight, True), view.last_token + view.tbt_slo

    def fill(self, views: list[ReqView]) -> None:
        for view in views:
            rid, arrival = view.rid, view.arrival
            filed = self._deadline(view)
            if filed is not None:
                group, deadline = filed
                self.deadlines.setdefault(group, []).append((deadline, arrival, rid))
            if filed is None or view.last_token is None:
                self.by_since.append((arrival if view.last_token is None else view.last_token, arrival, rid))
            self.by_outputs.append((-float(view.outputs_left), arrival, rid))
        for rows in (*self.deadlines.values(), self.by_since, self.by_outputs):
            rows.sort()

    def add(self, view: ReqView) -> None:
        rid, arrival = view.rid, view.arrival
        filed = self._deadline(view)
        if filed is not None:
            group, deadline = filed
            bisect.insort(self.deadlines.setdefault(group, []), (deadline, arrival, rid))
        if filed is None or view.last_token is None:
            bisect.insort(self.by_since, (arrival if view.last_token is None else view.last_token, arrival, rid))
        bisect.insort(self.by_outputs, (-float(view.outputs_left), arrival, rid))

    def remove(self, view: ReqView) -> None:
        rid, arrival = view.rid, view.arrival
        filed = self._deadline(view)
        if filed is not None:
            group, deadline = filed
            _unfile(self.deadlines[group], (deadline, arrival, rid))
        if filed is None or view.last_token is None:
            _unfile(self.by_since, (arrival if view.last_token is None else view.last_token, arrival, rid))
        _unfile(self.by_outputs, (-float(view.outputs_left), arrival, rid))


def _unfile(rows: list[tuple[float, float, str]], row: tuple[float, float, str]) -> None:
    i = bisect.bisect_left(rows, row)
    assert i < len(rows) and rows[i] == row, row
    del rows[i]
