"""Host demotion of predicted-reuse prefixes (`--prefix-host-tokens N` with `--prefix-cache predictive`).

When SGLang's eviction walk is about to delete a device leaf whose predicted reuse is high enough
(rotasched/prefix_host_store.HostPrefixStore decides: the predictor's P >= DEMOTE_MIN_SCORE, and room in
the host budget), the leaf's KV rows (its device slots, every layer, K and V) are copied into host
blocks through DuplexKV (a RotationEngine over the device pool and a host pool of our own, apart
from the rotation engine's) BEFORE SGLang frees the slots. The entry is remembered under (the id of
the node it hung under, its first page): where a later match must end for it to apply.

When a request's match ends at such a node and its prompt continues with the entry's tokens, the
entry is restored like a rotation resume (integration/rotation.py): the matched path is locked,
device slots are allocated (evicting unlocked leaves if short: SGLang's own helper; free plus
evictable memory, what SGLang's admission counts, is the same after a restore as before), the rows
are copied back, the tokens are inserted into the radix tree as SGLang inserts a request's KV
(fresh slots after the path's own, prev_prefix_len = the matched length), and the match runs again,
so the request's match includes them. Entries chain: a parent demoted after its child is restored
first, then the child.

Hooks (integration/prefix_cache.py installs them with the predictive cache's):
  UnifiedTreeCore.evict_device_leaf   BEFORE  demote the leaf (its slots are still SGLang's)
  UnifiedRadixCache._match_tree       AROUND  restore what continues a request's match, match again
  UnifiedTreeCore.reset               AFTER   drop every entry (a flush: new weights, stale KV)
  UnifiedTreeCore._unregister_node    (prefix_cache's BEFORE hook) entries under a dropped node go

Supported: SGLang's UnifiedRadixCache with the full-attention component only, an MHATokenToKVPool
(NHD, no scale buffers), any page size, one rank (TP, context and pipeline parallel size 1), no
HiCache, no EAGLE bigram keys. Anything else: demotion is refused at startup with the reason logged,
and the predictive cache runs without it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from ..duplexkv.engine import RotateIn, RotateOut, RotationEngine
from ..duplexkv.host_pool import HostKVPool, HostPoolFull
from ..duplexkv.transfer import pick_transfer
from ..rotasched.prefix_host_store import DEMOTE_MIN_SCORE, HostPrefixStore
from ..rotasched.prefix_reuse import ReusePredictor

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 16  # host block size (a multiple of SGLang's page size is used when pages are larger)
AUTO_RAM_FRACTION = 1 / 8  # --prefix-host-tokens auto: at most this share of the RAM available at startup


def auto_host_tokens(pool_tokens: int, bytes_per_token: int, available_ram: int | None = None,
                     processes: int = 1) -> int:
    """--prefix-host-tokens auto: as many tokens as the device KV pool (the replay's gain grew with
    the budget through 2x; 1x keeps host RAM modest beside the rotation pool's quarter of the free
    RAM), within AUTO_RAM_FRACTION of the available RAM split among the node's `processes`
    (scheduler processes, e.g. --dp-size: each pins a tier of its own)."""
    if available_ram is None:
        from ..host_memory import available_ram_bytes

        available_ram = available_ram_bytes()
    share = int(AUTO_RAM_FRACTION * available_ram / max(1, processes))
    return max(0, min(int(pool_tokens), share // max(1, bytes_per_token)))


def refusal(core: Any, params: Any) -> str | None:
    """Why host demotion cannot run on this tree and pool (None: it can)."""
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from ..duplexkv.pool_layout import unsupported_reason

    comps = tuple(getattr(core, "component_types", ()))
    if comps != (ComponentType.FULL,):
        names = ", ".join(getattr(c, "name", str(c)) for c in comps)
        return f"a hybrid radix tree ({names}): demotion copies full-attention rows only (no SWA/Mamba state)"
    if getattr(core, "is_eagle", False):
        return "EAGLE bigram keys: demoted entries are keyed by plain token pages"
    for name in ("attn_cp_size", "pp_size"):
        if int(getattr(params, name, 1) or 1) > 1:
            return f"{name} {getattr(params, name)} > 1: demotion decisions are per rank and not kept consistent"
    group = getattr(params, "tp_cache_group", None)
    if group is not None and torch.distributed.is_initialized() and torch.distributed.get_world_size(group) > 1:
        return ("tensor parallelism: each rank would demote and restore by its own clock-based scores, so "
                "the ranks' radix trees could diverge")
    allocator = getattr(params, "token_to_kv_pool_allocator", None)
    kvcache = allocator.get_kvcache() if allocator is not None and hasattr(allocator, "get_kvcache") else None
    name = type(kvcache).__name__
    if name != "MHATokenToKVPool":
        return f"the KV pool is a {name}: host demotion supports MHATokenToKVPool only (no MLA, SWA or hybrid pools)"
    why = unsupported_reason(kvcache)
    return None if why is None else why.split("; rotation is off")[0]


def no_fence() -> list[Any]:
    """The copies' ordering without a scheduler (tests, the replay, CPU). In a server the caller
    passes integration/hooks.forward_fence: the forward in flight (overlap scheduler) may still
    write slots freed since it was launched, so copies wait for it, as a rotation resume's do."""
    return []


