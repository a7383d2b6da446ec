"""The pending index kept between steps (rotasched/pending.py) and the goodput policy's lazy head
order over it (`GoodputLvf.head_rows`): the order read to its end is exactly the full sort LVF did
before (every tier, key and tie), and an index updated view by view decides as one built afresh."""

from __future__ import annotations

import dataclasses
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer_sgl.rotasched import ReqState, ReqView, VltParams, goodput, lvf
from superinfer_sgl.rotasched.goodput import GoodputLvf, GoodputParams, StepCosts
from superinfer_sgl.rotasched.pending import PendingIndex, StepQueue, sorted_runs
from superinfer_sgl.rotasched.policy import PAPER

NOW = 1000.0
_ms = st.integers(0, 90_000)


@st.composite
def _view(draw: st.DrawFn, i: int) -> ReqView:
    state = draw(st.sampled_from([ReqState.WAITING, ReqState.ROTARY, ReqState.RUNNING]))
    arrival = NOW - draw(_ms) / 1000
    started = state is ReqState.ROTARY or draw(st.booleans())
    last = arrival + draw(st.integers(0, 5_000)) / 1000 if started else None
    last = None if last is None else min(last, NOW)
    running = state is ReqState.RUNNING
    return ReqView(
        f"r{i:03d}", state, arrival, last, NOW - 1.0 if running else None,
        draw(st.sampled_from([0.5, 1.0, 5.0, 30.0])), draw(st.sampled_from([0.05, 0.1, 0.5])),
        0 if running else draw(st.integers(0, 30)), draw(st.integers(1, 30)) if running else 0,
        prefill_tokens=0 if running else draw(st.integers(0, 4000)),
        misses_left=draw(st.integers(-2, 5)), ttft_met=None if last is None else draw(st.booleans()),
        # equal deadlines across requests make equal keys: ties must still go by (arrival, rid)
        weight=draw(st.sampled_from([1.0, 2.0, 0.5])), outputs_left=draw(st.sampled_from([0, 1, 5, 300])),
        outputs_known=draw(st.booleans()),
    )


@st.composite
def _views(draw: st.DrawFn) -> list[ReqView]:
    return [draw(_view(i)) for i in range(draw(st.integers(0, 40)))]


@st.composite
def _crowded(draw: st.DrawFn) -> list[ReqView]:
    """A queue of fresh arrivals that cannot all make their TTFT: what `shed` drops from."""
    def fresh(i: int) -> ReqView:
        return ReqView(f"f{i:03d}", ReqState.WAITING, NOW - draw(st.integers(0, 3_000)) / 1000, None, None,
                       draw(st.sampled_from([1.0, 5.0])), 0.1, draw(st.integers(0, 30)), 0,
                       prefill_tokens=draw(st.integers(0, 3000)), weight=draw(st.sampled_from([1.0, 2.0])),
                       outputs_left=draw(st.sampled_from([0, 5, 300])), outputs_known=draw(st.booleans()))
    return draw(_views()) + [fresh(i) for i in range(draw(st.integers(0, 30)))]


_costs = st.builds(StepCosts, st.sampled_from([0.0, 1e-4, 2e-3]), st.sampled_from([0.0, 0.01]),
                   st.sampled_from([0.0, 0.03]), st.just(0.001), st.sampled_from([0.0, 0.2]))
_policy = st.builds(GoodputLvf, st.builds(GoodputParams, _costs, st.sampled_from([1.0, 20.0, 60.0, float("inf")]),
                                         st.just(False), st.booleans()),
                    st.sampled_from([None, 64, 512]), st.sampled_from([0.0, 1e-3, 0.02]))
_vlt = st.builds(VltParams, st.sampled_from([1.0, 3.0]), st.sampled_from([0.0, 0.5]), st.sampled_from([0.0, 1.0]))


@settings(max_examples=400, deadline=None)
@given(st.one_of(_views(), _crowded()), _policy, _vlt, st.sampled_from([NOW, NOW + 0.5, NOW + 7.5, NOW + 120.0]))
def test_lazy_order_is_the_full_sort(views: list[ReqView], policy: GoodputLvf, vlt: VltParams, now: float) -> None:
    pending = [v for v in views if v.state is not ReqState.RUNNING]
    rows = list(policy.head_rows(PendingIndex(pending), now, vlt))
    assert rows == sorted(lvf._rows(pending, now, vlt, policy))


