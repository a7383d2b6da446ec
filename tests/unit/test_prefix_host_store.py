"""The host tier's bookkeeping (rotasched/prefix_host_store.HostPrefixStore, pure): which evicted nodes are
demoted, the host budget and its eviction by predicted reuse, entries chained under demoted parents,
and that every handle comes back exactly once (no leaked host blocks)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer_sgl.rotasched.prefix_host_store import DEMOTE_MIN_SCORE, HostPrefixStore
from superinfer_sgl.rotasched.prefix_reuse import NodeStats, ReusePredictor


class Handles:
    """Issues handles and counts their releases."""

    def __init__(self) -> None:
        self.released: Counter[int] = Counter()
        self.next = 0

    def new(self) -> int:
        self.next += 1
        return self.next

    def release(self, handle: int) -> None:
        self.released[handle] += 1


def _store(budget: int = 100, unit: int = 1, min_score: float = 0.3, cold: bool = False) -> tuple[HostPrefixStore, Handles]:
    """A store over a predictor past its cold start (it has seen a gap between hits), unless cold."""
    h = Handles()
    predictor = ReusePredictor()
    if not cold:
        predictor.global_gap = 1.0
    return HostPrefixStore(predictor, budget, h.release, min_score=min_score, unit=unit), h


def _hot(hits: int, now: float) -> NodeStats:
    """A history the predictor scores high at `now` (hit often and recently)."""
    return NodeStats(created=0.0, end_depth=50, length=50, hits=hits, last_hit=now, gap=1.0,
                     slo_weight=1.0)


def _cold() -> NodeStats:
    return NodeStats(created=0.0, end_depth=10, length=10, hits=0, last_hit=None)


def _demote(s: HostPrefixStore, h: Handles, key: tuple, node: int, tokens: int, score: float, now: float = 10.0,
            stats: NodeStats | None = None) -> int | None:
    entry = s.admit(key, node, tokens, score, now, stats)
    if entry is None:
        return None
    entry.handle = h.new()
    return entry.handle


def test_only_nodes_predicted_to_return_are_demoted() -> None:
    s, h = _store(min_score=0.3)
    assert _demote(s, h, (1, "a"), 10, 20, score=0.29) is None  # dropped: predicted not to come back
    assert _demote(s, h, (1, "b"), 11, 20, score=0.31) is not None
    assert s.rejected_score == 1 and s.demoted == 1 and s.used == 20
    assert s.lookup((1, "b")).node == 11 and s.lookup((1, "a")) is None
    assert 0.0 <= DEMOTE_MIN_SCORE <= 1.0
    s.check()


def test_costs_are_whole_blocks_and_an_entry_larger_than_the_budget_is_refused() -> None:
    s, h = _store(budget=100, unit=16)
    assert s.budget == 96 and s.cost_of(17) == 32 and s.cost_of(16) == 16
    assert _demote(s, h, (1, "big"), 10, 97, score=0.9) is None and s.rejected_room == 1
    assert _demote(s, h, (1, "ok"), 11, 17, score=0.9) is not None and s.used == 32
    s.check()


def test_host_budget_evicts_lower_predicted_reuse_first_and_never_a_better_entry() -> None:
    s, h = _store(budget=60)
    now = 100.0
    cold = _demote(s, h, (1, "cold"), 10, 30, 0.4, now, _cold())
    hot = _demote(s, h, (1, "hot"), 11, 30, 0.9, now, _hot(20, now))
    assert s.used == 60
    # a newcomer better than the cold entry takes its place; the hot one stays
    new = _demote(s, h, (1, "new"), 12, 30, 0.8, now, _hot(5, now))
    assert new is not None and h.released[cold] == 1 and h.released[hot] == 0
    assert s.lookup((1, "cold")) is None and s.host_evicted == 1
    # a newcomer predicted worse than everything held is not admitted, and nothing is evicted
    assert _demote(s, h, (1, "meh"), 13, 30, 0.31, now, _cold()) is None
    assert s.rejected_room == 1 and s.lookup((1, "hot")) is not None and s.lookup((1, "new")) is not None
    s.check()


def test_an_entry_under_a_demoted_parent_follows_it_back_or_goes_with_it() -> None:
    s, h = _store(budget=1000)
    child = _demote(s, h, (7, "c"), 8, 10, 0.9)  # node 8 hung under node 7 ...
    parent = _demote(s, h, (1, "p"), 7, 10, 0.9)  # ... then node 7 (under the root, id 1) was demoted
    s.node_left(7)  # node 7 left the tree, demoted: the child entry must stay
    assert s.lookup((7, "c")) is not None
    taken = s.take((1, "p"))
    assert taken is not None and taken.handle == parent and h.released[parent] == 0  # the caller's now
    s.rekey(7, 42)  # restored as node 42: the child now hangs under it
    assert s.lookup((7, "c")) is None and s.lookup((42, "c")).handle == child
    s.check()
    s.node_left(42)  # node 42 dropped (not demoted): the child entry cannot be reached any more
    assert h.released[child] == 1 and len(s) == 0
    s.check()


def test_evicting_a_parent_entry_takes_its_demoted_descendants() -> None:
    s, h = _store(budget=30)
    now = 5.0
    grandchild = _demote(s, h, (8, "g"), 9, 10, 0.5, now, _cold())
    child = _demote(s, h, (7, "c"), 8, 10, 0.5, now, _cold())
    parent = _demote(s, h, (1, "p"), 7, 10, 0.5, now, _cold())
    assert s.used == 30
    newcomer = _demote(s, h, (2, "n"), 20, 30, 0.95, now, _hot(30, now))
    assert newcomer is not None
    assert all(h.released[x] == 1 for x in (grandchild, child, parent)) and s.used == 30
    s.check()


def test_a_failed_restore_puts_the_entry_back_and_its_room_stays_charged_meanwhile() -> None:
    """A taken entry's host blocks stay allocated until the caller frees them: a demotion during
    the restore (the restore's own eviction) must not be admitted into that room, or its copy
    finds the pool full and the leaf is lost (review of 2026-12-03)."""
    s, h = _store(budget=20)
    now = 1.0
    a = _demote(s, h, (1, "a"), 10, 20, 0.9, now, _hot(10, now))
    entry = s.take((1, "a"))
    assert s.used == 0 and s.taken == 20
    assert _demote(s, h, (1, "b"), 11, 20, 0.95, now, _hot(50, now)) is None and s.rejected_room == 1
    assert s.reinsert(entry, now) and s.lookup((1, "a")).handle == a and h.released[a] == 0 and s.taken == 0
    s.check()
    entry = s.take((1, "a"))
    h.release(entry.handle)  # restored: the caller frees the handle and hands the entry back
    s.handed_back(entry)
    s.restored_entry(entry, 20)
    assert s.taken == 0 and _demote(s, h, (1, "b"), 11, 20, 0.95, now, _hot(50, now)) is not None
    s.check()


def test_discarding_an_entry_counts_its_chained_descendants_as_dropped() -> None:
    s, h = _store(budget=100)
    parent_entry = s.admit((1, "p"), 7, 10, 0.9, 1.0, _hot(5, 1.0))
    _demote(s, h, (7, "c"), 8, 10, 0.9, 1.0, _hot(5, 1.0))  # a child demoted before its parent, keyed under it
    assert parent_entry is not None
    s.discard(parent_entry)  # the parent's copy failed
    assert len(s) == 0 and s.dropped == 1 and s.demoted == 1
    s.check()


def test_the_same_place_demoted_again_replaces_the_old_entry() -> None:
    s, h = _store(budget=100)
    old = _demote(s, h, (1, "a"), 10, 20, 0.9)
    new = _demote(s, h, (1, "a"), 11, 30, 0.9)
    assert h.released[old] == 1 and s.lookup((1, "a")).handle == new and s.used == 30
    s.check()


def test_clear_and_discard_release_everything() -> None:
    s, h = _store(budget=100)
    handles = [_demote(s, h, (1, str(i)), 10 + i, 10, 0.9) for i in range(5)]
    pending = s.admit((1, "x"), 30, 10, 0.9, 1.0)  # admitted, its copy failed
    s.discard(pending)
    assert s.lookup((1, "x")) is None and s.used == 50
    s.clear()
    assert len(s) == 0 and s.used == 0 and all(h.released[x] == 1 for x in handles)
    s.check()


# ---- property: random operations never leak a handle, double-release one or overrun the budget -----
_OPS = st.lists(st.tuples(st.sampled_from(["demote", "take_restore", "take_fail", "left", "clear"]),
                          st.integers(0, 11), st.integers(1, 40), st.floats(0.0, 1.0)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(_OPS, st.integers(0, 120), st.sampled_from([1, 4, 16]), st.booleans())
def test_random_operations_keep_every_handle_accounted_for(ops: list, budget: int, unit: int, cold: bool) -> None:
    s, h = _store(budget=budget, unit=unit, min_score=0.2, cold=cold)
    owned: set[int] = set()  # handles taken by the "caller" and freed by it
    next_node = 100
    live_parents = list(range(12))
    for op, a, tokens, score in ops:
        now = float(len(h.released) + next_node)
        if op == "demote":
            next_node += 1
            parent = live_parents[a % len(live_parents)]
            if a % 2 and s.entries:  # under a demoted node (a chain)
                parent = sorted(e.node for e in s.entries.values())[a % len(s.entries)]
            stats = _hot(int(score * 20), now) if score > 0.5 else _cold()
            _demote(s, h, (parent, a % 3), next_node, tokens, score, now, stats)
        elif op in ("take_restore", "take_fail") and s.entries:
            key = sorted(s.entries, key=str)[a % len(s.entries)]
            entry = s.take(key)
            if op == "take_fail":
                s.reinsert(entry, now)
            else:
                next_node += 1
                if tokens % 2:
                    s.rekey(entry.node, next_node)
                    live_parents.append(next_node)
                else:
                    s.drop_under(entry.node)
                owned.add(entry.handle)  # the caller frees it after copying back
        elif op == "left":
            s.node_left(live_parents[a % len(live_parents)])
        elif op == "clear":
            s.clear()
        s.check()
        assert all(n == 1 for n in h.released.values()), "a handle released twice"
    held = {e.handle for e in s.entries.values()}
    released = set(h.released)
    assert held.isdisjoint(released) and owned.isdisjoint(released) and held.isdisjoint(owned)
    assert held | released | owned == set(range(1, h.next + 1)), "a handle leaked"
    s.clear()
    assert s.used == 0 and set(h.released) | owned == set(range(1, h.next + 1))


@pytest.mark.parametrize("score", [0.0, 0.25, 1.0])
def test_min_score_bounds(score: float) -> None:
    s, h = _store(min_score=score)
    assert (_demote(s, h, (1, "a"), 10, 5, score) is not None)


def test_before_any_gap_was_seen_a_hit_node_is_demoted_whatever_its_score() -> None:
    s, h = _store(budget=400, min_score=0.5, cold=True)
    hit_once = NodeStats(created=0.0, end_depth=160, length=160, hits=1, last_hit=0.0)
    assert s.predictor.global_gap is None  # a quiet server: the horizon is a floor value
    assert _demote(s, h, (1, "sys"), 10, 160, 0.01, 30.0, hit_once) is not None
    assert _demote(s, h, (1, "once"), 11, 20, 0.01, 30.0, _cold()) is None  # never hit: dropped
    s.predictor.global_gap = 5.0  # the predictor has a pace now: its scores apply
    assert _demote(s, h, (1, "sys2"), 12, 160, 0.01, 30.0, hit_once) is None
    s.check()


def test_during_the_cold_start_host_entries_rank_by_hits() -> None:
    s, h = _store(budget=320, min_score=0.5, cold=True)

    def hit(n: int) -> NodeStats:
        return NodeStats(created=0.0, end_depth=160, length=160, hits=n, last_hit=0.0)

    once = _demote(s, h, (1, "a"), 10, 160, 0.9, 1.0, hit(1))
    thrice = _demote(s, h, (1, "b"), 11, 160, 0.0, 2.0, hit(3))  # its P is ignored while cold
    assert once is not None and thrice is not None and s.used == 320
    twice = _demote(s, h, (1, "c"), 12, 160, 0.0, 3.0, hit(2))
    assert twice is not None and h.released[once] == 1 and h.released[thrice] == 0
    assert _demote(s, h, (1, "d"), 13, 160, 0.99, 4.0, hit(1)) is None  # fewer hits than any held
    s.check()