class PrefixHost:
    """One tree core's host tier: the store (pure bookkeeping) and the copy engine."""

    def __init__(self, engine: RotationEngine, store: HostPrefixStore, page_size: int,
                 fence: Callable[[], list[Any]] = no_fence) -> None:
        self.engine, self.store, self.page_size, self.fence = engine, store, page_size, fence
        self.demote_s = self.restore_s = 0.0  # wall time of our copies and bookkeeping
        self.demote_calls = self.restore_calls = 0  # leaves offered / matches looked at
        self.restore_failures = 0  # no device memory for an entry (it stays on host)
        self.hicache_skips = 0
        self._busy = False

    @classmethod
    def open(cls, core: Any, params: Any, predictor: ReusePredictor, host_tokens: int,
             transfer: str = "auto", min_score: float | None = None,
             fence: Callable[[], list[Any]] = no_fence) -> tuple[PrefixHost | None, str | None]:
        """The host tier for a tree core, or (None, why not). host_tokens < 0: auto_host_tokens.
        min_score: DEMOTE_MIN_SCORE by default (read when called: the replay's sweep sets it)."""
        if host_tokens == 0:
            return None, None
        why = refusal(core, params)
        if why is not None:
            return None, why
        from .kv_adapter import device_pool_view

        dev = device_pool_view(params.token_to_kv_pool_allocator.get_kvcache())
        if host_tokens < 0:
            from .startup import local_schedulers

            host_tokens = auto_host_tokens(params.token_to_kv_pool_allocator.size, dev.bytes_per_token,
                                           processes=local_schedulers(None)[0])
            if host_tokens == 0:
                return None, "auto: no RAM to spare"
        page = int(params.page_size)
        block = BLOCK_TOKENS if BLOCK_TOKENS % page == 0 else page * -(-BLOCK_TOKENS // page)
        blocks = -(-host_tokens // block)
        pool = HostKVPool(blocks, dev.layers, dev.kv_heads, dev.head_dim, block, dev.dtype)
        engine = RotationEngine(dev, pool, pick_transfer(dev.device) if transfer == "auto" else transfer)
        threshold = DEMOTE_MIN_SCORE if min_score is None else min_score
        store = HostPrefixStore(predictor, blocks * block, engine.free, min_score=threshold, unit=block)
        return cls(engine, store, page, fence), None

    # ---- demotion: a leaf SGLang is about to delete -----------------------------------------
    def demote(self, core: Any, node: Any, score: float, now: float, stats: Any) -> bool:
        start = time.perf_counter()
        self.demote_calls += 1
        try:
            if core.enable_hicache:  # HiCache keeps its own host copies; its eviction demotes instead
                self.hicache_skips += 1
                return False
            from sglang.srt.mem_cache.unified_cache.components import ComponentType

            value = node.component_data[ComponentType.FULL].value
            parent = node.parent
            if value is None or parent is None or node.key is None or len(value) == 0:
                return False
            key = (parent.id, node.key.child_key(self.page_size))
            entry = self.store.admit(key, node.id, len(value), score, now, stats)
            if entry is None:
                return False
            slots = value.to(torch.int64)
            try:
                handle = self.engine.rotate(out=[RotateOut(None, slots, slots.numel())], after=self.fence())
                handle.synchronize()  # SGLang frees (and may reuse) these slots right after we return
            except HostPoolFull:  # the store's budget is the pool's: should not happen
                self.store.discard(entry)
                return False
            except BaseException:
                self.store.discard(entry)
                raise
            entry.handle = handle.saved[0]
            entry.payload = node.key
            return True
        finally:
            self.demote_s += time.perf_counter() - start

    # ---- restore: a request's match ends where an entry continues ---------------------------
    def restore(self, cache: Any, params: Any, result: Any, now: float) -> int:
        """Bring back the entries that continue `result` along params.key; tokens restored."""
        if self._busy or not self.store.entries:
            return 0
        start = time.perf_counter()
        self.restore_calls += 1
        self._busy = True
        try:
            return self._restore(cache, params, result, now)
        finally:
            self._busy = False
            self.restore_s += time.perf_counter() - start

    def _restore(self, cache: Any, params: Any, result: Any, now: float) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        core, page = cache.tree_core, self.page_size
        if core.enable_hicache:
            return 0
        key = params.key.page_aligned(page)
        m, node_id = int(result.device_prefix_len), result.last_device_node
        restored, lock = 0, None
        try:
            while m + page <= len(key):
                entry = self.store.lookup((node_id, key.child_key_at(m, page)))
                if entry is None:
                    break
                k = min(_common_prefix(entry.payload, key, m, page), entry.tokens)
                if k <= 0 or k < entry.tokens - k:
                    # Less than half of it continues this prompt: a partial restore would drop the
                    # rest and every entry chained under it for a few tokens of this request's.
                    break
                if lock is None:
                    lock = (node_id, cache.inc_lock_ref(node_id))  # the path survives our eviction
                self.store.take(entry.key)
                try:
                    slots = self._alloc(cache, k)
                except BaseException:  # e.g. an eviction that raised: the entry goes back first
                    self.store.reinsert(entry, now)
                    raise
                if slots is None:
                    self.restore_failures += 1
                    self.store.reinsert(entry, now)
                    break
                try:
                    handle = self.engine.rotate(inn=[RotateIn(entry.handle.prefix(k), slots)], in_after=self.fence())
                    handle.synchronize()  # the next forward reads these rows
                    path = core.collect_full_device_indices(node_id, core.root_node.id)
                    value = torch.cat([path.to(torch.int64), slots.to(device=path.device, dtype=torch.int64)])
                except BaseException:  # nothing inserted: the slots and the host blocks go back
                    cache.token_to_kv_pool_allocator.free(slots)
                    self.engine.free(entry.handle)
                    self.store.handed_back(entry)
                    self.store.drop_under(entry.node)
                    raise
                try:
                    ins = cache.insert(InsertParams(key=key[: m + k], value=value, prev_prefix_len=m))
                except BaseException:  # not in the tree: the slots are still ours to give back
                    cache.token_to_kv_pool_allocator.free(slots)
                    self.store.drop_under(entry.node)
                    raise
                finally:
                    self.engine.free(entry.handle)
                    self.store.handed_back(entry)
                new_id = ins.last_device_node
                if k == entry.tokens:
                    self.store.rekey(entry.node, new_id)
                else:  # a partial restore ends elsewhere: what hung under the entry cannot follow
                    self.store.drop_under(entry.node)
                self.store.restored_entry(entry, k)
                restored += k
                m += k
                old = lock
                lock = (new_id, cache.inc_lock_ref(new_id))
                cache.dec_lock_ref(old[0], old[1].to_dec_params())
                node_id = new_id
                if k < entry.tokens:
                    break
        finally:
            if lock is not None:
                cache.dec_lock_ref(lock[0], lock[1].to_dec_params())
        return restored

    def _alloc(self, cache: Any, n: int) -> torch.Tensor | None:
        """n device slots, evicting unlocked leaves when free memory is short (SGLang's helper,
        which the rotation resume uses too); None, with nothing evicted, when free and evictable
        memory together are short (an eviction then would empty the cache for a restore that fails,
        again at every step the request waits)."""
        from sglang.srt.mem_cache.common import evict_from_tree_cache

        alloc = cache.token_to_kv_pool_allocator
        if alloc.available_size() + cache.evictable_size() < n:
            return None
        if alloc.available_size() < n:
            evict_from_tree_cache(cache, n)
            if alloc.available_size() < n:
                return None
        return alloc.alloc(n)

    # ---- measurement and checks --------------------------------------------------------------
    def counters(self) -> dict[str, float]:
        s = self.store
        return {"entries": len(s), "host_tokens_used": s.used, "host_tokens_budget": s.budget,
                "demoted": s.demoted, "demoted_tokens": s.demoted_tokens, "restored": s.restored,
                "restored_tokens": s.restored_tokens, "rejected_score": s.rejected_score,
                "rejected_room": s.rejected_room, "host_evicted": s.host_evicted, "dropped": s.dropped,
                "restore_failures": self.restore_failures, "demote_s": self.demote_s, "restore_s": self.restore_s,
                "demote_calls": self.demote_calls, "restore_calls": self.restore_calls}

    def check(self) -> None:
        """The store's invariants, and exactly the live entries' blocks held in the host pool."""
        self.store.check()
        self.engine.check_invariants()
        held = sum(len(e.handle.block_ids) for e in self.store.entries.values() if e.handle is not None)
        assert self.engine.host_pool.allocator.num_used == held, (self.engine.host_pool.allocator.num_used, held)


def _common_prefix(payload: Any, key: Any, offset: int, page: int) -> int:
    """Tokens (whole pages) the demoted node's key shares with key[offset:]."""
    if type(payload.token_ids) is type(key.token_ids) and payload.extra_key == key.extra_key \
            and payload.cache_salt == key.cache_salt:
        return payload.match_at(key, offset, page_size=page)
    if payload.extra_key != key.extra_key or payload.cache_salt != key.cache_salt:
        return 0
    a, b = list(payload.raw_token_ids()), list(key.raw_token_ids()[offset:])
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n // page * page

