"""Rotating requests' KV out of SGLang's device pool and back in, one scheduling step at a time.

Out: copy the KV of every token before the last output token (that token is the next decode input,
so its KV may still be in flight under the overlap scheduler and is recomputed on resume), then
release the request exactly as SGLang's retraction does (slots freed, radix locks dropped).

In: allocate device slots, copy the KV back, insert it into the radix tree under a lock of ours and
requeue the request: SGLang's prefill path then matches the whole restored prefix and extends only
the last output token. The lock keeps eviction away until the request is admitted and holds its own.
A step's outs and ins are one `RotationEngine.rotate` call (`rotate_step`): on a GPU, both at once.

Sliding-window pools (SWAKVPool, `kv_adapter.window_rotation`): the engine moves the full-attention
sub-pool; the window rows of the tokens still in the window are saved before the release and kept
with the rotary entry (`HostWindow`), and a resume allocates window rows for those tokens only, loads
them after the engine's copies and inserts with SGLang's SWA evicted length (docs/models.md,
"Sliding-window pools"). A window that cannot be saved is recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..duplexkv.by_format import EnginesByFormat
from ..duplexkv.engine import HostKV, RotateIn, RotateOut, RotationEngine
from ..duplexkv.host_pool import HostPoolFull
from ..duplexkv.quant import LOSSY_FORMATS
from ..duplexkv.streams import CopyEvent, RotationHandle
from . import copy_metrics, kv_adapter
from .kv_adapter import HostWindow, window_rotation


@dataclass
class RotationStats:
    """The runtime's counters (integration/metrics.py exports them)."""

    rotations_out: int = 0
    resumes: int = 0
    recompute_fallbacks: int = 0
    sglang_retractions: int = 0
    shortages: dict[str, int] = field(default_factory=dict)  # decode_shortage.py: rotated, by answer
    forced_rotations: int = 0
    aborted_rotary: int = 0
    kv_verified: int = 0
    kv_mismatches: int = 0
    kv_unverified: int = 0  # admission matched less than the digest covers: the rest is recomputed
    duplex_steps: int = 0  # steps whose one rotate call carried both outs and ins
    prefetches: int = 0
    prefetch_hits: int = 0  # resumes that found their KV already prefetched
    prefetch_cancelled: int = 0
    decisions: int = 0
    contended_decisions: int = 0
    prefills_alone: int = 0  # prefill batches run unmixed beside running requests (--mix-prefill)
    chunk_room_rotations: int = 0  # rotated out so that a split prompt's next chunk fits (chunk_room.py)


@dataclass
class RotaryEntry:
    """A rotated-out request and where its KV lives in the host pool."""

    req: Any
    host_kv: HostKV
    paused_at: float
    paused_iter: int = 0
    prefetch_tried: bool = False  # prefetched once this stint already (a miss is not chased again)
    window: HostWindow | None = None  # sliding-window pools: its window rows (dropped with the entry)


@dataclass
class Incoming:
    """One resume: the page-aligned part of the entry's KV that goes back through the radix tree (a
    partial last page is recomputed by the extend instead) and the device slots it goes into."""

    entry: RotaryEntry
    host_kv: HostKV
    slots: torch.Tensor | None = None  # None until allocated; stays None when there is nothing to load
    window: HostWindow | None = None  # sliding-window pools: the entry's window cut to host_kv's tokens

    @property
    def ready(self) -> bool:
        return self.slots is not None or self.host_kv.num_tokens == 0

    @property
    def window_start(self) -> int:
        """First token with a window row (0: every token has one, or not a sliding-window pool)."""
        return 0 if self.window is None else self.window.start


@dataclass
class Prefetched:
    """Slots we hold for a rotary request whose KV is being copied back ahead of its resume."""

    host_kv: HostKV  # exactly the Incoming.host_kv its resume will load
    slots: torch.Tensor
    handle: RotationHandle
    window_start: int = 0  # sliding-window pools: window rows were allocated from this token on


@dataclass
class StepResult:
    rotated: list[RotaryEntry] = field(default_factory=list)
    recompute: list[Any] = field(default_factory=list)  # host pool full: released and requeued
    resumed: list[tuple[Incoming, Any]] = field(default_factory=list)  # with our tree lock
    deferred: list[Incoming] = field(default_factory=list)  # no device memory now: still rotary


def restorable_tokens(req: Any) -> int:
    """Tokens whose KV is final: all but the last output token (the next decode input)."""
    return len(req.origin_input_ids) + len(req.output_ids) - 1


def adoptable_tokens(req: Any, n: int) -> int:
    """How many of a resumed request's first n restored tokens SGLang's admission takes from the tree.
    A request returning logprobs is matched only up to its logprob_start_len (SGLang sets it to the
    prompt's length when a client asks for output logprobs: Req._compute_max_prefix_len) and extends
    the rest again, so its restored decode tokens are recomputed, not read."""
    start = getattr(req, "logprob_start_len", -1)
    if getattr(req, "return_logprob", False) and start is not None and start >= 0:
        return min(n, start)
    return n


def eager_sync(sched: Any, req: Any, engine: RotationEngine, max_bytes: int | None) -> None:
    """Copy the request's newly filled blocks to host in the background (CPU: now), at most
    `max_bytes` of its format's blocks. Safe to call before the next batch is built: every token
    before the last output token was written by a forward pass whose results SGLang has processed."""
    track(engine, req)
    row = sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    own = engine.engines[engine.format_of(req.rid)] if isinstance(engine, EnginesByFormat) else engine
    limit = None if max_bytes is None else max_bytes // own.host_pool.bytes_per_block
    engine.sync_full_blocks(req.rid, row, restorable_tokens(req), max_blocks=limit)
    copy_metrics.publish(engine.copy_timer)  # rotation copies of earlier steps, read as they finished


def track(engine: Any, req: Any) -> None:
    """engine.track; with one engine per KV precision (EnginesByFormat), at the request's class's."""
    if not isinstance(engine, EnginesByFormat):
        engine.track(req.rid)
        return
    params = getattr(req.sampling_params, "custom_params", None)
    cls = params.get("slo_class") if isinstance(params, dict) else None
    engine.track_class(req.rid, cls if isinstance(cls, str) else None)


def can_rotate(req: Any) -> bool:
    kv, n = req.kv, restorable_tokens(req)  # not `to_finish`: an abort ends at the next result, not on host
    return (bool(req.output_ids) and kv.holds_kv and kv.kv_allocated_len >= n > 0 and not req.finished()
            and getattr(req, "to_finish", None) is None)


# ---- one step: every out and every in through one engine.rotate call ---------------------------
def rotate_step(sched: Any, engine: RotationEngine, outs: list[Any], ins: list[Incoming], now: float) -> StepResult:
    """Rotate `outs` (running requests, already out of the running batch) to host and bring `ins`
    back, as one engine.rotate call. Outs that do not fit in the host pool fall back to recompute;
    ins that find no device memory stay rotary (`deferred`)."""
    windows, lost = save_windows(sched, outs)  # before anything is released (sliding-window pools)
    movable = [req for req in outs if id(req) not in lost]
    items = [out_item(sched, req, engine) for req in movable]
    released = _give_slots(sched, outs, ins)
    ready = [inc for inc in ins if inc.ready]
    handle, went = _rotate(engine, items, ready, forward_fence(sched) if ready else [], in_after_out=released)
    # The next forward (launched after the scheduling stream's work) must not read a slot still being
    # written nor overwrite one still being read; neither may anything else queued on this stream.
    handle.wait()
    if not released:
        for req in outs:
            release(sched, req)
    kv_adapter.load_windows(sched, [(inc.window, inc.slots) for inc in ready])  # after the engine's copies
    result = StepResult(deferred=[inc for inc in ins if not inc.ready])
    saved = {o.rid: hk for o, hk in zip(went, handle.saved)}
    for req, window in zip(movable, windows):
        if req.rid in saved:
            result.rotated.append(RotaryEntry(req=req, host_kv=saved[req.rid], paused_at=now, window=window))
        else:  # the host pool could not take it
            _recompute(sched, engine, req, result)
    for req in outs:
        if id(req) in lost:  # its window could not be saved losslessly
            _recompute(sched, engine, req, result)
    result.resumed = [(inc, insert_restored(sched, inc, engine)) for inc in ready]
    copy_metrics.publish(engine.copy_timer)
    return result


