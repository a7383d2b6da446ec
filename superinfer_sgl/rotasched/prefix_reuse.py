"""Reuse prediction for radix-tree prefix nodes (`--prefix-cache predictive`): pure Python.

Each node of the prefix tree gets a `NodeStats` record of its own hit history: hits (by distinct
requests: the caller counts a request once per node), the time of its last hit, an exponentially
weighted inter-hit gap, the SLO class of its most urgent user, and its depth and length in tokens.
`ReusePredictor.score` turns that history into P(the node is hit again within the horizon) with a
small logistic model over six explainable features (`FEATURES`), and the model learns online from
the server's own hits:

- every node carries one pending sample (its features at a time t0), from the first time the
  predictor sees it (a hit or an eviction round: the insert itself is not seen, so the first hit of
  a node seen first at that hit teaches nothing);
- a later hit within the horizon resolves it as 1, a hit later or none by t0 + horizon as 0 (the
  latter is found when the node is scored again), and a new sample starts;
- an evicted node leaves a ghost (its history, under a key the caller gives: its parent and first
  token, with its first tokens to tell prefixes that only share those apart); when the same prefix
  comes back, the new node inherits the history, and the ghost's sample resolves as 1 if the
  comeback fell within the horizon. So a prefix that keeps coming back learns that it does, which
  LRU and LFU forget at every eviction.

A step of the learner moves a sample's logit by at most `MAX_LOGIT_STEP`, so a prefix with
thousands of hits (large features) does not flip its own score with every label.

The horizon follows the traffic: twice the EWMA of all observed inter-hit gaps, clamped.
Everything is O(1) per hit and per score (a few dozen float operations); the caller (the eviction
strategy in integration/prefix_cache.py) scores only the tree's evictable leaves, when SGLang
evicts. `EvictionRanker` adds the bounded pin set: the highest-scoring leaves, as long as their
prefixes fit a share of the device pool, are evicted only after every unpinned leaf.

The host tier's bookkeeping (which evicted nodes are demoted to host instead of dropped) is
rotasched/prefix_host_store.py, on top of this predictor.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

FEATURES = ("bias", "log_hits", "age_over_gap", "depth", "length", "slo_weight")
# The prior: a node hit often (by many requests), not overdue against its own rhythm, is reused.
# (log_hits carries what a separate distinct-requester feature with weight 0.8 did: the two counts
# were always equal.)
PRIOR_WEIGHTS = (-1.0, 2.0, -1.2, 0.2, 0.0, 0.5)
# An SLO class's weight (interactive prefixes are the costliest to miss); unknown names: standard.
SLO_WEIGHTS = {"interactive": 1.0, "standard": 0.5, "batch": 0.0}
MAX_LOGIT_STEP = 1.0  # the most one labelled sample moves a node's logit (`ReusePredictor._learn`)
GHOST_TOKENS = 64  # leading tokens a ghost keeps to tell a returning prefix from a namesake


@dataclass(frozen=True)
class PredictorParams:
    learning_rate: float = 0.1  # chosen on the replay's training seeds 0-2 (docs/prefix_cache.md)
    l2: float = 1e-4
    gap_ewma: float = 0.3  # weight of the newest gap in a node's and the global gap EWMA
    horizon_factor: float = 2.0
    min_horizon_s: float = 0.5
    max_horizon_s: float = 600.0
    max_ghosts: int = 4096
    learn: bool = True

    def __post_init__(self) -> None:
        assert self.learning_rate >= 0 and self.l2 >= 0 and 0 < self.gap_ewma <= 1, self
        assert 0 < self.min_horizon_s <= self.max_horizon_s and self.horizon_factor > 0, self
        assert self.max_ghosts >= 0, self


@dataclass(slots=True)
class NodeStats:
    """One node's hit history. Times are the caller's clock in seconds."""

    created: float
    end_depth: int = 0  # tokens from the root through this node's end
    length: int = 0  # tokens in this node
    hits: int = 0  # by distinct requests
    last_hit: float | None = None
    gap: float | None = None  # EWMA of the gaps between hits
    slo_weight: float = SLO_WEIGHTS["standard"]
    sample: tuple[float, tuple[float, ...]] | None = None  # (t0, features at t0): pending label


def _sigmoid(z: float) -> float:
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


class ReusePredictor:
    """Per-node hit histories and the online logistic model over them."""

    def __init__(self, params: PredictorParams | None = None) -> None:
        self.params = params or PredictorParams()
        self.weights = list(PRIOR_WEIGHTS)
        self.nodes: dict[Hashable, NodeStats] = {}
        # ghost key -> (evicted at, the record, its leading tokens or None)
        self.ghosts: OrderedDict[Hashable, tuple[float, NodeStats, tuple[int, ...] | None]] = OrderedDict()
        self.global_gap: float | None = None
        self.updates = 0  # labelled samples learned from
        self.positives = 0

    # ---- the horizon and features ---------------------------------------------------------

    @property
    def horizon_s(self) -> float:
        p = self.params
        gap = self.global_gap if self.global_gap is not None else p.min_horizon_s
        return min(max(p.horizon_factor * gap, p.min_horizon_s), p.max_horizon_s)

    def features(self, st: NodeStats, now: float) -> tuple[float, ...]:
        since = now - (st.last_hit if st.last_hit is not None else st.created)
        # Overdue against its own rhythm (no rhythm yet: against the horizon); a rhythm faster
        # than the shortest horizon counts as that, so a burst's microsecond gaps do not make a
        # prefix overdue a moment later.
        rhythm = max(st.gap, self.params.min_horizon_s) if st.gap is not None else self.horizon_s
        overdue = min(max(since, 0.0) / max(rhythm, 1e-6), 8.0)
        return (1.0, math.log1p(st.hits), overdue,
                math.log1p(st.end_depth) / 8.0, math.log1p(st.length) / 8.0, st.slo_weight)

    def _prob(self, x: tuple[float, ...]) -> float:
        return _sigmoid(sum(w * v for w, v in zip(self.weights, x)))

    def _learn(self, x: tuple[float, ...], label: float) -> None:
        if not self.params.learn:
            return
        err = label - self._prob(x)
        # the step is capped where the features are large (a prefix with thousands of hits): the
        # logit moves by at most MAX_LOGIT_STEP per sample, so one label cannot flip the score
        lr, l2 = min(self.params.learning_rate, MAX_LOGIT_STEP / max(sum(v * v for v in x), 1e-9)), self.params.l2
        self.weights = [w + lr * (err * v - l2 * w) for w, v in zip(self.weights, x)]
        self.updates += 1
        self.positives += int(label > 0.5)

    # ---- node lifecycle ---------------------------------------------------------------------

    def stats(self, node: Hashable, now: float, ghost_key: Hashable | None = None,
              tokens: tuple[int, ...] | None = None) -> NodeStats:
        """The node's record, created on first sight (inheriting a ghost's history if any)."""
        return self._record(node, now, ghost_key, tokens)[0]

    def _record(self, node: Hashable, now: float, ghost_key: Hashable | None,
                tokens: tuple[int, ...] | None) -> tuple[NodeStats, bool]:
        """(the node's record, whether it was made now). A ghost under `ghost_key` is inherited
        unless its leading tokens and `tokens` differ where both have them (two prefixes that share
        only a first token or page are not the same prefix: that ghost stays for its own)."""
        st = self.nodes.get(node)
        if st is not None:
            return st, False
        ghost = self.ghosts.get(ghost_key) if ghost_key is not None else None
        if ghost is not None and ghost[2] is not None and tokens is not None \
                and ghost[2][:len(tokens)] != tokens[:len(ghost[2])]:
            ghost = None
        if ghost is None:
            st = NodeStats(created=now)
        else:
            del self.ghosts[ghost_key]
            st = ghost[1]
            if st.sample is not None:  # it came back: the eviction was a mistake if within the horizon
                t0, x = st.sample
                self._learn(x, 1.0 if now - t0 <= self.horizon_s else 0.0)
        self.nodes[node] = st
        st.sample = (now, self.features(st, now))
        return st, True

    def shape(self, node: Hashable, now: float, end_depth: int, length: int, ghost_key: Hashable | None = None,
              tokens: tuple[int, ...] | None = None) -> None:
        """The node's place in the tree (an eviction round sees it; with `ghost_key` a node first
        seen here still inherits its prefix's ghost, as at a hit)."""
        st = self.stats(node, now, ghost_key, tokens)
        st.end_depth, st.length = int(end_depth), int(length)

    def drop_tree(self) -> None:
        """The tree was reset (a cache flush): every node's record and ghost goes, unlabelled (the
        flush removed them, not the traffic); the learned weights and the traffic's rhythm stay."""
        self.nodes.clear()
        self.ghosts.clear()

    def hit(self, node: Hashable, now: float, slo_class: str | None = None, ghost_key: Hashable | None = None,
            end_depth: int | None = None, length: int | None = None, tokens: tuple[int, ...] | None = None) -> None:
        """A request matched this node (the caller counts each request once per node: a waiting
        request is matched again every time the scheduler tries it). `end_depth`, `length`: the
        node's place in the tree; `tokens`: its leading tokens (`GHOST_TOKENS`), for its ghost."""
        st, made = self._record(node, now, ghost_key, tokens)
        if end_depth is not None:
            st.end_depth = int(end_depth)
        if length is not None:
            st.length = int(length)
        st.slo_weight = max(st.slo_weight, SLO_WEIGHTS.get(slo_class or "", SLO_WEIGHTS["standard"]))
        if st.sample is not None and not made:  # a sample from before this hit (one made now has no future)
            t0, x = st.sample
            self._learn(x, 1.0 if now - t0 <= self.horizon_s else 0.0)
        if st.last_hit is not None:
            gap = max(now - st.last_hit, 0.0)
            a = self.params.gap_ewma
            st.gap = gap if st.gap is None else (1 - a) * st.gap + a * gap
            self.global_gap = gap if self.global_gap is None else (1 - a) * self.global_gap + a * gap
        st.hits += 1
        st.last_hit = now
        st.sample = (now, self.features(st, now))

    def split(self, new_parent: Hashable, child: Hashable, now: float, split_len: int,
              ghost_key: Hashable | None = None, child_end_depth: int | None = None,
              child_length: int | None = None, tokens: tuple[int, ...] | None = None) -> None:
        """The tree split `child` at split_len tokens: the new parent (the prefix) has seen every
        hit the child has. `ghost_key`, `tokens`: the child's, as it stood before the split;
        `child_end_depth`, `child_length`: its end in tokens from the root (the split leaves it)
        and its length after the split, where the caller knows them (else the record's, which an
        unshaped node has as 0)."""
        st = self.stats(child, now, ghost_key, tokens)
        if child_end_depth is not None:
            st.end_depth = int(child_end_depth)
        st.length = int(child_length) if child_length is not None else max(st.length - split_len, 0)
        head = NodeStats(created=st.created, end_depth=max(st.end_depth - st.length, split_len),
                         length=split_len, hits=st.hits, last_hit=st.last_hit,
                         gap=st.gap, slo_weight=st.slo_weight)
        head.sample = (now, self.features(head, now))
        self.nodes[new_parent] = head

    def forget(self, node: Hashable, now: float, ghost_key: Hashable | None = None,
               tokens: tuple[int, ...] | None = None) -> None:
        """The node left the tree; with a ghost key its history waits for the prefix to return
        (`tokens`: its leading ones, which a returning node's must agree with)."""
        st = self.nodes.pop(node, None)
        if st is None or ghost_key is None or self.params.max_ghosts == 0:
            return
        self.ghosts[ghost_key] = (now, st, tokens)
        self.ghosts.move_to_end(ghost_key)
        while len(self.ghosts) > self.params.max_ghosts:
            _, (_, old, _) = self.ghosts.popitem(last=False)
            if old.sample is not None:  # never came back within our memory: not reused
                self._learn(old.sample[1], 0.0)

    # ---- prediction ---------------------------------------------------------------------------

    def peek(self, st: NodeStats, now: float) -> float:
        """P(hit within the horizon) of a history record, without learning or creating anything
        (the host tier scores its entries' histories this way)."""
        return self._prob(self.features(st, now))

    def score(self, node: Hashable, now: float) -> float:
        """P(hit within the horizon). Resolves an expired pending sample as a miss first."""
        st = self.stats(node, now)
        if st.sample is not None and now - st.sample[0] > self.horizon_s:
            self._learn(st.sample[1], 0.0)
            st.sample = (now, self.features(st, now))
        return self._prob(self.features(st, now))


@dataclass(frozen=True)
class Leaf:
    """An evictable leaf as the ranker sees it: its id, its prefix's tokens (root through the
    leaf's end), its own tokens, and its ghost key (where an evicted prefix's history waits) with
    its leading tokens, needed only for a leaf the predictor has not seen."""

    node: Hashable
    end_depth: int
    length: int
    ghost_key: Hashable | None = None
    tokens: tuple[int, ...] | None = None  # its leading tokens (GHOST_TOKENS), with the ghost key


class EvictionRanker:
    """Eviction order by predicted reuse, and the bounded pin set.

    `begin_round` runs when SGLang starts an eviction: it scores the evictable leaves and pins the
    best ones (score at least `pin_min_score`) whose prefixes fit `pin_share` of the device pool
    (prefix tokens summed per leaf: shared ancestors count once per leaf, so the bound is
    conservative). `priority` is the key SGLang's min-heap pops in order: unpinned before pinned,
    then the lowest predicted reuse, then the least recently used.
    """

    def __init__(self, predictor: ReusePredictor, pool_tokens: int, pin_share: float = 0.25,
                 pin_min_score: float = 0.5) -> None:
        assert pool_tokens >= 0 and 0.0 <= pin_share <= 1.0 and 0.0 <= pin_min_score <= 1.0
        self.predictor = predictor
        self.pool_tokens = pool_tokens
        self.pin_share = pin_share
        self.pin_min_score = pin_min_score
        self.pinned: frozenset[Hashable] = frozenset()
        self.pinned_tokens = 0
        self._scores: dict[Hashable, float] = {}
        self._now = 0.0
        self.rounds = 0

    @property
    def pin_budget(self) -> int:
        return int(self.pin_share * self.pool_tokens)

    def begin_round(self, leaves: Iterable[Leaf], now: float) -> None:
        self._now = now
        self.rounds += 1
        scored = []
        for leaf in leaves:
            self.predictor.shape(leaf.node, now, leaf.end_depth, leaf.length, leaf.ghost_key, leaf.tokens)
            scored.append((self.predictor.score(leaf.node, now), leaf))
        self._scores = {leaf.node: s for s, leaf in scored}
        scored.sort(key=lambda sl: -sl[0])
        pinned, used, budget = set(), 0, self.pin_budget
        for s, leaf in scored:
            if s < self.pin_min_score:
                break
            if used + leaf.end_depth <= budget:
                pinned.add(leaf.node)
                used += leaf.end_depth
        self.pinned, self.pinned_tokens = frozenset(pinned), used

    def reset(self) -> None:
        """The tree was reset: no scores, no pins."""
        self.pinned, self.pinned_tokens, self._scores = frozenset(), 0, {}

    def priority(self, node: Hashable, last_access: float, now: float | None = None) -> tuple[int, float, float]:
        score = self._scores.get(node)
        if score is None:  # a parent that became a leaf during this round
            score = self.predictor.score(node, self._now if now is None else now)
            self._scores[node] = score
        return (int(node in self.pinned), score, last_access)

