"""SGLang's radix tree (UnifiedRadixCache on its Python tree core, CPU, no model) driven request by
request, with or without our --prefix-cache predictive hooks: the engine of the hit-share replay
(bench/prefix_replay.py) and of the tree-level tests (tests/unit/test_prefix_cache_tree.py)."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any


def _wrap(original: Any, hook: Any, kind: str) -> Any:
    if kind == "AFTER":
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            modified = hook(result, *args, **kwargs)
            return modified if modified is not None else result
    elif kind == "BEFORE":
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            hook(*args, **kwargs)
            return original(*args, **kwargs)
    else:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return hook(original, *args, **kwargs)
    return functools.wraps(original)(wrapper)


class HookedTreeCore:
    """Our hooks on SGLang's tree core for the duration of a `with` (restored after); with
    host_tokens > 0 the host tier's too (prefix_host.py)."""

    def __init__(self, host_tokens: int = 0, min_score: float | None = None) -> None:
        self.host_tokens = host_tokens
        self.min_score = min_score

    def __enter__(self) -> "HookedTreeCore":
        from superinfer_patches import resolve

        from . import prefix_cache, prefix_host

        self.saved = []
        if self.min_score is not None:  # the replay's threshold sweep
            self.saved.append((prefix_host, "DEMOTE_MIN_SCORE", prefix_host.DEMOTE_MIN_SCORE))
            prefix_host.DEMOTE_MIN_SCORE = self.min_score
        for target, hook, kind in prefix_cache.hooks("predictive", prefix_cache.PIN_SHARE, self.host_tokens):
            if target == prefix_cache.SELECT_CORE:
                continue
            owner_path, _, attr = target.rpartition(".")
            owner = resolve(owner_path)
            original = owner.__dict__[attr]
            self.saved.append((owner, attr, original))
            setattr(owner, attr, _wrap(original, hook, kind))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, attr, original in reversed(self.saved):
            setattr(owner, attr, original)


def kv_pool(kv_tokens: int, page_size: int = 1, layers: int = 1, heads: int = 1, head_dim: int = 4,
            dtype: Any = None) -> Any:
    """SGLang's MHATokenToKVPool on the CPU (what host demotion copies; tiny by default)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size=kv_tokens, page_size=page_size, dtype=dtype or torch.float32, head_num=heads,
                            head_dim=head_dim, layer_num=layers, device="cpu", enable_memory_saver=False)


def radix_tree(policy: str, kv_tokens: int, tlru: dict[str, int], kvcache: Any = None) -> Any:
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    alloc = TokenToKVPoolAllocator(kv_tokens, torch.float32, "cpu",
                                   kvcache if kvcache is not None else SimpleNamespace(), False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1,
                             tree_components=(ComponentType.FULL,),
                             eviction_policy="lru" if policy == "predictive" else policy,
                             eviction_policy_config=tlru if policy == "tlru" else None)
    params.tree_core_backend = "python"
    cache = UnifiedRadixCache(params)
    return cache, alloc


class TreeReplay:
    """One request at a time through a radix tree of `kv_tokens` slots under `policy`."""

    def __init__(self, policy: str, kv_tokens: int, tlru: dict[str, int], kvcache: Any = None) -> None:
        self.cache, self.alloc = radix_tree(policy, kv_tokens, tlru, kvcache)
        self.now = 0.0
        state = getattr(self.cache.tree_core, "_superinfer_prefix", None)
        if state is not None:
            state.clock = lambda: self.now
        self.prompt = self.cached = 0

    def serve(self, rid: str, ids: list[int], out: list[int], now: float) -> int:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams, MatchPrefixParams
        from sglang.srt.mem_cache.radix_cache import RadixKey
        import torch

        self.now = now
        req = SimpleNamespace(rid=rid, session=None, extra_key=None,
                              sampling_params=SimpleNamespace(custom_params={"slo_class": "interactive"}))
        m = self.cache.match_prefix(MatchPrefixParams(key=RadixKey(list(ids)), req=req))
        hit = m.device_prefix_len
        lock = self.cache.inc_lock_ref(m.last_device_node)
        full = list(ids) + list(out)
        # SGLang's insert frees the slots of a value's already-cached prefix itself, so the value is
        # fresh slots for the whole sequence (briefly twice the prefix, as in the scheduler).
        need = len(full)
        if self.alloc.available_size() < need:
            self.cache.evict(EvictParams(num_tokens=need - self.alloc.available_size()))
        new = self.alloc.alloc(need) if self.alloc.available_size() >= need else None
        self.prompt += len(ids)
        self.cached += hit
        if new is not None:
            self.cache.insert(InsertParams(key=RadixKey(full), value=new.to(torch.int64)))
        self.cache.dec_lock_ref(m.last_device_node, lock.to_dec_params())
        return hit
