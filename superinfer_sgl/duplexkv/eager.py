"""Eager block rotation bookkeeping: each running request's mirror of synced host blocks.

A mirror is a prefix: block j of the mirror holds tokens [j * block_tokens, (j + 1) * block_tokens)
of the request's KV, always a FULL block. Its blocks only grow at the end (sync) and are cut back to
a prefix (invalidate, reclamation); so "synced" is one number per request and a block that is written
again after syncing is cut off and copied anew, never patched (no stale bytes can come back).

Ownership: the mirror holds exactly one allocator reference per block it lists. Sharing is by
reference count only: a save_request() HostKV takes over the mirror's references (the mirror is
emptied), keep() takes a new reference on a HostKV's blocks, so a block listed by a mirror and by a
HostKV is freed only when both have let go. Pure Python over BlockAllocator: no copies, no torch ops.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from superinfer_sgl.duplexkv.host_pool import BlockAllocator, HostKV
from superinfer_sgl.duplexkv.streams import CopyEvent


@dataclass
class Mirror:
    """The synced host copy of one request's first len(blocks) * block_tokens tokens."""

    blocks: list[int] = field(default_factory=list)  # one mirror reference each
    pending: list[CopyEvent] = field(default_factory=list)  # eager copies into `blocks` still in flight
    last_sync: int = 0  # logical time of the last sync or keep (reclamation drops the oldest first)


class EagerMirror:
    def __init__(self, allocator: BlockAllocator, block_tokens: int) -> None:
        self.allocator, self.block_tokens = allocator, block_tokens
        self._mirrors: dict[str, Mirror] = {}
        self._clock = 0

    # ---- life cycle
    def track(self, rid: str) -> None:
        """Start a (possibly empty) mirror for `rid`; tracking an already tracked rid changes nothing."""
        self._mirrors.setdefault(rid, Mirror(last_sync=self._tick()))

    def untrack(self, rid: str) -> int:
        """Forget `rid` and drop its references; returns how many it held (0 if it was not tracked)."""
        mirror = self._mirrors.pop(rid, None)
        if mirror is None:
            return 0
        self.allocator.decref(mirror.blocks)
        return len(mirror.blocks)

    def __contains__(self, rid: object) -> bool:
        return rid in self._mirrors

    def rids(self) -> list[str]:
        return list(self._mirrors)

    def get(self, rid: str) -> Mirror:
        try:
            return self._mirrors[rid]
        except KeyError:
            raise ValueError(f"request {rid!r} is not tracked (call engine.track first)") from None

    # ---- growth and invalidation
    def missing(self, rid: str, num_tokens: int) -> range:
        """Indices of the full blocks among the first num_tokens tokens that are not yet synced."""
        return range(len(self.get(rid).blocks), num_tokens // self.block_tokens)

    def extend(self, rid: str, blocks: list[int], event: CopyEvent) -> None:
        """Append freshly allocated blocks (their reference passes to the mirror) being copied by `event`."""
        mirror = self.get(rid)
        mirror.blocks += blocks
        mirror.pending.append(event)
        mirror.last_sync = self._tick()

    def invalidate(self, rid: str, from_token: int) -> int:
        """Tokens >= from_token will be written again: cut the mirror back to the blocks before them."""
        if from_token < 0:
            raise ValueError(f"from_token must be >= 0, got {from_token}")
        return self._cut(self.get(rid), from_token // self.block_tokens)

    # ---- rotation out and back in
    def reusable(self, rid: str, num_tokens: int) -> int:
        """How many leading blocks of a save of num_tokens tokens the mirror already holds."""
        return min(len(self.get(rid).blocks), -(-num_tokens // self.block_tokens))

    def take(self, rid: str, num_tokens: int) -> list[int]:
        """Hand the reusable blocks, with their references, to a HostKV; drop the rest; empty the mirror.
        The request stays tracked: after resume, keep() refills the mirror."""
        mirror = self.get(rid)
        reused = mirror.blocks[: self.reusable(rid, num_tokens)]
        self.allocator.decref(mirror.blocks[len(reused) :])
        mirror.blocks, mirror.pending = [], []
        return reused

    def keep(self, rid: str, host_kv: HostKV, valid_tokens: int | None = None) -> int:
        """Make the full blocks of `host_kv` (only those within valid_tokens) the mirror of `rid`, taking
        a reference of its own on each. Returns the number of blocks kept."""
        if host_kv.block_tokens != self.block_tokens:
            raise ValueError(f"HostKV block_tokens {host_kv.block_tokens} != pool {self.block_tokens}")
        mirror = self.get(rid)
        valid = host_kv.num_tokens if valid_tokens is None else min(valid_tokens, host_kv.num_tokens)
        kept = list(host_kv.block_ids[: max(valid, 0) // self.block_tokens])
        self.allocator.incref(kept)  # before dropping the old ones: they may be the same blocks
        self.allocator.decref(mirror.blocks)
        mirror.blocks, mirror.pending, mirror.last_sync = kept, [], self._tick()
        return len(kept)

    # ---- reclamation ("eager host copies of running requests are a cache")
    def reclaimable(self, exclude: Iterable[str] = (), up_to: int | None = None) -> int:
        """Blocks that dropping every mirror outside `exclude` would free now (sole reference),
        counted only until `up_to` (the policy asks every step: a full walk of every mirror costs
        milliseconds with hundreds of running requests)."""
        skip = set(exclude)
        sole = (self.allocator.refcount(b) == 1 for rid, m in self._mirrors.items() if rid not in skip for b in m.blocks)
        count = 0
        for one in sole:
            count += one
            if up_to is not None and count >= up_to:
                break
        return count

    def drop(self, n_blocks: int, exclude: Iterable[str] = ()) -> int:
        """Cut mirrors outside `exclude`, least recently synced first and from their ends (they stay
        prefixes), until n_blocks blocks are free again or nothing is left. Returns blocks freed."""
        skip = set(exclude)
        victims = sorted((m.last_sync, rid) for rid, m in self._mirrors.items() if rid not in skip)
        freed = 0
        for _, rid in victims:
            mirror = self._mirrors[rid]
            while mirror.blocks and freed < n_blocks:
                freed += self.allocator.refcount(mirror.blocks[-1]) == 1
                self._cut(mirror, len(mirror.blocks) - 1)
        return freed

    # ---- events and accounting
    def prune(self) -> None:
        """Forget events of eager copies that have finished."""
        for mirror in self._mirrors.values():
            mirror.pending = [e for e in mirror.pending if not e.query()]

    def refs(self) -> Counter[int]:
        """References the mirrors hold, per block."""
        return Counter(b for m in self._mirrors.values() for b in m.blocks)

    def _cut(self, mirror: Mirror, keep: int) -> int:
        dropped = mirror.blocks[keep:]
        self.allocator.decref(dropped)
        del mirror.blocks[keep:]
        return len(dropped)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock
