"""The prefix host tier's bookkeeping (`--prefix-host-tokens`), pure Python: which evicted radix
nodes are demoted to host memory instead of dropped (predicted reuse at least `min_score`, and room
in a token budget, made by evicting host entries of lower predicted reuse), where a later match must
end for an entry to apply (its parent node and first page), and when entries go (host eviction,
their parent leaving the tree, a reset). It never touches memory itself: the caller copies the KV
(integration/prefix_host.py) and gets each entry's opaque handle back exactly once through
`release`, or owns it after `take`. Scores come from the reuse predictor (prefix_reuse.py).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from .prefix_reuse import NodeStats, ReusePredictor


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
        self._ranked_cold = False
        self._seq = itertools.count()
        self.under: dict[Hashable, set[Hashable]] = {}  # parent node id -> keys of entries under it
        self.by_node: dict[Hashable, Hashable] = {}  # demoted node id -> its entry's key
        self.used = 0
        # entries taken for a restore whose handles the caller still holds: their host memory is
        # not free until it hands them back (`handed_back`), so admissions leave it alone
        self.taken = 0
        # counters
        self.demoted = self.demoted_tokens = 0
        self.rejected_score = self.rejected_room = 0
        self.host_evicted = self.dropped = 0  # entries: evicted for room / gone with their parent or a reset
        self.restored = self.restored_tokens = 0

    def cost_of(self, tokens: int) -> int:
        return -(-tokens // self.unit) * self.unit

    @property
    def cold(self) -> bool:
        """Cold start: the predictor has not seen a gap between two hits of one node yet, so its
        horizon is a floor value (1 s) and every node scores as overdue whatever the traffic's
        pace. Until then a node is judged by its hits instead (`cold_score`)."""
        return self.predictor.global_gap is None

    @staticmethod
    def cold_score(stats: NodeStats | None) -> float:
        """0 for a node nobody hit, then 1/2, 2/3, 3/4, ... by its hits."""
        hits = stats.hits if stats is not None else 0
        return hits / (1.0 + hits)

    def score_of(self, entry: HostEntry, now: float) -> float:
        if self.cold:
            return self.cold_score(entry.stats)
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
        if self.cold:  # a node some request hit is demoted, one nobody hit is not (cold_score)
            score = self.cold_score(stats)
            admissible = score > 0.0 or self.min_score <= 0.0  # min_score 0: everything
        else:
            admissible = score >= self.min_score
        if tokens <= 0 or not admissible:
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
        need = self.used + self.taken + cost - self.budget
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
            doomed = self._collect(entry, {})
            self.dropped += len(doomed) - 1  # its demoted descendants go with it
            self._remove(doomed)

    # ---- restore -----------------------------------------------------------------------------
    def lookup(self, key: Hashable) -> HostEntry | None:
        entry = self.entries.get(key)
        return entry if entry is not None and entry.handle is not None else None

    def take(self, key: Hashable) -> HostEntry | None:
        """Remove an entry for restoring; its handle is the caller's from now on (not released),
        and its cost stays charged (`taken`) until the caller frees the handle and calls
        `handed_back`, or `reinsert`s it. Its demoted children stay, keyed under its old node id:
        `rekey` them to the restored node, or `drop_under` the old id when they cannot follow (a
        partial restore)."""
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        self._unindex(entry)
        self.used -= entry.cost
        self.taken += entry.cost
        return entry

    def handed_back(self, entry: HostEntry) -> None:
        """A taken entry's handle was freed: its host memory is free for admissions again."""
        self.taken -= entry.cost

    def restored_entry(self, entry: HostEntry, tokens: int) -> None:
        self.restored += 1
        self.restored_tokens += tokens

    def reinsert(self, entry: HostEntry, now: float) -> bool:
        """Put a taken entry back (its restore did not happen), evicting lower-scored entries if the
        budget is now short; when it does not fit, its handle is released and its children dropped."""
        self.handed_back(entry)  # the same handle is placed again, or released below
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
        if stale or self._ranked_cold != self.cold or len(self._ranking) > 2 * len(self.entries) + 64:
            self._ranked_cold = self.cold
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
        assert self.used == sum(e.cost for e in self.entries.values()), self.used
        assert 0 <= self.taken and self.used + self.taken <= self.budget, (self.used, self.taken, self.budget)
        indexed = {k for keys in self.under.values() for k in keys}
        assert indexed == set(self.entries), "the parent index differs from the entries"
        for key, entry in self.entries.items():
            assert entry.key == key and key in self.under.get(key[0], ()), key
            assert self.by_node.get(entry.node) == key, entry.node
        assert len(self.by_node) == len(self.entries)