@settings(max_examples=200, deadline=None)
@given(_crowded(), _policy, _vlt, st.sampled_from([NOW, NOW + 0.5]))
def test_lazy_order_is_the_full_sort_past_the_shedding_window(views: list[ReqView], policy: GoodputLvf,
                                                              vlt: VltParams, now: float) -> None:
    # (`shed` reads SHED_WINDOW requests; the walk must stop where the full sort stops)
    pending = [v for v in views if v.state is not ReqState.RUNNING]
    with mock.patch.object(goodput, "SHED_WINDOW", 3):
        rows = list(policy.head_rows(PendingIndex(pending), now, vlt))
        assert rows == sorted(lvf._rows(pending, now, vlt, policy))


@settings(max_examples=300, deadline=None)
@given(_views(), _vlt, st.sampled_from([NOW, NOW + 0.3, NOW + 7.5, NOW + 120.0]))
def test_the_paper_rules_lazy_order_is_the_full_sort(views: list[ReqView], vlt: VltParams, now: float) -> None:
    pending = [v for v in views if v.state is not ReqState.RUNNING]
    rows = list(PAPER.head_rows(PendingIndex(pending), now, vlt))
    assert rows == sorted(lvf._rows(pending, now, vlt, PAPER))


_edits = st.lists(st.tuples(st.booleans(), st.integers(0, 39)), max_size=30)


@settings(max_examples=200, deadline=None)
@given(_views(), _views(), _edits, st.one_of(_policy, st.just(PAPER)), _vlt, st.integers(0, 60), st.integers(0, 40))
def test_an_index_kept_between_steps_decides_as_a_fresh_one(first: list[ReqView], second: list[ReqView],
                                                             edits: list[tuple[bool, int]], policy: object,
                                                             vlt: VltParams, free: int, budget: int) -> None:
    """Views put, replaced (the same rid, changed) and dropped one by one, with the book built
    before the changes: the same order and decision as an index of the final views."""
    kept = PendingIndex(v for v in first if v.state is not ReqState.RUNNING)
    list(policy.head_rows(kept, NOW, vlt))  # its book filled now: every later change must re-file
    final = {v.rid: v for v in first if v.state is not ReqState.RUNNING}
    running_rids = {v.rid for v in first if v.state is ReqState.RUNNING}
    replacements = {v.rid: v for v in second if v.state is not ReqState.RUNNING and v.rid not in running_rids}
    for put, i in edits:
        rid = f"r{i:03d}"
        if put and rid in replacements:
            kept.put(replacements[rid])
            final[rid] = replacements[rid]
        elif not put:
            kept.drop(rid)
            final.pop(rid, None)
    fresh = PendingIndex(final.values())
    assert kept.blocks_needed == fresh.blocks_needed == sum(v.blocks_needed for v in final.values())
    assert list(policy.head_rows(kept, NOW, vlt)) == list(policy.head_rows(fresh, NOW, vlt))
    running = [v for v in first if v.state is ReqState.RUNNING]
    assert (lvf.lvf_decide(StepQueue(running, kept), free, budget, NOW, vlt, policy)
            == lvf.lvf_decide([*running, *final.values()], free, budget, NOW, vlt, policy))


def _tie() -> tuple[ReqView, ReqView]:
    """Two waiting requests of one class whose deadlines differ by a rounding step but whose keys
    are equal at now = 0, the later deadline's request arrived first: the full sort puts it first
    (ties go by arrival), the deadline order would not."""
    import math

    w, t1 = 7.0, 1.0
    for i in range(10_000):
        a1 = 28.0 + i / 997
        d1 = a1 + t1
        a2 = a1 - 1.0
        t2 = 2.0
        for _ in range(8):
            d2 = a2 + t2
            if d1 < d2 and (d1 - 0.0) / w == (d2 - 0.0) / w:
                mk = lambda rid, a, t: ReqView(rid, ReqState.WAITING, a, None, None, t, 0.1, 1, 0, weight=w,  # noqa: E731
                                               outputs_left=3)
                return mk("late", a1, t1), mk("early", a2, t2)
            t2 = math.nextafter(t2, math.inf)
    raise AssertionError("no rounding tie found")