def _recompute(sched: Any, engine: RotationEngine, req: Any, result: StepResult) -> None:
    engine.untrack(req.rid)  # recomputed KV may differ in its last bits from a mirror
    sched._add_request_to_queue(req, is_retracted=True)
    result.recompute.append(req)


def save_windows(sched: Any, outs: list[Any]) -> tuple[list[HostWindow | None], set[int]]:
    """kv_adapter.save_windows of the outs' restorable tokens: windows in order, lost ones by id."""
    rows = sched.req_to_token_pool.req_to_token
    return kv_adapter.save_windows(sched, [(req, rows[req.kv.req_pool_idx], restorable_tokens(req)) for req in outs])


def _give_slots(sched: Any, outs: list[Any], ins: list[Incoming]) -> bool:
    """Allocate the ins' device slots, first from memory that was already free: such slots cannot be
    anything an out copy reads, so both directions can run at once. Ins that need more get it after
    the outs are released (and evicting), which is then done here: returns True, and their copies
    must be ordered after the out copies."""
    for inc in ins:
        alloc_incoming(sched, inc, evict=False)
    late = [inc for inc in ins if not inc.ready]
    if not late:
        return False
    for req in outs:
        release(sched, req)
    for inc in late:
        alloc_incoming(sched, inc, evict=True)
    return True


def _rotate(engine: RotationEngine, outs: list[RotateOut], ins: list[Incoming], fence: list[CopyEvent],
            in_after_out: bool) -> tuple[RotationHandle, list[RotateOut]]:
    """engine.rotate, dropping outs from the end while the host pool cannot take them (a failed
    attempt changes nothing; with a pool per format, the last out of the full one's format). Ins
    allocate no host blocks, so they always go. Returns the handle and the outs that went, in
    handle.saved's order."""
    inn = [RotateIn(inc.host_kv, inc.slots) for inc in ins if inc.slots is not None]
    while True:
        try:
            return engine.rotate(out=outs, inn=inn, in_after=fence, in_after_out=in_after_out), outs
        except HostPoolFull as full:
            if not outs:
                raise
            fmt = full.kv_format
            i = max((i for i, o in enumerate(outs) if fmt is None or engine.format_of(o.rid) == fmt),
                    default=len(outs) - 1)
            outs = outs[:i] + outs[i + 1:]


def out_item(sched: Any, req: Any, engine: RotationEngine) -> RotateOut:
    """What engine.rotate needs to move `req` out. The slot indices are copied now (on the current
    stream, which the copy waits for), so releasing the request's req_to_token row cannot change them."""
    n = restorable_tokens(req)
    row = sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    track(engine, req)  # idempotent: eager sync may not have reached this request yet
    # Blocks the eager sync already copied are reused; only the unsynced tail moves now.
    return RotateOut(req.rid, row[:n].clone(), n)


def incoming(entry: RotaryEntry, page_size: int) -> Incoming:
    n = entry.host_kv.num_tokens // page_size * page_size
    window = None if entry.window is None else entry.window.prefix(n)
    return Incoming(entry, _prefix(entry.host_kv, n) if n < entry.host_kv.num_tokens else entry.host_kv,
                    window=window)


def alloc_incoming(sched: Any, inc: Incoming, evict: bool) -> None:
    if not inc.ready:
        inc.slots = alloc_slots(sched, inc.host_kv.num_tokens, evict, inc.window_start)


