"""Adapter from SGLang's device KV pool to DuplexKV's sglang-free DevicePoolView (which pools rotate,
and which buffers are copied of each: duplexkv/pool_layout.py), and the SGLang side of rotating a
sliding-window pool (`SWAWindowRotation`: the window sub-pool's slots, the full-to-window map and the
radix tree's window boundary)."""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import torch

from ..duplexkv.device_pool import DevicePoolView
from ..duplexkv.pool_layout import (HostWindow, SWALayout, UnrotatablePool, WindowNotRestorable, layout_of,
                                    load_window, save_window, swa_layout_of, unsupported_reason, window_start)

__all__ = ["HostWindow", "SWAWindowRotation", "UnsupportedKVPool", "WindowNotRestorable", "device_pool_view",
           "kv_pool_name", "scheduler_pool_view", "window_rotation"]


class UnsupportedKVPool(RuntimeError):
    """Rotation cannot move this KV pool (the message names its class and why: SWA, hybrid linear,
    DSA, HND, a quantized pool with scale buffers such as FP4, ...). The runtime turns rotation off
    and the startup handshake reports it."""


def device_pool_view(kvcache: Any) -> DevicePoolView:
    try:
        layout = layout_of(kvcache)
    except UnrotatablePool as exc:
        raise UnsupportedKVPool(str(exc)) from None
    return DevicePoolView.from_layout(layout, kvcache)


def kv_pool_name(kvcache: Any) -> str:
    """The pool class as the handshake names it."""
    return type(kvcache).__name__


def scheduler_pool_view(sched: Any) -> DevicePoolView:
    """What the rotation engine moves of a scheduler's KV pool: the pool (`device_pool_view`), or for
    an SWAKVPool its full-attention sub-pool, the window rows going through `window_rotation(sched)`.
    UnsupportedKVPool names the class and why when it cannot rotate."""
    kvcache = sched.token_to_kv_pool_allocator.get_kvcache()
    name = kv_pool_name(kvcache)
    if name != "SWAKVPool":
        return device_pool_view(kvcache)
    why = unsupported_reason(kvcache)  # the SWA variants DuplexKV cannot rotate (pool_layout.swa_why_not)
    if why is not None:
        raise UnsupportedKVPool(why)
    tree = sched.tree_cache
    supports_swa = getattr(tree, "supports_swa", None)
    if not callable(supports_swa) or not supports_swa():
        raise UnsupportedKVPool(f"{name}: the radix tree ({type(tree).__name__}) has no sliding-window component to "
                                "hold a resumed request's window tombstones; rotation is off")
    try:
        return window_rotation(sched).device_pool_view()  # type: ignore[union-attr]
    except (UnrotatablePool, AttributeError) as exc:  # e.g. an allocator without the two sub-allocators
        raise UnsupportedKVPool(f"{name}: its allocator {type(sched.token_to_kv_pool_allocator).__name__} "
                                f"cannot rotate the window ({exc}); rotation is off") from None


def save_windows(sched: Any, outs: list[tuple[Any, torch.Tensor, int]]) -> tuple[list[HostWindow | None], set[int]]:
    """Rotate-out, before the release: for each (request, full-slot row, tokens) the window rows of a
    sliding-window pool's request (None for other pools), in order, for the requests whose window can
    be saved; and the ids of those whose window has a hole (WindowNotRestorable: recompute them)."""
    rot = window_rotation(sched)
    if rot is None:
        return [None] * len(outs), set()
    windows: list[HostWindow | None] = []
    lost: set[int] = set()
    for req, row, n in outs:
        try:
            windows.append(rot.save(row[:n], n))
        except WindowNotRestorable:
            lost.add(id(req))
    return windows, lost


def load_windows(sched: Any, ins: list[tuple[HostWindow | None, torch.Tensor | None]]) -> None:
    """Resume, after the engine's copies into the same slots completed: each saved window into the
    window rows its allocation (`SWAWindowRotation.alloc`) mapped."""
    rot = window_rotation(sched)
    for window, slots in ins:
        if rot is not None and window is not None and slots is not None:
            rot.load(window, slots)


_WINDOWS: weakref.WeakKeyDictionary[Any, SWAWindowRotation] = weakref.WeakKeyDictionary()


def window_rotation(sched: Any) -> SWAWindowRotation | None:
    """The window side of the scheduler's pool when it is a sliding-window one (its allocator keeps a
    full-to-window map), else None (every other pool: the rotation path is unchanged). One per
    allocator."""
    alloc = sched.token_to_kv_pool_allocator
    if getattr(alloc, "full_to_swa_index_mapping", None) is None:
        return None
    rot = _WINDOWS.get(alloc)
    if rot is None:
        rot = _WINDOWS[alloc] = SWAWindowRotation.for_scheduler(sched)
    return rot