_rows = st.lists(st.tuples(st.integers(0, 2), st.sampled_from([0.0, 0.5, 1.0, 2.5]), st.floats(0, 10),
                           st.text("ab", max_size=2)), max_size=25)


@given(_rows)
def test_sorted_runs_is_the_full_sort_of_rows_in_key_order(rows: list[tuple[int, float, float, str]]) -> None:
    """Rows whose (tier, key) never decreases come out in full row order, every tie by arrival,
    then rid (runs of one and of many alike)."""
    rows.sort(key=lambda r: (r[0], r[1]))  # (tier, key) non-decreasing; ties in any order
    assert list(sorted_runs(iter(rows))) == sorted(rows)


def test_equal_keys_of_different_deadlines_go_by_arrival() -> None:
    late, early = _tie()
    policy = GoodputLvf(GoodputParams(StepCosts(0.0, 0.0, 0.0, 0.0)))
    rows = list(policy.head_rows(PendingIndex([late, early]), 0.0, VltParams()))
    assert [r[3] for r in rows] == [r[3] for r in sorted(lvf._rows([late, early], 0.0, VltParams(), policy))]
    assert [r[3] for r in rows] == ["early", "late"]


def test_shedding_walks_equal_keys_by_arrival_too() -> None:
    """`shed` reads the window in `rank`'s order even where the deadline list's order differs (two
    deadlines, one key): of two equal requests that cannot both make it, the one ranked second
    goes best-effort."""
    late, early = (dataclasses.replace(v, prefill_tokens=20_000) for v in _tie())
    policy = GoodputLvf(GoodputParams(StepCosts(1e-3, 0.0, 0.0, 0.0)))
    rows = list(policy.head_rows(PendingIndex([late, early]), 0.0, VltParams()))
    assert [(r[3], r[0]) for r in rows] == [("early", goodput.VIABLE), ("late", goodput.BEST_EFFORT)]
    assert rows == sorted(lvf._rows([late, early], 0.0, VltParams(), policy))


def test_a_deadline_exactly_now_is_still_viable() -> None:
    """At zero costs a request whose TTFT deadline is now can still make it (`ttft_reachable`):
    the bisection must not skip it."""
    v = ReqView("w", ReqState.WAITING, NOW - 1.0, None, None, 1.0, 0.1, 1, 0)
    policy = GoodputLvf(GoodputParams(StepCosts(0.0, 0.0, 0.0, 0.0)))
    rows = list(policy.head_rows(PendingIndex([v]), NOW, VltParams()))
    assert [r[0] for r in rows] == [1]  # VIABLE


def _running(rid: str, held: int, rotatable: bool) -> ReqView:
    # lost (TTFT missed), stint long over: the goodput policy may rotate it out
    return ReqView(rid, ReqState.RUNNING, NOW - 60.0, NOW - 1.0, NOW - 50.0, 1.0, 0.1, 0, held, rotatable,
                   misses_left=3, ttft_met=False)


def test_the_wall_and_the_victims_read_fresh_running_views() -> None:
    """A queue's running views may hold older blocks and rotatability (StepQueue.refresh): LVF's
    wall (could the urgent request ever fit?) and its victims must read the fresh ones."""
    urgent = ReqView("w", ReqState.WAITING, NOW - 0.8, None, None, 1.0, 0.1, 5, 0, prefill_tokens=4)
    policy = GoodputLvf(GoodputParams(StepCosts(0.0, 0.0, 0.0, 0.0)))
    stale = [_running("r", 1, False)]
    fresh = [_running("r", 10, True)]

    def refresh(views: list[ReqView]) -> list[ReqView]:
        return [f for f in fresh if f.rid in {v.rid for v in views}]

    d = lvf.lvf_decide(StepQueue(stale, PendingIndex([urgent]), refresh), 0, 100, NOW, VltParams(), policy)
    assert d == lvf.lvf_decide([*fresh, urgent], 0, 100, NOW, VltParams(), policy)
    assert d.rotate_out == ("r",) and d.admit == ("w",)
    # without a rotation budget the urgent request waits for the memory "r" holds (the wall)
    d = lvf.lvf_decide(StepQueue(stale, PendingIndex([urgent]), refresh), 0, 0, NOW, VltParams(), policy)
    assert d.blocked == "w"