def alloc_slots(sched: Any, n: int, evict: bool, window_start: int = 0) -> torch.Tensor | None:
    """n device slots, or None. Without `evict` only memory already free is used (no cached prefix
    is given up). Sliding-window pools: window rows for tokens [window_start, n) only."""
    from sglang.srt.mem_cache.common import evict_from_tree_cache

    rot = window_rotation(sched)
    if rot is not None:
        return rot.alloc_evicting(sched.tree_cache, n, window_start, evict)
    alloc = sched.token_to_kv_pool_allocator
    if alloc.available_size() < n:
        if not evict:
            return None
        # SGLang's helper takes the total to make allocatable, not the shortfall.
        evict_from_tree_cache(sched.tree_cache, n)
    return alloc.alloc(n)


def free_slots(sched: Any, slots: torch.Tensor, window_start: int = 0) -> None:
    rot = window_rotation(sched)
    if rot is not None:
        rot.free(slots, window_start)
    else:
        sched.token_to_kv_pool_allocator.free(slots)


def insert_restored(sched: Any, inc: Incoming, engine: RotationEngine) -> Any:
    """Put restored KV into the radix tree under a lock of ours and return the lock (None when
    nothing was restored: the whole request is recomputed by its extend)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams

    req, n = inc.entry.req, inc.host_kv.num_tokens
    if n == 0:
        engine.keep_as_mirror(req.rid, inc.entry.host_kv, valid_tokens=0)
        return None
    tree = sched.tree_cache
    tokens = (req.origin_input_ids + req.output_ids)[:n]
    held, tree_slots = _tree_prefix(tree, _key(req, tokens))
    # Each TP rank holds other heads, so a byte comparison could come out differently per rank and
    # split their radix trees: with TP > 1 any held prefix counts as different (same on every rank).
    shared_ok = getattr(sched, "tp_size", 1) == 1 and same_kv(sched, tree_slots, inc.slots[:held], inc.window_start)
    if (held and not shared_ok) or _lossy(inc.host_kv, engine):
        # The tree's copy of our prefix was computed by another request since we were rotated out
        # (ours was evicted meanwhile) and may differ in its bits. Lossless means the request reads
        # its own bytes: it continues in a cache namespace of its own (SGLang's cache_salt). KV
        # restored from fp8/int4 blocks always does: in the shared tree, a later request with the
        # same prefix (an exact class's too) would read the approximation.
        req.cache_salt = private_cache_salt(req)
    # prev_prefix_len=0: the tree frees our copies of any tokens it already held (identical bytes;
    # SGLang 0.5.23's default tree, UnifiedRadixCache, does: the legacy RadixCache would not).
    rot = window_rotation(sched)  # sliding-window pools: [0, start) go in as window tombstones
    tree.insert(rot.insert_params(_key(req, tokens), inc.slots, inc.window_start) if rot is not None else
                InsertParams(key=_key(req, tokens), value=inc.slots.to(torch.int64), prev_prefix_len=0))
    # The restored blocks become the request's eager mirror (they equal what it reads now), so
    # rotating it out again moves only new tokens.
    engine.keep_as_mirror(req.rid, inc.entry.host_kv, valid_tokens=n)
    match = tree.match_prefix(MatchPrefixParams(key=_key(req, tokens)))
    return tree.lock(match.last_device_node)


def _lossy(host_kv: HostKV, engine: Any) -> bool:
    """The blocks hold an approximation (fp8/int4): the HostKV's own format where one engine per
    precision stamped it, else the engine's pool's."""
    fmt = host_kv.kv_format or getattr(engine.host_pool, "kv_format", None)
    return fmt in LOSSY_FORMATS


PRIVATE_SALT_TAG = "superinfer-rotary:"


def private_cache_salt(req: Any) -> str:
    salt = req.cache_salt or ""
    return salt if PRIVATE_SALT_TAG in salt else f"{salt}|{PRIVATE_SALT_TAG}{req.rid}"


def _key(req: Any, tokens: list[int]) -> Any:
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return RadixKey(tokens, req.extra_key, cache_salt=req.cache_salt)


def _tree_prefix(tree: Any, key: Any) -> tuple[int, torch.Tensor | None]:
    """How many leading tokens of `key` the tree holds on the device, and their slots."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

    match = tree.match_prefix(MatchPrefixParams(key=key))
    held = int(match.device_prefix_len)
    if held == 0:
        return 0, None
    try:
        return held, tree.path_device_indices(match.last_device_node)[:held]
    except NotImplementedError:  # a cache that cannot say where: treat its bytes as different
        return held, None


