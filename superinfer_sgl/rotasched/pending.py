"""A step's queue as LVF reads it: the running views, and the waiting and rotary ones in an index
kept between steps (`PendingIndex`), so that a step costs what changed, not what is queued.

The index holds one view per waiting or rotary request and the sum of their block needs (LVF's
first question: does memory cover them all?). A policy that can rank lazily keeps its own ordered
structures on it (`book`): a book is told of every view put in or dropped, and re-files a view only
when what it files it by changed. Thousands of requests queue on a GPU server, and the head scan
mostly reads a handful of them (docs/architecture.md, "Scheduler cost"). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from superinfer_sgl.rotasched.request_view import ReqState, ReqView

_RUNNING = ReqState.RUNNING


class Book(Protocol):
    """A policy's ordered structures over an index's views."""

    def filing(self, view: ReqView) -> Hashable:
        """What the book files `view` by: it is re-filed only when this changes."""
        ...

    def fill(self, views: list[ReqView]) -> None:
        """File `views` into an empty book (sorted once, not inserted one by one)."""
        ...

    def add(self, view: ReqView) -> None: ...

    def remove(self, view: ReqView) -> None: ...


B = TypeVar("B", bound=Book)
R = TypeVar("R", bound=tuple)


def sorted_runs(rows: Iterable[R]) -> Iterator[R]:
    """Ranked rows (tier, key, arrival, rid, ...) whose (tier, key) never decreases, in full row
    order: each run of equal (tier, key) sorted by arrival, then rid. A book's order (a deadline,
    an arrival) makes keys non-decreasing, but two different deadlines may round to one key.
    (Every row the policy reads passes here: a run of one, the common case, is not sorted.)"""
    it = iter(rows)
    for first in it:
        break
    else:
        return
    tier, key = first[0], first[1]
    run: list[R] = [first]
    for row in it:
        if row[1] == key and row[0] == tier:
            run.append(row)
            continue
        if len(run) == 1:
            yield run[0]
        else:
            run.sort()
            yield from run
        run = [row]
        tier, key = row[0], row[1]
    if len(run) > 1:
        run.sort()
    yield from run


class PendingIndex:
    """Waiting and rotary views by rid, their summed block needs, and the policies' books."""

    def __init__(self, views: Iterable[ReqView] = ()) -> None:
        self.views: dict[str, ReqView] = {}
        self.blocks_needed = 0
        self._books: dict[type, Book] = {}
        for view in views:
            self.put(view)

    def __len__(self) -> int:
        return len(self.views)

    def __iter__(self) -> Iterator[ReqView]:
        return iter(self.views.values())

    def put(self, view: ReqView) -> None:
        """Add `view`, or replace the view of its rid."""
        assert view.state is not _RUNNING, view.rid
        old = self.views.get(view.rid)
        if old is view:
            return
        self.views[view.rid] = view
        self.blocks_needed += view.blocks_needed - (0 if old is None else old.blocks_needed)
        for book in self._books.values():
            if old is None:
                book.add(view)
            elif book.filing(old) != book.filing(view):
                book.remove(old)
                book.add(view)

    def drop(self, rid: str) -> None:
        old = self.views.pop(rid, None)
        if old is None:
            return
        self.blocks_needed -= old.blocks_needed
        for book in self._books.values():
            book.remove(old)

    def book(self, kind: type[B]) -> B:
        """The book of this kind, filled from the index's views the first time it is asked for."""
        got = self._books.get(kind)
        if got is None:
            got = kind()
            got.fill(list(self.views.values()))
            self._books[kind] = got
        return got  # type: ignore[return-value]


@dataclass
class StepQueue:
    """Every request of a step: `running` views (in batch order) and the `pending` index.

    With `refresh` set, the running views are current in what a policy reads every step (states,
    stints, SLOs, first tokens, gaps left to miss) but may hold older `blocks_held` and
    `rotatable`, which only LVF's wall and its victims read: the wall asks `fresh_running`
    (`refresh(views)`: those views with every field current), the victims `movable`. The
    server's views: checking every running request's blocks and rotatability each step cost
    more than the rest of the step."""

    running: list[ReqView] = field(default_factory=list)
    pending: PendingIndex = field(default_factory=PendingIndex)
    refresh: Callable[[list[ReqView]], list[ReqView]] | None = None
    # Of the views given, those that may be rotated out now, fresh (the server's: only their
    # rotatability is checked first, their blocks where it holds); None: read them as they are.
    movable_of: Callable[[list[ReqView]], list[ReqView]] | None = None
    # At most the running views' blocks held (fresh): LVF's wall is summed exactly only when a
    # request needs more than free memory plus this (the server's: from the batch's tokens).
    held_floor: int = 0

    def movable(self, views: list[ReqView]) -> list[ReqView]:
        """Of `views` (running ones of this queue), those that may be rotated out now: rotatable
        and holding blocks, with every field current."""
        if self.refresh is not None and views:
            if self.movable_of is not None:
                return self.movable_of(views)
            views = self.refresh(views)
        return [v for v in views if v.rotatable and v.blocks_held > 0]

    def fresh_running(self) -> list[ReqView]:
        """Every running view with every field current."""
        if self.refresh is not None:
            self.running, self.refresh = self.refresh(self.running), None
        return self.running

    @classmethod
    def of(cls, views: Iterable[ReqView]) -> StepQueue:
        """A queue from a flat list of views (the simulator's and the tests' form)."""
        listed = list(views)
        assert len({v.rid for v in listed}) == len(listed), "duplicate rid in views"
        running = [v for v in listed if v.state is _RUNNING]
        return cls(running, PendingIndex(v for v in listed if v.state is not _RUNNING))

    def __iter__(self) -> Iterator[ReqView]:
        yield from self.fresh_running()
        yield from self.pending
