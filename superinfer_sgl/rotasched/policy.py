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

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from superinfer_sgl.rotasched.request_view import ReqView

if TYPE_CHECKING:
    from superinfer_sgl.rotasched.pending import PendingIndex
    from superinfer_sgl.rotasched.vlt import VltParams

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

    def prefill_cap(self, views: list[ReqView]) -> int | None:
        """Prefill tokens this step may carry whoever is admitted (`views`: the running ones);
        None: no cap."""
        ...

    def capped(self, chunk: int) -> LvfPolicy:
        """This policy for a step whose prefills are capped at `chunk` tokens."""
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
    # The decode reserve a running fixed-length (ignore_eos) request keeps, as a share of its
    # remaining outputs (planner.running_reserve_ratio; SGLang's: 1, all of them).
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

    def head_rows(self, pending: PendingIndex, now: float, vlt_params: VltParams) -> None:
        return None  # VLT order: LVF ranks every pending view (a heap, read as far as it goes)

    def defers(self, view: ReqView, now: float, ahead_tokens: int) -> bool:
        return False

    def victim_candidates(self, running: list[ReqView]) -> list[ReqView]:
        return running

    def victims(self, views: Sequence[ReqView], movable: Sequence[ReqView],
                stints: Sequence[float]) -> list[ReqView]:
        rows = sorted(((-lag, v.arrival, v.rid, v) for v, lag in zip(movable, stints) if lag < 0),
                      reverse=True)
        return [row[3] for row in rows]

    def prefill_cap(self, views: list[ReqView]) -> int | None:
        return None

    def capped(self, chunk: int) -> PaperLvf:
        return self

    def step_cap(self, views: list[ReqView], admitted: list[ReqView], now: float,
                 cap: int | None) -> int | None:
        return cap


PAPER = PaperLvf()
