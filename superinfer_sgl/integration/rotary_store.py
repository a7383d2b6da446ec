"""The rotary store: what the runtime holds for requests whose KV is not where SGLang keeps it.

- `entries`: rotary requests, their KV in host blocks (`rotation.RotaryEntry`);
- `prefetched`: device slots already holding a rotary request's KV (`prefetch.Prefetcher` fills
  it; the request is still rotary until it resumes);
- `resume_locks`: our radix-tree lock on each resumed request's restored prefix, until SGLang
  admits the request and holds its own;
- `digests`: with `SUPERINFER_VERIFY_ROTATION=1` (`verify`), a hash of each rotated-out request's
  KV, compared with the device KV when it is admitted again.

Aborts and SGLang's own retractions release what it holds (`abort`, `forget_kv`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..duplexkv.engine import RotationEngine
from . import kv_adapter, rotation

logger = logging.getLogger(__name__)


def abort_match(recv_req: Any) -> Callable[[str], bool]:
    """Which rids SGLang's abort request covers: all, or those starting with its rid."""
    if recv_req.abort_all:
        return lambda rid: True
    prefix = recv_req.rid
    return lambda rid: rid.startswith(prefix)


class RotaryStore:
    """Its collaborators: SGLang's scheduler (waiting queue, radix tree, KV for the digests), the
    rotation engine (None: rotation is off and the store stays empty) and the counters."""

    def __init__(self, sched: Any, engine: RotationEngine | None, stats: rotation.RotationStats,
                 *, verify: bool = False) -> None:
        self.sched, self.engine, self.stats, self.verify = sched, engine, stats, verify
        self.entries: dict[str, rotation.RotaryEntry] = {}
        self.prefetched: dict[str, rotation.Prefetched] = {}
        self.resume_locks: dict[str, Any] = {}
        self.digests: dict[str, tuple[int, str]] = {}
        self.host_blocks = 0  # host blocks the entries' HostKVs hold (the host-bytes gauge)

    def has_work(self) -> bool:
        # (A prefetched request is still rotary, so its slots are covered too.)
        return bool(self.entries or self.resume_locks)

    # ---- rotation ----------------------------------------------------------------------------
    def digest(self, outs: list[Any]) -> None:
        """Hash what admission will read back of each request rotating out (verify only; a logprob
        request extends past its logprob start)."""
        if self.verify:
            for req in outs:
                n = rotation.adoptable_tokens(req, rotation.restorable_tokens(req))
                self.digests[req.rid] = (n, kv_adapter.device_kv_digest(self.sched, req, n))

    def park(self, entry: rotation.RotaryEntry, iteration: int) -> None:
        """A request rotated out this iteration."""
        entry.paused_iter = iteration
        self.entries[entry.req.rid] = entry
        self.host_blocks += len(entry.host_kv.block_ids)
        self.stats.rotations_out += 1

    def recomputed(self, rid: str) -> None:
        """A rotation that fell back to recompute: nothing restored, nothing to verify."""
        self.stats.recompute_fallbacks += 1
        self.digests.pop(rid, None)

    def resumed(self, entry: rotation.RotaryEntry, lock: Any) -> None:
        """A request whose KV is back in the radix tree, under our `lock`: it waits for admission."""
        rid = entry.req.rid
        del self.entries[rid]
        self.host_blocks -= len(entry.host_kv.block_ids)
        assert self.engine is not None
        self.engine.free(entry.host_kv)  # the mirror kept its own references to what it reuses
        entry.window = None  # a sliding window's rows are back on the device
        self.resume_locks[rid] = lock
        self.sched.waiting_queue.append(entry.req)
        # its wait starts now, as SGLang's requeue stamps it (SGLANG_REQ_WAITING_TIMEOUT reads it)
        entry.req.time_stats.set_wait_queue_entry_time()
        self.stats.resumes += 1

    # ---- prefetch ----------------------------------------------------------------------------
    def prefetch_tokens(self) -> int:
        """Device slots held for prefetches (free for admission: given back first)."""
        return sum(p.host_kv.num_tokens for p in self.prefetched.values())

    def take_prefetch(self, rid: str) -> rotation.Prefetched | None:
        """The prefetch of a request that resumes now (its slots become the resume's)."""
        return self.prefetched.pop(rid, None)

    def drop_prefetch(self, rid: str) -> None:
        """Give a prefetch's slots back (a wrong guess, or an abort)."""
        assert self.engine is not None
        rotation.cancel_prefetch(self.sched, self.engine, self.prefetched.pop(rid))
        self.stats.prefetch_cancelled += 1

    # ---- admission ---------------------------------------------------------------------------
    def unlock_admitted(self, admitted: list[Any]) -> None:
        # Admitted requests now hold their own tree lock on the restored prefix.
        for req in admitted:
            if req.rid in self.digests and req.rid in self.resume_locks:
                self._verify(req)
            lock = self.resume_locks.pop(req.rid, None)
            if lock is not None:
                self.sched.tree_cache.unlock(lock)

    def _verify(self, req: Any) -> None:
        n, digest = self.digests.pop(req.rid)
        # Only the first req.prefix_len rows of the admitted request's req_to_token row are KV it
        # reads from the tree; the rows after them are slots of the extend this very step builds,
        # not written yet (hashing them reported false changes for logprob requests). A shorter
        # match than the digest covers means those tokens are recomputed: nothing to compare.
        matched = getattr(req, "prefix_len", n)
        if matched < n:
            self.stats.kv_unverified += 1
            logger.warning("superinfer: KV of %s not verified: admission matched %d of the %d restored tokens "
                           "(the rest is recomputed)", req.rid, matched, n)
            return
        if kv_adapter.device_kv_digest(self.sched, req, n) == digest:
            self.stats.kv_verified += 1
        else:
            self.stats.kv_mismatches += 1
            logger.error("superinfer: KV of %s changed across rotation (%d tokens)", req.rid, n)

    # ---- release -----------------------------------------------------------------------------
    def abort(self, match: Callable[[str], bool]) -> None:
        """Hand matching rotary requests back to the waiting queue, where SGLang's own abort path
        finds them, and release what we hold for them."""
        for rid in [r for r in self.prefetched if match(r)]:
            self.drop_prefetch(rid)  # before its HostKV is freed: the slots are ours to give back
        for rid in [r for r in self.entries if match(r)]:
            self.stats.aborted_rotary += 1
            self.sched.waiting_queue.append(self._release(rid))
        for rid in [r for r in self.resume_locks if match(r)]:
            self.release_lock(rid)

    def release_lock(self, rid: str) -> bool:
        """Our lock on a resumed request's restored prefix goes (it leaves before admission);
        False if it held none."""
        lock = self.resume_locks.pop(rid, None)
        if lock is None:
            return False
        self.digests.pop(rid, None)
        self.sched.tree_cache.unlock(lock)
        return True

    def recompute_all(self) -> list[Any]:
        """Every rotary request back to SGLang's queue to be recomputed (its host KV freed, a
        prefetch given back), every resume lock released, every host mirror dropped: SGLang
        retracted all it runs (`pause_generation(mode="retract")`, a weight update), so no KV of
        the old weights may come back. Returns the requeued requests."""
        for rid in list(self.prefetched):
            self.drop_prefetch(rid)
        requeued = [self._release(rid) for rid in list(self.entries)]
        for req in requeued:
            self.sched._add_request_to_queue(req, is_retracted=True)
        for rid in list(self.resume_locks):
            self.release_lock(rid)
        self.digests.clear()  # restored prefixes may be flushed: nothing left to verify
        if self.engine is not None:
            self.engine.untrack_all()
        return requeued

    def _release(self, rid: str) -> Any:
        """Take `rid`'s entry out, its host KV freed; returns its request."""
        entry = self.entries.pop(rid)
        self.host_blocks -= len(entry.host_kv.block_ids)
        if self.engine is not None:
            self.engine.free(entry.host_kv)
        entry.window = None  # its host window rows go with it
        return entry.req

    def forget(self, rid: str) -> None:
        """A request that ended or was aborted: its mirror and digest go."""
        if self.engine is not None:
            self.engine.untrack(rid)
        self.digests.pop(rid, None)

    def forget_kv(self, reqs: list[Any]) -> None:
        """SGLang retracted these requests to recompute them: their mirrors would be stale."""
        if self.engine is not None:
            for req in reqs:
                self.engine.untrack(req.rid)

    def pool_usage(self) -> tuple[int, int]:
        """Host blocks in use and in all (0, 0 without rotation)."""
        if self.engine is None:
            return 0, 0
        # every precision's pool (duplexkv/by_format.py), so a leak in any of them shows
        pools = [e.host_pool for e in getattr(self.engine, "engines", {}).values()] or [self.engine.host_pool]
        return sum(p.allocator.num_used for p in pools), sum(p.num_blocks for p in pools)
