"""Reuse prediction for radix-tree prefix nodes (`--prefix-cache predictive`): pure Python.

Each node of the prefix tree gets a `NodeStats` record of its own hit history: hits, the time of
its last hit, an exponentially weighted inter-hit gap, how many distinct requests used it, the SLO
class of its most urgent user, and its depth and length in tokens. `ReusePredictor.score` turns
that history into P(the node is hit again within the horizon) with a small logistic model over
seven explainable features (`FEATURES`), and the model learns online from the server's own hits:

- every node carries one pending sample (its features at a time t0);
- a hit within the horizon resolves it as 1, a hit later or none by t0 + horizon as 0 (the latter
  is found when the node is scored again), and a new sample starts;
- an evicted node leaves a ghost (its history, under a key the caller gives: its parent and first
  token); when the same prefix comes back, the new node inherits the history, and the ghost's
  sample resolves as 1 if the comeback fell within the horizon. So a prefix that keeps coming back
  learns that it does, which LRU and LFU forget at every eviction.

The horizon follows the traffic: twice the EWMA of all observed inter-hit gaps, clamped.
Everything is O(1) per hit and per score (a few dozen float operations); the caller (the eviction
strategy in integration/prefix_cache.py) scores only the tree's evictable leaves, when SGLang
evicts. `EvictionRanker` adds the bounded pin set: the highest-scoring leaves, as long as their
prefixes fit a share of the device pool, are evicted only after every unpinned leaf.

`HostPrefixStore` is the host tier's bookkeeping (`--prefix-host-tokens`): which evicted nodes are
demoted to host memory instead of dropped (predicted reuse at least `min_score`, and room in a
token budget, made by evicting host entries of lower predicted reuse), where a later match must end
for an entry to apply (its parent node and first page), and when entries go (host eviction, their
parent leaving the tree, a reset). It never touches memory itself: the caller copies the KV
(integration/prefix_host.py) and gets each entry's opaque handle back exactly once through
`release`, or owns it after `take`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any

FEATURES = ("bias", "log_hits", "log_distinct", "age_over_gap", "depth", "length", "slo_weight")
# The prior: a node hit often, by many requests, not overdue against its own rhythm, is reused.
PRIOR_WEIGHTS = (-1.0, 1.2, 0.8, -1.2, 0.2, 0.0, 0.5)
# An SLO class's weight (interactive prefixes are the costliest to miss); unknown names: standard.
SLO_WEIGHTS = {"interactive": 1.0, "standard": 0.5, "batch": 0.0}
RECENT_REQUESTERS = 4  # distinct-requester test window (a waiting request re-matches every step)


@dataclass(frozen=True)
class PredictorParams:
    learning_rate: float = 0.05
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
    hits: int = 0
    distinct: int = 0
    last_hit: float | None = None
    gap: float | None = None  # EWMA of the gaps between hits
    slo_weight: float = SLO_WEIGHTS["standard"]
    recent: list[Hashable] = field(default_factory=list)
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
        self.ghosts: OrderedDict[Hashable, tuple[float, NodeStats]] = OrderedDict()
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
        return (1.0, math.log1p(st.hits), math.log1p(st.distinct), overdue,
                math.log1p(st.end_depth) / 8.0, math.log1p(st.length) / 8.0, st.slo_weight)

    def _prob(self, x: tuple[float, ...]) -> float:
        return _sigmoid(sum(w * v for w, v in zip(self.weights, x)))

    def _learn(self, x: tuple[float, ...], label: float) -> None:
        if not self.params.learn:
            return
        err = label - self._prob(x)
        lr, l2 = self.params.learning_rate, self.params.l2
        self.weights = [w + lr * (err * v - l2 * w) for w, v in zip(self.weights, x)]
        self.updates += 1
        self.positives += int(label > 0.5)

    # ---- node lifecycle ---------------------------------------------------------------------

    def stats(self, node: Hashable, now: float, ghost_key: Hashable | None = None) -> NodeStats:
        """The node's record, created on first sight (inheriting a ghost's history if any)."""
        st = self.nodes.get(node)
        if st is not None:
            return st
        ghost = self.ghosts.pop(ghost_key, None) if ghost_key is not None else None
        if ghost is None:
            st = NodeStats(created=now)
        else:
            evicted_at, st = ghost
            if st.sample is not None:  # it came back: the eviction was a mistake if within the horizon
                t0, x = st.sample
                self._learn(x, 1.0 if now - t0 <= self.horizon_s else 0.0)
            st.recent = []
            st.sample = None
        self.nodes[node] = st
        st.sample = (now, self.features(st, now))
        return st

    def shape(self, node: Hashable, now: float, end_depth: int, length: int) -> None:
        st = self.stats(node, now)
        st.end_depth, st.length = int(end_depth), int(length)

    def hit(self, node: Hashable, now: float, requester: Hashable, slo_class: str | None = None,
            ghost_key: Hashable | None = None) -> bool:
        """A request matched this node. Repeated matches by one request (a waiting request is
        matched again every time the scheduler tries it) count once. True if counted."""
        st = self.stats(node, now, ghost_key)
        if requester in st.recent:
            return False
        st.recent.append(requester)
        if len(st.recent) > RECENT_REQUESTERS:
            del st.recent[0]
        st.distinct += 1
        st.slo_weight = max(st.slo_weight, SLO_WEIGHTS.get(slo_class or "", SLO_WEIGHTS["standard"]))
        if st.sample is not None:
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
        return True

    def split(self, new_parent: Hashable, child: Hashable, now: float, split_len: int,
              ghost_key: Hashable | None = None) -> None:
        """The tree split `child` at split_len tokens: the new parent (the prefix) has seen every
        hit the child has. `ghost_key`: the child's, as it stood before the split."""
        st = self.stats(child, now, ghost_key)
        head = NodeStats(created=st.created, end_depth=st.end_depth - st.length + split_len,
                         length=split_len, hits=st.hits, distinct=st.distinct, last_hit=st.last_hit,
                         gap=st.gap, slo_weight=st.slo_weight, recent=list(st.recent))
        head.sample = (now, self.features(head, now))
        self.nodes[new_parent] = head
        st.length = max(st.length - split_len, 0)

    def forget(self, node: Hashable, now: float, ghost_key: Hashable | None = None) -> None:
        """The node left the tree; with a ghost key its history waits for the prefix to return."""
        st = self.nodes.pop(node, None)
        if st is None or ghost_key is None or self.params.max_ghosts == 0:
            return
        self.ghosts[ghost_key] = (now, st)
        self.ghosts.move_to_end(ghost_key)
        while len(self.ghosts) > self.params.max_ghosts:
            _, (_, old) = self.ghosts.popitem(last=False)
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
    leaf's end) and its own tokens."""

    node: Hashable
    end_depth: int
    length: int


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
            self.predictor.shape(leaf.node, now, leaf.end_depth, leaf.length)
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

    def priority(self, node: Hashable, last_access: float, now: float | None = None) -> tuple[int, float, float]:
        score = self._scores.get(node)
        if score is None:  # a parent that became a leaf during this round
            score = self.predictor.score(node, self._now if now is None else now)
            self._scores[node] = score
        return (int(node in self.pinned), score, last_access)


# ---- the host tier: demoted prefixes (--prefix-host-tokens) ------------------------------------

# An evicted node is demoted when its predicted reuse is at least this. Chosen on the replay's
# training seeds 0-2 (results/prefix_cache/host_sweep.json, docs/prefix_cache.md "Host tier"): over
# host budgets of 0.25x-2x the device pool, 0.0-0.2 gained the most hit share over predictive alone
# (0.1 best or within 0.4 points at every budget), 0.3 lost 2-8 points on tenants and 0.4-0.5 up to
# 18 (returning system prompts are evicted overdue, i.e. with a low P, and were dropped). Above 0 so
# that a leaf the predictor gives up on (overdue against the horizon, never hit) is not copied at all;
# host entries compete by predicted reuse anyway (HostPrefixStore.admit).
DEMOTE_MIN_SCORE = 0.1
# The host entries' ranking (by current predicted reuse) is rebuilt at most this often: scoring
# every entry costs ~2 us each, and scores move with time only as entries grow overdue.
RERANK_S = 1.0


@dataclass(slots=True)
class HostEntry:
    """One demoted node. `key` is where it continues the tree: (the id of the node it hung under,
    its first page's child key); a match whose device path ends at that node and continues with that
    page can restore it. `node` is its own id when demoted: its demoted children are keyed under it."""

    key: Hashable
    node: Hashable
    tokens: int
    cost: int  # budget units it holds: its tokens rounded up to whole host blocks
    stats: NodeStats | None
    demoted_at: float
    last_used: float
    handle: Any = None  # the caller's (integration: a HostKV)
    payload: Any = None  # the caller's (integration: the node's token ids)


