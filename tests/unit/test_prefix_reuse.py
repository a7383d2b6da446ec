"""The reuse predictor and eviction ranker of --prefix-cache predictive (rotasched/prefix_reuse.py)."""

from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st

from superinfer_sgl.rotasched.prefix_reuse import (EvictionRanker, Leaf, PredictorParams, ReusePredictor,
                                                   FEATURES, PRIOR_WEIGHTS)


def test_prior_prefers_shared_recent_prefixes_over_unique_tails() -> None:
    p = ReusePredictor(PredictorParams(learn=False))
    for i in range(6):
        p.hit("system", float(i), requester=f"r{i}")
    p.stats("tail", 5.0)  # inserted once, never matched
    assert p.score("system", 6.0) > p.score("tail", 6.0)


def test_repeated_matches_by_one_request_count_once() -> None:
    p = ReusePredictor()
    assert p.hit("n", 0.0, "r1")
    assert not p.hit("n", 0.1, "r1")
    assert p.hit("n", 0.2, "r2")
    assert p.nodes["n"].hits == 2 and p.nodes["n"].distinct == 2


def test_overdue_prefix_scores_lower() -> None:
    p = ReusePredictor(PredictorParams(learn=False))
    for i in range(5):
        p.hit("n", float(i), f"r{i}")  # a one-second rhythm
    assert p.score("n", 4.5) > p.score("n", 12.0)


def test_learning_raises_the_score_of_prefixes_that_keep_coming_back() -> None:
    p = ReusePredictor(PredictorParams(learning_rate=0.2))
    before = p.score("fresh", 0.0)
    t = 0.0
    for k in range(200):  # many nodes, each hit again soon after its first hit
        p.hit(("n", k), t, "a")
        p.hit(("n", k), t + 0.1, "b")
        t += 0.2
    assert p.updates > 0 and p.positives > 0
    p2 = ReusePredictor()
    p2.weights = p.weights
    p2.hit("x", 0.0, "a")
    assert p2.score("x", 0.05) > before


def test_misses_are_learned_when_a_sample_expires() -> None:
    p = ReusePredictor(PredictorParams(learning_rate=0.2, max_horizon_s=1.0))
    for k in range(100):
        p.stats(("tail", k), 0.0)
    for k in range(100):
        p.score(("tail", k), 10.0)  # every sample older than the horizon: a miss
    assert p.updates == 100 and p.positives == 0
    assert p.weights[0] < PRIOR_WEIGHTS[0]


def test_split_gives_the_prefix_the_childs_history() -> None:
    p = ReusePredictor()
    p.shape("c", 0.0, end_depth=100, length=60)
    p.hit("c", 1.0, "r1")
    p.split("head", "c", 2.0, split_len=20)
    head, child = p.nodes["head"], p.nodes["c"]
    assert head.hits == 1 and head.length == 20 and head.end_depth == 60
    assert child.length == 40 and child.end_depth == 100


def test_a_returning_prefix_inherits_its_ghost_and_teaches_a_hit() -> None:
    p = ReusePredictor(PredictorParams(max_horizon_s=100.0, min_horizon_s=50.0))
    for i in range(3):
        p.hit(1, float(i), f"r{i}")
    p.forget(1, 3.0, ghost_key=("root", 7))
    assert 1 not in p.nodes and ("root", 7) in p.ghosts
    learned = p.updates
    p.hit(2, 4.0, "r9", ghost_key=("root", 7))  # the same prefix, a new node
    assert p.nodes[2].hits == 4 and p.updates == learned + 2  # the ghost's sample, then the hit's
    assert p.positives >= 1


def test_ghosts_are_bounded() -> None:
    p = ReusePredictor(PredictorParams(max_ghosts=3))
    for k in range(10):
        p.stats(k, 0.0)
        p.forget(k, 1.0, ghost_key=("g", k))
    assert len(p.ghosts) == 3


def test_ranker_pins_the_best_within_the_budget_and_evicts_unpinned_first() -> None:
    p = ReusePredictor(PredictorParams(learn=False))
    for i in range(8):
        p.hit("hot", float(i) * 0.1, f"r{i}")
    p.stats("cold", 0.0)
    p.stats("big", 0.0)
    for i in range(8):
        p.hit("big", float(i) * 0.1, f"q{i}")
    ranker = EvictionRanker(p, pool_tokens=1000, pin_share=0.25)
    ranker.begin_round([Leaf("hot", 200, 50), Leaf("cold", 100, 100), Leaf("big", 600, 300)], now=1.0)
    assert ranker.pinned == {"hot"} and ranker.pinned_tokens == 200 <= ranker.pin_budget
    keys = {n: ranker.priority(n, last_access=0.0) for n in ("hot", "cold", "big")}
    assert min(keys, key=keys.get) == "cold"
    assert max(keys, key=keys.get) == "hot"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 9), st.integers(0, 5), st.floats(0, 5)), max_size=60),
       st.floats(0.0, 1.0))
def test_scores_are_probabilities_and_weights_stay_finite(events, share) -> None:
    p = ReusePredictor()
    t = 0.0
    for node, req, dt in events:
        t += dt
        p.hit(node, t, req, slo_class=("interactive", "batch", None)[req % 3])
        if req == 5:
            p.forget(node, t, ghost_key=("g", node))
    for node in list(p.nodes):
        s = p.score(node, t + 1.0)
        assert 0.0 <= s <= 1.0
    assert len(p.weights) == len(FEATURES) and all(math.isfinite(w) for w in p.weights)
    ranker = EvictionRanker(p, pool_tokens=500, pin_share=share)
    ranker.begin_round([Leaf(n, 10 * (i + 1), 10) for i, n in enumerate(p.nodes)], now=t + 1.0)
    assert ranker.pinned_tokens <= ranker.pin_budget
    assert ranker.pinned <= set(p.nodes)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0.01, 50.0), min_size=1, max_size=30))
def test_horizon_stays_within_its_clamp(gaps) -> None:
    params = PredictorParams()
    p = ReusePredictor(params)
    t = 0.0
    for i, g in enumerate(gaps):
        t += g
        p.hit("n", t, f"r{i}")
    assert params.min_horizon_s <= p.horizon_s <= params.max_horizon_s