def same_kv(sched: Any, a: torch.Tensor | None, b: torch.Tensor, window_start: int = 0) -> bool:
    """Whether two slot lists hold byte-identical KV in every layer (False when `a` is unknown).
    Sliding-window pools: window layers through the map, for tokens from `window_start` on."""
    if a is None or len(a) != len(b):
        return False
    kvcache = sched.token_to_kv_pool_allocator.get_kvcache()
    a, b = a.to(torch.int64), b.to(torch.int64)
    if torch.equal(a, b):
        return True
    rot = window_rotation(sched)
    if rot is not None:
        return rot.same_rows(a, b, window_start)
    for layer in range(kvcache.layer_num):
        for buf in kvcache.get_kv_buffer(layer + kvcache.start_layer):
            if not torch.equal(buf[a].view(torch.uint8), buf[b].view(torch.uint8)):
                return False
    return True


def prefetch(sched: Any, engine: RotationEngine, inc: Incoming) -> Prefetched | None:
    """Allocate slots for `inc` from free memory (never evicting) and start copying its KV there."""
    slots = alloc_slots(sched, inc.host_kv.num_tokens, evict=False, window_start=inc.window_start)
    if slots is None:
        return None
    handle = engine.prefetch(inc.host_kv, slots, in_after=forward_fence(sched))
    return Prefetched(inc.host_kv, slots, handle, inc.window_start)


def cancel_prefetch(sched: Any, engine: RotationEngine, p: Prefetched) -> None:
    """Drop an unused prefetch and give its slots back, once nothing can still be writing them."""
    engine.cancel_prefetch(p.host_kv)
    p.handle.wait()  # whoever gets these slots next is queued after this stream
    free_slots(sched, p.slots, p.window_start)


def forward_fence(sched: Any) -> list[CopyEvent]:
    """Under the overlap scheduler the forward in flight may still write slots freed since it was
    launched (e.g. a released request's next-token slot); a copy into newly allocated slots waits for
    it. Nothing to wait for on a CPU or when the forward runs on the current stream."""
    stream = getattr(sched, "forward_stream", None)
    if stream is None or not torch.cuda.is_available() or not isinstance(stream, torch.cuda.Stream):
        return []
    if stream == torch.cuda.current_stream(stream.device):
        return []
    event = torch.cuda.Event()
    event.record(stream)
    return [event]


# ---- single-request forms ------------------------------------------------------------------------
def rotate_out(sched: Any, req: Any, engine: RotationEngine, now: float) -> RotaryEntry | None:
    """Move one request's KV to host and free its device slots. Returns None, with nothing changed,
    when the host pool is full or a sliding window cannot be saved (the caller then falls back to
    SGLang's retract-and-recompute)."""
    windows, lost = save_windows(sched, [req])
    if lost:
        return None
    window = windows[0]
    try:
        host_kv = engine.save_request(*out_item(sched, req, engine))
    except HostPoolFull:
        return None
    release(sched, req)
    return RotaryEntry(req=req, host_kv=host_kv, paused_at=now, window=window)


def release(sched: Any, req: Any) -> None:
    """Free the request's device slots and radix locks exactly as SGLang's retraction does."""
    from sglang.srt.managers.schedule_batch import release_req

    release_req(
        req=req,
        remaing_req_count=0,
        req_to_token_pool=sched.req_to_token_pool,
        token_to_kv_pool_allocator=sched.token_to_kv_pool_allocator,
        tree_cache=sched.tree_cache,
        hisparse_coordinator=None,
        offload_kv=False,
    )


def _prefix(host_kv: HostKV, n: int) -> HostKV:
    return host_kv.prefix(n)  # same blocks' pool (kv_format)

