"""Rotating one request's KV out of SGLang's device pool and back in.

Out: copy the KV of every token before the last output token (that token is the next decode input,
so its KV may still be in flight under the overlap scheduler and is recomputed on resume), then
release the request exactly as SGLang's retraction does (slots freed, radix locks dropped).

In: allocate device slots, copy the KV back, insert it into the radix tree under a lock of ours and
requeue the request: SGLang's prefill path then matches the whole restored prefix and extends only
the last output token. The lock keeps eviction away until the request is admitted and holds its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..duplexkv.engine import HostKV, RotationEngine
from ..duplexkv.host_pool import HostPoolFull


@dataclass
class RotaryEntry:
    """A rotated-out request and where its KV lives in the host pool."""

    req: Any
    host_kv: HostKV
    paused_at: float
    paused_iter: int = 0


def restorable_tokens(req: Any) -> int:
    """Tokens whose KV is final: all but the last output token (the next decode input)."""
    return len(req.origin_input_ids) + len(req.output_ids) - 1


def eager_sync(sched: Any, req: Any, engine: RotationEngine, max_blocks: int | None) -> None:
    """Copy the request's newly filled blocks to host in the background (CPU: now). Safe to call
    before the next batch is built: every token before the last output token was written by a
    forward pass whose results SGLang has already processed."""
    engine.track(req.rid)
    row = sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    engine.sync_full_blocks(req.rid, row, restorable_tokens(req), max_blocks=max_blocks)


def can_rotate(req: Any) -> bool:
    kv = req.kv
    n = restorable_tokens(req)
    return bool(req.output_ids) and kv.holds_kv and kv.kv_allocated_len >= n > 0 and not req.finished()


def rotate_out(sched: Any, req: Any, engine: RotationEngine, now: float) -> RotaryEntry | None:
    """Move `req`'s KV to host and free its device slots. Returns None when the host pool is full
    (the caller then falls back to SGLang's retract-and-recompute)."""
    from sglang.srt.managers.schedule_batch import release_req

    n = restorable_tokens(req)
    row = sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    engine.track(req.rid)  # idempotent: eager sync may not have reached this request yet
    try:
        # Blocks the eager sync already copied are reused; only the unsynced tail moves now.
        host_kv = engine.save_request(req.rid, row, n)
    except HostPoolFull:
        return None
    _release(sched, req, release_req)
    return RotaryEntry(req=req, host_kv=host_kv, paused_at=now)


def retract_for_recompute(sched: Any, req: Any) -> None:
    """SGLang's own fallback: free the KV and requeue the request to be recomputed."""
    from sglang.srt.managers.schedule_batch import release_req

    _release(sched, req, release_req)
    sched._add_request_to_queue(req, is_retracted=True)


def _release(sched: Any, req: Any, release_req: Any) -> None:
    release_req(
        req=req,
        remaing_req_count=0,
        req_to_token_pool=sched.req_to_token_pool,
        token_to_kv_pool_allocator=sched.token_to_kv_pool_allocator,
        tree_cache=sched.tree_cache,
        hisparse_coordinator=None,
        offload_kv=False,
    )


def resume(sched: Any, entry: RotaryEntry, engine: RotationEngine) -> tuple[bool, Any]:
    """Bring `entry`'s KV back into the radix tree. Returns (ok, our tree lock); ok is False when
    device memory cannot be had right now (the entry stays rotary, nothing changed)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.common import evict_from_tree_cache
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tree, alloc = sched.tree_cache, sched.token_to_kv_pool_allocator
    req, n = entry.req, entry.host_kv.num_tokens
    page = alloc.page_size
    n_aligned = n // page * page  # a partial last page is recomputed by the extend instead
    if n_aligned == 0:
        engine.keep_as_mirror(req.rid, entry.host_kv, valid_tokens=0)
        return True, None
    if alloc.available_size() < n_aligned:
        evict_from_tree_cache(tree, n_aligned - alloc.available_size())
    slots = alloc.alloc(n_aligned)
    if slots is None:
        return False, None
    engine.load(_prefix(entry.host_kv, n_aligned) if n_aligned < n else entry.host_kv, slots)
    tokens = (req.origin_input_ids + req.output_ids)[:n_aligned]
    key = RadixKey(tokens, req.extra_key, cache_salt=req.cache_salt)
    # prev_prefix_len=0: the tree frees our copies of any tokens it already held (duplicates).
    result = tree.insert(InsertParams(key=key, value=slots.to(torch.int64), prev_prefix_len=0))
    # The restored blocks become the request's eager mirror, so rotating it out again moves only
    # new tokens. Where the tree kept its own copy of a prefix, the device bytes are the tree's,
    # which we cannot vouch for: keep no mirror then.
    engine.keep_as_mirror(req.rid, entry.host_kv, valid_tokens=n_aligned if result.prefix_len == 0 else 0)
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens, req.extra_key, cache_salt=req.cache_salt)))
    return True, tree.lock(match.last_device_node)


def _prefix(host_kv: HostKV, n: int) -> HostKV:
    blocks = -(-n // host_kv.block_tokens)
    return HostKV(host_kv.block_ids[:blocks], n, host_kv.block_tokens)


def device_kv_digest(sched: Any, req: Any, n: int) -> str:
    """SHA-256 of the raw bytes of a request's first n KV tokens on the device (debug check)."""
    import hashlib

    return hashlib.sha256(device_kv_bytes(sched, req, n)).hexdigest()


def device_kv_bytes(sched: Any, req: Any, n: int) -> bytes:
    """Raw bytes of a request's first n KV tokens on the device, all layers, K then V."""
    kvcache = sched.token_to_kv_pool_allocator.get_kvcache()
    slots = sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    parts = []
    for layer in range(kvcache.layer_num):
        k, v = kvcache.get_kv_buffer(layer + kvcache.start_layer)
        parts += [k[slots].contiguous().view(torch.uint8), v[slots].contiguous().view(torch.uint8)]
    return b"".join(p.cpu().numpy().tobytes() for p in parts)
