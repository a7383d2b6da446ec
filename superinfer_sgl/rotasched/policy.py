"""What Largest-VLT-First leaves to a policy, and the paper's own answers (`PaperLvf`).

LVF's steps are fixed (rotasched/lvf.py, the paper's Algorithm 1): FCFS when memory covers every
request; otherwise rank the waiting and rotary requests, admit or resume from the head while they
fit (an urgent one may take memory that rotating running requests out frees), and rotate out from
the tail. A policy answers the questions those steps ask (`LvfPolicy`):

- `rank`: the head order, as a tier and a key per request (smaller first; ties go to the oldest
  arrival, then rid). Tiers say who may displace running requests: PROMOTED always, VIABLE when
  its VLT > 0 (the paper's urgency), BEST_EFFORT never.
- `queues_best_effort`: whether the first best-effort request that does not fit stops the scan
  (a queue, as SGLang's FCFS queue is) or is skipped.
- `defers`: whether a waiting request is moved behind everyone, given the prompt tokens of the
  prefills already chosen ahead of it in this step.
- `victims`: which running requests may be rotated out, tail first.
- `prefill_cap`, `step_cap`: the most prefill tokens this step may carry, before and after LVF
  chose its admissions.

A policy object serves one scheduler iteration (its inputs, e.g. measured step costs, move); a
policy class is chosen by name (`planner.POLICIES`) and built per step by `for_step`. Pure Python.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Callable, Hashable, Iterator, Sequence
from typing import Any, ClassVar, Protocol

from superinfer_sgl.rotasched.pending import PendingIndex, sorted_runs
from superinfer_sgl.rotasched.request_view import ReqView
from superinfer_sgl.rotasched.vlt import VltParams, vlts

PROMOTED, VIABLE, BEST_EFFORT = 0, 1, 2  # tiers, scanned in this order
PAPER_QUANTUM_S = 5.0  # the paper policy's rotation quantum (chosen in the simulator: docs/sim.md)

Ranks = tuple[list[int], list[float]]  # (tiers, keys) of views in order: smaller first
# A ranked row, as LVF's head scan reads it: (tier, key, arrival, rid, view, hot); hot: VLT > 0.
# Rids are unique, so rows sort by (tier, key, arrival, rid) and views are never compared.
Row = tuple[int, float, float, str, ReqView, bool]


class LvfPolicy(Protocol):
    """The hooks `lvf.lvf_decide` and `planner.plan_step` call, for one scheduler iteration."""

    name: ClassVar[str]
    queues_best_effort: ClassVar[bool]
    # It reads running requests' progress (gaps, first token) every step: a view of a running
    # request cannot be reused from an earlier step (the simulator caches views otherwise).
    reads_running_progress: ClassVar[bool]

    def rank(self, views: Sequence[ReqView], lags: Sequence[float], now: float) -> Ranks:
        """The tier and the key of each waiting or rotary view, `lags` their VLTs (two lists: LVF
        ranks every queued request every iteration, so no tuple per request)."""
        ...

    def head_rows(self, pending: PendingIndex, now: float, vlt_params: VltParams) -> Iterator[Row] | None:
        """The pending views' rows in `rank`'s order, produced lazily from structures kept on the
        index between steps (`PendingIndex.book`); None: LVF ranks every pending view itself."""
        ...

    def defers(self, view: ReqView, now: float, ahead_tokens: int) -> bool:
        """A VIABLE waiting request goes to the end of the scan as BEST_EFFORT, with
        `ahead_tokens` prompt tokens of this step's prefills chosen before it."""
        ...

    def victim_candidates(self, running: list[ReqView]) -> list[ReqView]:
        """The running views `victims` could pick, told from what every view holds current (state,
        stint, SLOs, first token, gaps left to miss; not its blocks or rotatability): only these
        are refreshed before `victims` is asked."""
        ...

    def victims(self, views: Sequence[ReqView], movable: Sequence[ReqView],
                stints: Sequence[float]) -> list[ReqView]:
        """Rotate-out candidates among `movable` (rotatable running views, `stints` their VLTs:
        -stint length), tail first; `views`: every running request of the step."""
        ...

    def batched(self, running: list[ReqView]) -> LvfPolicy:
        """This policy for a step whose running batch is `running`."""
        ...

    def prefill_cap(self, views: list[ReqView]) -> int | None:
        """Prefill tokens this step may carry whoever is admitted (`views`: the running ones);
        None: no cap."""
        ...

    def capped(self, chunk: int) -> LvfPolicy:
        """This policy for a step whose prefills are capped at `chunk` tokens."""
        ...

    def mixes(self, views: list[ReqView], prefill_tokens: int | None) -> bool:
        """Whether a step prefilling `prefill_tokens` (None: unknown) rides with the decode batch
        where the server mixes (`views`: the running ones)."""
        ...

    def step_cap(self, views: list[ReqView], admitted: list[ReqView], now: float,
                 cap: int | None) -> int | None:
        """The step's prefill cap once `admitted` (in offer order) are chosen (`views`: the running
        ones); `cap`: `prefill_cap`'s."""
        ...