class SWAWindowRotation:
    """Rotating requests of a sliding-window model (SGLang's SWAKVPool + SWATokenToKVPoolAllocator).

    The engine moves the full-attention sub-pool over the request's slots (`device_pool_view`), like
    any MHA pool. This class moves the rest, synchronously on the current stream:

    out  `save(slots, n)`: the window rows of tokens [start, n), start = `window_start` (the last run of
         tokens the allocator still maps to window rows, no earlier than SGLang's own retention
         boundary for `retain` = the tree's swa_retain_window). Tokens before it left the window:
         not copied. Then the request is released as SGLang's retraction does (release_req frees the
         full slots, and the window slots it still holds).
    in   `alloc(n, start)`: full slots for n tokens and window slots for [start, n) only, the map
         set for those and 0 (no window row, SGLang's evicted marker) for the rest, exactly as
         SGLang's own restore of a retracted request (alloc_extend_swa_tail) leaves it; then the
         engine loads the full rows and `load(window, slots)` the window rows; then
         `insert_params(key, slots, start)` puts them in the radix tree with the SWA evicted length
         `start`, so [0, start) become window tombstones and the request's admission matches the
         restored prefix with its live window, and never reads a window row before `start`.
    `free(slots, start)` gives back what `alloc` took (a resume that did not happen)."""

    def __init__(self, allocator: Any, retain: int | None = None) -> None:
        self.allocator = allocator
        self.layout: SWALayout = swa_layout_of(allocator.get_kvcache())  # UnrotatablePool: refused
        if self.layout.mapping is not getattr(allocator, "full_to_swa_index_mapping", None):
            raise UnrotatablePool(f"{type(allocator).__name__}: its full-to-window map is not the pool's")
        self.retain = retain
        self.page_size = int(allocator.page_size)

    @classmethod
    def for_scheduler(cls, sched: Any) -> SWAWindowRotation:
        tree = sched.tree_cache
        return cls(sched.token_to_kv_pool_allocator, getattr(tree, "sliding_window_size", None))

    def device_pool_view(self) -> DevicePoolView:
        """What the engine moves: the full-attention sub-pool, indexed by the request's slots."""
        return DevicePoolView.from_layout(self.layout.full, self.allocator.get_kvcache().full_kv_pool)

    # ---- out
    def window_start(self, slots: torch.Tensor, num_tokens: int) -> int:
        return window_start(self.layout.mapping, slots, num_tokens, self.page_size, self.retain)

    def save(self, slots: torch.Tensor, num_tokens: int, pin: bool = False) -> HostWindow:
        """The window rows of a running request's first num_tokens tokens, on host (WindowNotRestorable:
        a hole inside its window; recompute it instead). With the tree's retention window known, a token
        without a window row from SGLang's own retention boundary on is such a hole: SGLang's decode
        frees below floor_page(num_tokens - ceil_page(max(window, page))) for pre_len = seqlen - 1, the
        tokens the runtime saves, and its tree matches a restored prefix only with that window live."""
        start = self.window_start(slots, num_tokens)
        if self.retain is not None:
            page, n = self.page_size, int(num_tokens)
            boundary = max(0, n - -(-max(int(self.retain), page) // page) * page) // page * page
            if start > boundary:
                raise WindowNotRestorable(f"tokens [{boundary}, {start}) inside the window have no window row")
        return save_window(self.layout, slots, num_tokens, start, pin)

    # ---- in
    def alloc(self, num_tokens: int, start: int) -> torch.Tensor | None:
        """Full slots for num_tokens tokens, with window rows for tokens [start, num_tokens) only; None
        (nothing taken) when either sub-pool lacks room. Page size > 1: both bounds must be
        page-aligned (a resume restores whole pages; SGLang frees window rows by whole pages)."""
        n, page = int(num_tokens), self.page_size
        if not 0 <= start <= n or n % page or start % page:
            raise ValueError(f"window [{start}, {n}) not page-aligned (page {page})")
        full_alloc, window_alloc = self.allocator.full_attn_allocator, self.allocator.swa_attn_allocator
        if n > full_alloc.available_size() or n - start > window_alloc.available_size():
            return None
        slots = full_alloc.alloc(n) if n else torch.empty(0, dtype=torch.int64)
        if slots is None:
            return None
        rows = window_alloc.alloc(n - start) if n > start else torch.empty(0, dtype=torch.int64)
        if rows is None:
            full_alloc.free(slots)
            return None
        slots = slots.to(torch.int64)
        self.allocator.clear_full_to_swa_mapping(slots[:start])  # freed full slots are unmapped already
        self.allocator.set_full_to_swa_mapping(slots[start:], rows)
        return slots

    def load(self, window: HostWindow, slots: torch.Tensor) -> None:
        load_window(self.layout, window, slots)

    def free(self, slots: torch.Tensor, start: int) -> None:
        """Give back a resume's slots: window rows and their map entries of [start, n), then every full
        slot (as SGLang's free_kv_row_segments frees a row whose prefix has no window rows)."""
        slots = slots.to(torch.int64)
        if start < slots.numel():
            self.allocator.free_swa_segment(slots[start:], start_pos=start)
        self.allocator.free_full(slots)

    def alloc_evicting(self, tree: Any, num_tokens: int, start: int, evict: bool) -> torch.Tensor | None:
        """`alloc`; when it does not fit and `evict`, first evict from the tree what each sub-pool lacks
        (full slots for every token, window rows for [start, n) only)."""
        slots = self.alloc(num_tokens, start)
        if slots is not None or not evict or not tree.supports_prefix_sharing():
            return slots
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        full = max(0, num_tokens - self.allocator.full_attn_allocator.available_size())
        window = max(0, num_tokens - start - self.allocator.swa_attn_allocator.available_size())
        tree.evict_for_alloc(EvictParams(num_tokens=full, swa_num_tokens=window))
        return self.alloc(num_tokens, start)

    # ---- the KV byte check: full layers over the slots, window layers through the map from `start`
    def kv_planes(self, slots: torch.Tensor, start: int) -> list[torch.Tensor]:
        """Raw bytes of the rows a request reads: every full-attention layer's K and V rows of `slots`,
        then every window layer's K and V rows of slots[start:] through the map. ValueError when a
        token from `start` on has no window row."""
        slots = slots.to(self.layout.mapping.device, torch.int64)
        rows = self.layout.mapping[slots[start:]]
        if bool((rows <= 0).any()):
            raise ValueError(f"a token of [{start}, {slots.numel()}) has no window row")
        full, window = self.layout.full, self.layout.window
        return ([p[slots].contiguous().view(torch.uint8) for p in (*full.k_planes, *full.v_planes)]
                + [p[rows].contiguous().view(torch.uint8) for p in (*window.k_planes, *window.v_planes)])

    def same_rows(self, a: torch.Tensor, b: torch.Tensor, start: int) -> bool:
        """Whether slots `a` and `b` hold byte-identical KV for what a request reads: full-attention
        layers for every token, window layers for tokens [start, n) (False when `a` lacks a window
        row there)."""
        try:
            pa, pb = self.kv_planes(a, start), self.kv_planes(b, start)
        except ValueError:
            return False
        return all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))

    def insert_params(self, key: Any, slots: torch.Tensor, start: int) -> Any:
        """SGLang's InsertParams for the restored prefix: tokens [0, start) go in as window tombstones."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams
        from sglang.srt.mem_cache.unified_cache.components import ComponentType

        params = InsertParams(key=key, value=slots.to(torch.int64), prev_prefix_len=0)
        params.set_evicted_seqlen(ComponentType.SWA, start)
        return params


def device_kv_digest(sched: Any, req: Any, n: int) -> str:
    """SHA-256 of the raw bytes of a request's first n KV tokens on the device (debug check)."""
    return hashlib.sha256(device_kv_bytes(sched, req, n)).hexdigest()


def device_kv_bytes(sched: Any, req: Any, n: int) -> bytes:
    """Raw bytes of a request's first n KV tokens on the device, all layers, K then V. Sliding-window
    pools: the full-attention layers of every token, then the window layers through the map for the
    tokens from its window start on (what attention reads; tokens before it have no window row)."""
    kvcache = sched.token_to_kv_pool_allocator.get_kvcache()
    slots = sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)
    rot = window_rotation(sched)
    if rot is not None:
        parts = rot.kv_planes(slots, rot.window_start(slots, n))
        return b"".join(p.cpu().numpy().tobytes() for p in parts)
    parts = []
    for layer in range(kvcache.layer_num):
        k, v = kvcache.get_kv_buffer(layer + kvcache.start_layer)
        parts += [k[slots].contiguous().view(torch.uint8), v[slots].contiguous().view(torch.uint8)]
    return b"".join(p.cpu().numpy().tobytes() for p in parts)