class HostPrefixStore:
    """Demoted prefixes within a budget of `budget` tokens (in whole `unit`-token blocks).

    Invariants (check()): the entries' costs sum to `used` <= `budget`; `under` indexes every entry
    by the node it hangs under; every handle admitted is released through `release` exactly once
    (host eviction, replacement, its parent leaving the tree, clear) unless the caller `take`s it.
    An entry hanging under a demoted node (its parent was demoted after it) is reachable only once
    that node is restored (`rekey`), so evicting or dropping an entry takes its demoted descendants
    with it."""

    def __init__(self, predictor: ReusePredictor, budget: int, release: Callable[[Any], None],
                 min_score: float = DEMOTE_MIN_SCORE, unit: int = 1) -> None:
        assert budget >= 0 and unit >= 1 and 0.0 <= min_score <= 1.0
        self.predictor = predictor
        self.budget = budget // unit * unit
        self.unit = unit
        self.min_score = min_score
        self.release = release
        self.entries: dict[Hashable, HostEntry] = {}
        # (score, last used, seq, entry), ascending: the eviction order, rebuilt every RERANK_S; newer
        # entries are inserted by their admission score, gone ones skipped
        self._ranking: list[tuple[float, float, int, HostEntry]] = []
        self._ranked_at: float | None = None
        self._seq = itertools.count()
        self.under: dict[Hashable, set[Hashable]] = {}  # parent node id -> keys of entries under it
        self.by_node: dict[Hashable, Hashable] = {}  # demoted node id -> its entry's key
        self.used = 0
        # counters
        self.demoted = self.demoted_tokens = 0
        self.rejected_score = self.rejected_room = 0
        self.host_evicted = self.dropped = 0  # entries: evicted for room / gone with their parent or a reset
        self.restored = self.restored_tokens = 0

    def cost_of(self, tokens: int) -> int:
        return -(-tokens // self.unit) * self.unit

    def score_of(self, entry: HostEntry, now: float) -> float:
        return self.predictor.peek(entry.stats, now) if entry.stats is not None else 0.0

    def __len__(self) -> int:
        return len(self.entries)

    # ---- demotion ----------------------------------------------------------------------------
    def admit(self, key: Hashable, node: Hashable, tokens: int, score: float, now: float,
              stats: NodeStats | None = None) -> HostEntry | None:
        """Room for a node about to be evicted, or None (nothing changed): its score is below
        min_score, or it does not fit even after evicting every entry of lower predicted reuse.
        On success the entry is in the store without a handle: the caller copies the KV and sets
        entry.handle, or calls `discard(entry)` when the copy failed."""
        cost = self.cost_of(tokens)
        if tokens <= 0 or score < self.min_score:
            self.rejected_score += 1
            return None
        if cost > self.budget:
            self.rejected_room += 1
            return None
        old = self.entries.get(key)
        doomed: dict[Hashable, HostEntry] = {}
        if old is not None:  # the same place again (the prefix was recomputed and evicted anew)
            self._collect(old, doomed)
        freed = sum(e.cost for e in doomed.values())
        need = self.used + cost - self.budget
        if freed < need:
            for _, _, _, victim in self._ranked(now):
                if freed >= need:
                    break
                if self.entries.get(victim.key) is not victim or victim.key in doomed:
                    continue  # gone since the ranking, or already going
                if self.score_of(victim, now) >= score:
                    break  # only entries predicted less reusable than the newcomer make room
                before = set(doomed)
                self._collect(victim, doomed)
                freed += sum(doomed[k].cost for k in doomed.keys() - before)
            if freed < need:
                self.rejected_room += 1
                return None
        for k in doomed:
            self.host_evicted += int(k != key)
            self.dropped += int(k == key)
        self._remove(doomed)
        entry = HostEntry(key, node, tokens, cost, stats, now, now)
        self._add(entry)
        if self._ranked_at is not None:
            bisect.insort(self._ranking, (score, now, next(self._seq), entry))
        self.demoted += 1
        self.demoted_tokens += tokens
        return entry

    def discard(self, entry: HostEntry) -> None:
        """An admitted entry whose copy did not happen: out of the store (its handle, if any, released)."""
        if self.entries.get(entry.key) is entry:
            self.demoted -= 1
            self.demoted_tokens -= entry.tokens
            self._remove(self._collect(entry, {}))

    # ---- restore -----------------------------------------------------------------------------
    def lookup(self, key: Hashable) -> HostEntry | None:
        entry = self.entries.get(key)
        return entry if entry is not None and entry.handle is not None else None

    def take(self, key: Hashable) -> HostEntry | None:
        """Remove an entry for restoring; its handle is the caller's from now on (not released).
        Its demoted children stay, keyed under its old node id: `rekey` them to the restored node,
        or `drop_under` the old id when they cannot follow (a partial restore)."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        self._unindex(entry)
        self.used -= entry.cost
        return entry

    def restored_entry(self, entry: HostEntry, tokens: int) -> None:
        self.restored += 1
        self.restored_tokens += tokens

    def reinsert(self, entry: HostEntry, now: float) -> bool:
        """Put a taken entry back (its restore did not happen), evicting lower-scored entries if the
        budget is now short; when it does not fit, its handle is released and its children dropped."""
        score = self.score_of(entry, now) if entry.stats is not None else self.min_score
        placed = self.admit(entry.key, entry.node, entry.tokens, max(score, self.min_score), now, entry.stats)
        if placed is None:
            self.release(entry.handle)
            self.drop_under(entry.node)
            return False
        self.demoted -= 1
        self.demoted_tokens -= entry.tokens
        placed.handle, placed.payload, placed.demoted_at = entry.handle, entry.payload, entry.demoted_at
        return True

    def rekey(self, old_node: Hashable, new_node: Hashable) -> None:
        """A demoted node came back as `new_node`: the entries under its old id hang under the new one."""
        keys = self.under.pop(old_node, set())
        for key in keys:
            entry = self.entries.pop(key)
            self.by_node.pop(entry.node, None)
            entry.key = (new_node, key[1])
            self.entries[entry.key] = entry
            self.under.setdefault(new_node, set()).add(entry.key)
            self.by_node[entry.node] = entry.key

    # ---- the tree's side ---------------------------------------------------------------------
    def node_left(self, node: Hashable) -> None:
        """A tree node left the tree. Demoted: its entry keeps what hangs under it. Dropped: nothing
        can reach the entries under it any more: they go."""
        if node not in self.by_node:
            self.drop_under(node)

    def drop_under(self, node: Hashable) -> None:
        doomed: dict[Hashable, HostEntry] = {}
        for key in list(self.under.get(node, ())):
            self._collect(self.entries[key], doomed)
        self.dropped += len(doomed)
        self._remove(doomed)

    def clear(self) -> None:
        """Everything goes (the tree was reset: e.g. new weights make every saved KV stale)."""
        self.dropped += len(self.entries)
        self._remove(dict(self.entries))

    # ---- internals ---------------------------------------------------------------------------
    def _ranked(self, now: float) -> list[tuple[float, float, int, HostEntry]]:
        stale = self._ranked_at is None or now - self._ranked_at > RERANK_S or now < self._ranked_at
        if stale or len(self._ranking) > 2 * len(self.entries) + 64:
            self._ranking = sorted((self.score_of(e, now), e.last_used, next(self._seq), e)
                                   for e in self.entries.values())
            self._ranked_at = now
        return self._ranking

    def _collect(self, entry: HostEntry, into: dict[Hashable, HostEntry]) -> dict[Hashable, HostEntry]:
        stack = [entry]
        while stack:
            e = stack.pop()
            if e.key in into:
                continue
            into[e.key] = e
            stack.extend(self.entries[k] for k in self.under.get(e.node, ()))
        return into

    def _add(self, entry: HostEntry) -> None:
        self.entries[entry.key] = entry
        self.under.setdefault(entry.key[0], set()).add(entry.key)
        self.by_node[entry.node] = entry.key
        self.used += entry.cost

    def _unindex(self, entry: HostEntry) -> None:
        siblings = self.under.get(entry.key[0])
        if siblings is not None:
            siblings.discard(entry.key)
            if not siblings:
                del self.under[entry.key[0]]
        if self.by_node.get(entry.node) == entry.key:
            del self.by_node[entry.node]

    def _remove(self, doomed: dict[Hashable, HostEntry]) -> None:
        for key, entry in doomed.items():
            if self.entries.get(key) is not entry:
                continue
            del self.entries[key]
            self._unindex(entry)
            self.used -= entry.cost
            if entry.handle is not None:
                self.release(entry.handle)

    def check(self) -> None:
        assert self.used == sum(e.cost for e in self.entries.values()) <= self.budget, (self.used, self.budget)
        indexed = {k for keys in self.under.values() for k in keys}
        assert indexed == set(self.entries), "the parent index differs from the entries"
        for key, entry in self.entries.items():
            assert entry.key == key and key in self.under.get(key[0], ()), key
            assert self.by_node.get(entry.node) == key, entry.node
        assert len(self.by_node) == len(self.entries)