class PolicyClass(Protocol):
    """A registry entry: the class, with what is known before a step (`planner.POLICIES`)."""

    name: str
    reads_running_progress: bool
    # The decode reserve a running request keeps, as a share of SGLang's
    # (planner.running_reserve_ratio; SGLang's own: 1).
    running_reserve: float

    def quantum_s(self, rotation_s: float) -> float:
        """The default rotation quantum: no running request is rotated out before this long in its
        stint; `rotation_s` the measured extra time of one rotation."""
        ...

    def for_step(self, measured: Callable[[], Any]) -> LvfPolicy:
        """The policy for one step; `measured()` gives the step's `goodput.GoodputParams`
        (measured costs and settings), called only by a policy that reads them."""
        ...


class PaperLvf:
    """The paper's rule: one tier ordered by VLT, largest first; the longest running stint is the
    first victim; no prefill cap, nobody deferred."""

    name: ClassVar[str] = "paper"
    queues_best_effort: ClassVar[bool] = False  # it has no best-effort tier
    reads_running_progress: ClassVar[bool] = False
    running_reserve: ClassVar[float] = 1.0  # SGLang's admission, as the paper ran it

    @staticmethod
    def quantum_s(rotation_s: float) -> float:
        return PAPER_QUANTUM_S

    @classmethod
    def for_step(cls, measured: Callable[[], Any]) -> PaperLvf:
        return PAPER

    def rank(self, views: Sequence[ReqView], lags: Sequence[float], now: float) -> Ranks:
        return [VIABLE] * len(lags), [-lag for lag in lags]

    def head_rows(self, pending: PendingIndex, now: float, vlt_params: VltParams) -> Iterator[Row]:
        """VLT order (`PaperBook`): the urgent requests (VLT > 0) merged from their SLOs' orders,
        walked from the oldest while urgent; then the others (VLT 0: equal keys) by arrival."""
        book = pending.book(PaperBook)
        views = pending.views
        hot_ends: dict[tuple[bool, float], int] = {}

        def hot(group: tuple[bool, float], rows: list[tuple[float, float, str]]) -> Iterator[Row]:
            for i, (_, _, rid) in enumerate(rows):
                view = views[rid]
                lag = vlts((view,), now, vlt_params)[0]
                if not lag > 0:
                    hot_ends[group] = i
                    return
                yield (VIABLE, -lag, view.arrival, rid, view, True)
            hot_ends[group] = len(rows)

        def cold(group: tuple[bool, float], rows: list[tuple[float, float, str]]) -> Iterator[Row]:
            rest = ((VIABLE, -vlts((views[rid],), now, vlt_params)[0], arrival, rid, views[rid], False)
                    for _, arrival, rid in itertools.islice(rows, hot_ends[group], None))
            # a started request's rows go by its last token; not urgent, they go by arrival
            return iter(sorted(rest)) if group[0] else rest

        yield from heapq.merge(*(sorted_runs(hot(g, rows)) for g, rows in book.groups.items()))
        yield from heapq.merge(*(cold(g, rows) for g, rows in book.groups.items()))

    def defers(self, view: ReqView, now: float, ahead_tokens: int) -> bool:
        return False

    def victim_candidates(self, running: list[ReqView]) -> list[ReqView]:
        return running

    def victims(self, views: Sequence[ReqView], movable: Sequence[ReqView],
                stints: Sequence[float]) -> list[ReqView]:
        rows = sorted(((-lag, v.arrival, v.rid, v) for v, lag in zip(movable, stints) if lag < 0),
                      reverse=True)
        return [row[3] for row in rows]

    def batched(self, running: list[ReqView]) -> PaperLvf:
        return self

    def prefill_cap(self, views: list[ReqView]) -> int | None:
        return None

    def capped(self, chunk: int) -> PaperLvf:
        return self

    def mixes(self, views: list[ReqView], prefill_tokens: int | None) -> bool:
        return True

    def step_cap(self, views: list[ReqView], admitted: list[ReqView], now: float,
                 cap: int | None) -> int | None:
        return cap


class PaperBook:
    """VLT's order over a `PendingIndex`: per SLO clock and length (the TTFT SLO before a first
    token, the TBT SLO after), (anchor, arrival, rid), the anchor the arrival or the last token.
    Within one group a request's VLT grows as its anchor is older, whatever the time and the VLT
    parameters, so each list is its group's urgency order."""

    def __init__(self) -> None:
        self.groups: dict[tuple[bool, float], list[tuple[float, float, str]]] = {}

    def filing(self, view: ReqView) -> Hashable:
        return (view.last_token, view.arrival, view.ttft_slo, view.tbt_slo)

    @staticmethod
    def _filed(view: ReqView) -> tuple[tuple[bool, float], tuple[float, float, str]]:
        if view.last_token is None:
            return (False, view.ttft_slo), (view.arrival, view.arrival, view.rid)
        return (True, view.tbt_slo), (view.last_token, view.arrival, view.rid)

    def fill(self, views: list[ReqView]) -> None:
        for view in views:
            group, row = self._filed(view)
            self.groups.setdefault(group, []).append(row)
        for rows in self.groups.values():
            rows.sort()

    def add(self, view: ReqView) -> None:
        group, row = self._filed(view)
        bisect.insort(self.groups.setdefault(group, []), row)

    def remove(self, view: ReqView) -> None:
        group, row = self._filed(view)
        rows = self.groups[group]
        i = bisect.bisect_left(rows, row)
        assert i < len(rows) and rows[i] == row, row
        del rows[i]


PAPER = PaperLvf()
