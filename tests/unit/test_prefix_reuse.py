"""The reuse predictor and eviction ranker of --prefix-cache predictive (rotasched/prefix_reuse.py)."""

from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st

from superinfer_sgl.rotasched.prefix_reuse import (MAX_LOGIT_STEP, EvictionRanker, Leaf, PredictorParams,
                                                   ReusePredictor, FEATURES, PRIOR_WEIGHTS)


def test_prior_prefers_shared_recent_prefixes_over_unique_tails() -> None:
    p = ReusePredictor(PredictorParams(learn=False))
    for i in range(6):
        p.hit("system", float(i))
    p.stats("tail", 5.0)  # inserted once, never matched
    assert p.score("system", 6.0) > p.score("tail", 6.0)


def test_a_node_first_seen_at_a_hit_teaches_nothing_by_it() -> None:
    """Its sample is made at that hit: resolving it at once labelled every first reuse a positive,
    whenever the prefix had been inserted (2026-12-03 review: 50 of 50, reuses 1,000 s apart)."""
    p = ReusePredictor()
    for k in range(50):
        p.hit(k, 1000.0)
    assert p.updates == 0 and p.weights == list(PRIOR_WEIGHTS)
    p.hit(0, 1000.2)  # a second hit within the horizon: a real positive
    assert (p.updates, p.positives) == (1, 1)


def test_overdue_prefix_scores_lower() -> None:
    p = ReusePredictor(PredictorParams(learn=False))
    for i in range(5):
        p.hit("n", float(i))  # a one-second rhythm
    assert p.score("n", 4.5) > p.score("n", 12.0)


def test_learning_raises_the_score_of_prefixes_that_keep_coming_back() -> None:
    p = ReusePredictor(PredictorParams(learning_rate=0.2))
    before = p.score("fresh", 0.0)
    t = 0.0
    for k in range(200):  # many nodes, each hit again soon after its first hit
        p.hit(("n", k), t)
        p.hit(("n", k), t + 0.1)
        t += 0.2
    assert p.updates > 0 and p.positives > 0
    p2 = ReusePredictor()
    p2.weights = p.weights
    p2.hit("x", 0.0)
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
    p.hit("c", 1.0)
    p.split("head", "c", 2.0, split_len=20)
    head, child = p.nodes["head"], p.nodes["c"]
    assert head.hits == 1 and head.length == 20 and head.end_depth == 60
    assert child.length == 40 and child.end_depth == 100


def test_a_returning_prefix_inherits_its_ghost_and_teaches_a_hit() -> None:
    p = ReusePredictor(PredictorParams(max_horizon_s=100.0, min_horizon_s=50.0))
    for i in range(3):
        p.hit(1, float(i))
    p.forget(1, 3.0, ghost_key=("root", 7))
    assert 1 not in p.nodes and ("root", 7) in p.ghosts
    learned = p.updates
    p.hit(2, 4.0, ghost_key=("root", 7))  # the same prefix, a new node
    assert p.nodes[2].hits == 4 and p.updates == learned + 1  # the ghost's sample (the new one is made now)
    assert p.positives >= 1


def test_a_ghost_goes_to_its_own_prefix_only() -> None:
    p = ReusePredictor()
    for i in range(4):
        p.hit(1, float(i))
    p.forget(1, 4.0, ghost_key=("root", 5), tokens=(5, 100, 101, 102))
    p.hit(2, 5.0, ghost_key=("root", 5), tokens=(5, 900, 901))  # shares the first token only
    assert p.nodes[2].hits == 1 and ("root", 5) in p.ghosts
    p.hit(3, 6.0, ghost_key=("root", 5), tokens=(5, 100))  # the same prefix, a shorter node
    assert p.nodes[3].hits == 5 and not p.ghosts


def test_one_step_moves_the_score_a_bounded_amount() -> None:
    """A prefix with thousands of hits has a large feature vector; an uncapped step moved its
    logit by ~10 and the score flipped with every label. Now at most MAX_LOGIT_STEP."""
    p = ReusePredictor(PredictorParams(learning_rate=0.05, l2=0.0))
    st = p.stats("hot", 0.0)
    st.hits, st.last_hit, st.gap = 20000, 0.0, 1.0
    x = p.features(st, 0.5)
    logit = sum(w * v for w, v in zip(p.weights, x))
    for label in (0.0, 1.0, 0.0, 1.0):
        p._learn(x, label)
        new = sum(w * v for w, v in zip(p.weights, x))
        assert abs(new - logit) <= MAX_LOGIT_STEP + 1e-9
        logit = new


def test_ghosts_are_bounded() -> None:
    p = ReusePredictor(PredictorParams(max_ghosts=3))
    for k in range(10):
        p.stats(k, 0.0)
        p.forget(k, 1.0, ghost_key=("g", k))
    assert len(p.ghosts) == 3


def test_ranker_pins_the_best_within_the_budget_and_evicts_unpinned_first() -> None:
    p = ReusePredictor(PredictorParams(learn=False))
    for i in range(8):
        p.hit("hot", float(i) * 0.1)
    p.stats("cold", 0.0)
    p.stats("big", 0.0)
    for i in range(8):
        p.hit("big", float(i) * 0.1)
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
        p.hit(node, t, slo_class=("interactive", "batch", None)[req % 3])
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
        p.hit("n", t)
    assert params.min_horizon_s <= p.horizon_s <= params.max_horizon_s
