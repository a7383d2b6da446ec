"""Which SGLang KV pools DuplexKV rotates, and which per-layer buffers it copies of each (no SGLang
import: the pool is read by its class name and attributes).

DuplexKV copies "planes": per-layer buffers [rows, heads, dim], one row per token slot, all of one
shape and dtype, moved in pairs (the transfer paths, the kernels and the host block are built on a
K/V pair per layer). A layout names a pool's planes:

  mha  MHATokenToKVPool: k_buffer[l] and v_buffer[l] are the pair of layer l (NHD rows).
  mla  MLATokenToKVPool: one latent plane per layer, kv_buffer[l] of [rows, 1, kv_lora_rank +
       qk_rope_head_dim] (K is the whole row, V its first kv_lora_rank values: one copy moves both).
       Latent layers 2i and 2i+1 travel as one pair, so a host block holds every latent layer once,
       in layer order, and its size in bytes is block_tokens x layers x row bytes. With an odd
       layer count the last layer is paired with itself: copied twice (1/layers more host bytes and
       link bytes; both copies are equal, so writing it back twice leaves the same bytes).

  swa  SWAKVPool (sliding-window models): two MHATokenToKVPool sub-pools with slot spaces of their own.
       The full-attention sub-pool is indexed by the request's (full) slots, like an mha pool: its
       layout is `SWALayout.full`, moved by the engine for every token. The window sub-pool is
       indexed by `full_to_swa_index_mapping[full slot]` (0: no window slot, SGLang's padding
       row) and holds only the tokens still in the window: `SWALayout.window`, moved by
       `save_window`/`load_window` below for the live suffix of the request only (tokens that left
       the window need no copy; docs/models.md, "Sliding-window pools").

Only these exact classes rotate: a subclass may lay out or quantize its buffers differently
(MHATokenToKVPoolFP4, MHATokenToKVPoolMXFP8, PageMajorMHATokenToKVPool, MLATokenToKVPoolFP4,
DSATokenToKVPool, the Unified* and NPU pools). Every other pool is refused by name with the reason
(`unsupported_reason`); the server then runs RotaSched without rotation (paused requests recompute).
An SWAKVPool rotates through its two layouts (`swa_layout_of`; the runtime drives the window side with
integration/kv_adapter.SWAWindowRotation): `unsupported_reason` names only the SWA pools it cannot
rotate (`swa_why_not`), and `layout_of` gives it no single-index layout (one view would drop the
window layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

# Tensors that quantized SGLang KV pools keep beside the codes (memory_pool.py, 0.5.23).
SCALE_BUFFERS = ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer",
                 "kv_scale_buffer")
ROTATABLE = ("MHATokenToKVPool", "MLATokenToKVPool")
_OFF = "rotation is off (RotaSched still schedules; a paused request is recomputed, not rotated)"

# Pools seen in SGLang 0.5.23 that hold more than token rows of per-layer buffers, and why that stops us.
# (SWAKVPool rotates through SWALayout: only the SWA variants `swa_why_not` names are refused.)
_OTHER_SWA = ("a sliding-window pool of a class DuplexKV does not rotate (it rotates SGLang's SWAKVPool: two "
              "MHATokenToKVPool sub-pools and the allocator's full-to-window map)")
_REFUSED = {
    "HybridLinearKVPool": (
        "a hybrid linear-attention pool: the recurrent (Mamba/linear) state is kept per request, not per "
        "token, and DuplexKV moves token rows only"),
    "DSATokenToKVPool": (
        "an MLA pool with a sparse-attention indexer key cache beside the latent buffers, which DuplexKV "
        "would not move"),
    "NoOpMHATokenToKVPool": "a prefill-only pool that keeps no KV",
}


class UnrotatablePool(ValueError):
    """DuplexKV cannot rotate this KV pool; the message names the pool class and why."""


@dataclass(frozen=True)
class PoolLayout:
    kind: Literal["mha", "mla"]
    pool_class: str
    k_planes: tuple[torch.Tensor, ...]  # the copy pairs' first planes ...
    v_planes: tuple[torch.Tensor, ...]  # ... and their seconds, same length and shape
    model_layers: int  # the pool's own layer count (mla: planes, not pairs)

    @property
    def row_bytes(self) -> int:
        t = self.k_planes[0]
        return t.shape[1] * t.shape[2] * t.element_size()

    @property
    def payload_bytes_per_token(self) -> int:
        """The pool's own bytes per token, what a rotation must preserve (the host stores one more
        latent layer per token when an MLA pool's layer count is odd)."""
        return self.model_layers * self.row_bytes * (2 if self.kind == "mha" else 1)


def layout_of(pool: Any) -> PoolLayout:
    """The planes DuplexKV copies for an SGLang KV pool, or UnrotatablePool naming the class and why."""
    reason = unsupported_reason(pool)
    if reason is not None:
        raise UnrotatablePool(reason)
    name = type(pool).__name__
    if name == "SWAKVPool":
        raise UnrotatablePool(f"{name}: two sub-pools with slot spaces of their own have no single-index layout: "
                              "the engine moves the full-attention sub-pool (swa_layout_of(pool).full, "
                              "kv_adapter.SWAWindowRotation.device_pool_view) and the window rows move by "
                              "save_window/load_window")
    if name == "MLATokenToKVPool":
        planes = list(pool.kv_buffer)
        firsts, seconds = planes[0::2], planes[1::2]
        if len(planes) % 2:
            seconds.append(planes[-1])  # an odd last layer is its own pair (module doc)
        return PoolLayout("mla", name, tuple(firsts), tuple(seconds), len(planes))
    return PoolLayout("mha", name, tuple(pool.k_buffer), tuple(pool.v_buffer), len(pool.k_buffer))


def unsupported_reason(pool: Any) -> str | None:
    """Why DuplexKV cannot rotate this SGLang KV pool (naming its class), or None when it can."""
    name = type(pool).__name__
    why = _why_not(pool, name)
    return None if why is None else f"{name}: {why}; {_OFF}"


def _why_not(pool: Any, name: str) -> str | None:
    scales = [s for s in SCALE_BUFFERS if getattr(pool, s, None) is not None]
    if scales or _quantized(pool):
        return (f"the KV cache is quantized with scale buffers ({', '.join(scales) or 'a quant method'}; e.g. "
                "FP4 KV): rotation would move the codes without their scales (serve with a bf16/fp16/fp8 KV "
                "cache to rotate)")
    if name == "SWAKVPool":
        return swa_why_not(pool)
    if name in _REFUSED:
        return _REFUSED[name]
    if name == "MHATokenToKVPool":
        return _mha_why_not(pool)
    if name == "MLATokenToKVPool":
        return _mla_why_not(pool)
    if hasattr(pool, "full_kv_pool") and hasattr(pool, "swa_kv_pool"):
        return _OTHER_SWA
    return (f"not a pool DuplexKV rotates: it rotates {' and '.join(ROTATABLE)} (per-layer NHD K/V rows, or "
            "one MLA latent row per layer), not subclasses or other layouts")


def _mha_why_not(pool: Any) -> str | None:
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if not isinstance(k, list) or not k or not isinstance(v, list) or len(v) != len(k):
        return "no per-layer k_buffer/v_buffer lists"
    layout = getattr(pool, "kv_cache_layout", None) or "nhd"
    if layout != "nhd" or k[0].dim() != 3:
        return (f"the {layout!r} KV layout (per-layer shape {tuple(k[0].shape)}) is unsupported: DuplexKV "
                "moves NHD token-slot rows [rows, heads, dim] (unset SGLANG_USE_HND_KVCACHE to rotate)")
    return _planes_why_not([*k, *v], "K and V")


def _mla_why_not(pool: Any) -> str | None:
    kv = getattr(pool, "kv_buffer", None)
    if not isinstance(kv, list) or not kv:
        return "no per-layer kv_buffer list"
    if getattr(pool, "use_dsa", False):
        return _REFUSED["DSATokenToKVPool"]
    if getattr(pool, "layer_shard_enabled", False):
        return "its layers are sharded across ranks (not verified with rotation)"
    if _dcp_span(pool) != 1:
        return "decode context parallelism stores one row per several token ids (not verified with rotation)"
    if kv[0].dim() != 3:
        return f"latent buffers of shape {tuple(kv[0].shape)}, not [rows, 1, dim]"
    return _planes_why_not(kv, "latent")


def _planes_why_not(planes: list[torch.Tensor], what: str) -> str | None:
    first = planes[0]
    for p in planes:
        if p.shape != first.shape or p.dtype != first.dtype or p.device != first.device:
            return (f"{what} buffers differ in shape or dtype ({tuple(first.shape)} {first.dtype} vs "
                    f"{tuple(p.shape)} {p.dtype}; e.g. v_head_dim != head_dim): DuplexKV copies equal planes")
        if not p.is_contiguous():
            return f"a non-contiguous {what} buffer (shape {tuple(p.shape)}, stride {p.stride()})"
    return None


# SGLang KV quant methods whose codes are the whole KV (per-tensor scales live on the layer, as
# with fp8 on CUDA): nothing per token besides the K/V rows, so a rotation that moves them is whole
CODES_ONLY_QUANT_METHODS = ("cpu_fp8_e4m3",)


def _quantized(pool: Any) -> bool:
    """A quant method that may keep per-token state DuplexKV does not move."""
    try:
        quantized = bool(getattr(pool, "is_quantized_kv_cache", False))
    except AttributeError:  # a pool built without a quant method
        return False
    return quantized and getattr(getattr(pool, "quant_method", None), "name", None) not in CODES_ONLY_QUANT_METHODS


def _dcp_span(pool: Any) -> int:
    """Token ids per stored row (decode context parallelism). SGLang reads it from the published
    parallel config; a pool built outside a server (tests) has none, and no DCP."""
    try:
        return int(getattr(pool, "_write_loc_dcp_span", 1))
    except RuntimeError:
        return 1


# ---- sliding-window pools (SWAKVPool) -------------------------------------------------------------
class WindowNotRestorable(ValueError):
    """A request's window rows cannot be saved losslessly (a hole inside its window): recompute it."""


@dataclass(frozen=True)
class SWALayout:
    """An SWAKVPool as DuplexKV moves it. `full`: the full-attention sub-pool, rows indexed by the
    request's slots (what the engine moves, for every token). `window`: the sliding-window sub-pool,
    rows indexed by `mapping[slot]`; `mapping[slot] == 0` (SGLang's padding row) means the token has no
    window row: it left the window and SGLang freed it (or never gave it one)."""

    pool_class: str
    full: PoolLayout
    window: PoolLayout
    mapping: torch.Tensor  # SGLang's full_to_swa_index_mapping (int64, on the device; its last entry is -1)
    page_size: int

    @property
    def window_row_bytes(self) -> int:
        """Bytes one token's window rows take (every window layer, K and V)."""
        return self.window.payload_bytes_per_token


@dataclass(frozen=True)
class HostWindow:
    """The window rows of a rotated-out request: tokens [start, num_tokens) of its KV row, every window
    layer's K and V rows in token order (host tensors of the pool's dtype). Tokens before `start` had
    left the window: nothing of theirs is kept, and a resume marks them evicted."""

    start: int
    num_tokens: int
    k: tuple[torch.Tensor, ...]  # per window layer [num_tokens - start, heads, dim]
    v: tuple[torch.Tensor, ...]

    @property
    def rows(self) -> int:
        return self.num_tokens - self.start

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def prefix(self, n: int) -> HostWindow:
        """The window of the first n tokens (a resume that restores a page-aligned prefix); its start
        never passes n (a window entirely past n restores no window row)."""
        if not 0 <= n <= self.num_tokens:
            raise ValueError(f"prefix of {n} tokens of a {self.num_tokens}-token window")
        start = min(self.start, n)
        rows = n - start
        return HostWindow(start, n, tuple(t[:rows] for t in self.k), tuple(t[:rows] for t in self.v))


def swa_layout_of(pool: Any) -> SWALayout:
    """The two sub-pool layouts and the index map of an SWAKVPool, or UnrotatablePool with the reason."""
    name = type(pool).__name__
    why = swa_why_not(pool) if name == "SWAKVPool" else "not an SWAKVPool"
    if why is not None:
        raise UnrotatablePool(f"{name}: {why}; {_OFF}")
    return SWALayout(name, layout_of(pool.full_kv_pool), layout_of(pool.swa_kv_pool),
                     pool.full_to_swa_index_mapping, int(pool.page_size))


def swa_unsupported_reason(pool: Any) -> str | None:
    """Why DuplexKV cannot rotate this SWAKVPool's layout at all (naming the class), or None."""
    why = swa_why_not(pool)
    return None if why is None else f"{type(pool).__name__}: {why}; {_OFF}"


def swa_why_not(pool: Any) -> str | None:
    full, window = getattr(pool, "full_kv_pool", None), getattr(pool, "swa_kv_pool", None)
    if full is None or window is None:
        return "a sliding-window pool without its full_kv_pool/swa_kv_pool sub-pools"
    if getattr(pool, "swa_req_ring_size", None) is not None:
        return "a sliding-window pool with a per-request window ring (addressed by request, not by token slot)"
    if getattr(pool, "request_window", None) is not None or getattr(pool, "swa_uses_full_indices", False):
        return "a sliding-window pool whose window rows are not addressed through the full-to-window map"
    if getattr(pool, "full_layer_nums", 0) == 0:
        return "an all-sliding-window pool (no full-attention sub-pool; its allocator maps slots one to one)"
    if getattr(pool, "full_to_swa_index_mapping", None) is None:
        return "a sliding-window pool whose allocator has not registered the full-to-window map"
    for role, sub in (("full-attention", full), ("window", window)):
        sub_name = type(sub).__name__
        if sub_name != "MHATokenToKVPool":
            return (f"a sliding-window pool whose {role} sub-pool is a {sub_name}: DuplexKV rotates two "
                    "MHATokenToKVPool sub-pools")
        why = _why_not(sub, sub_name)
        if why is not None:
            return f"a sliding-window pool whose {role} sub-pool cannot rotate ({why})"
    return None


def window_start(mapping: torch.Tensor, slots: torch.Tensor, num_tokens: int, page_size: int = 1,
                 retain: int | None = None) -> int:
    """First token of the window a rotated-out request keeps: the start of the last run of tokens that
    still have window rows (`mapping[slot] > 0`), raised to SGLang's own retention boundary when
    `retain` (the tree's swa_retain_window) is given: floor_page(n - ceil_page(max(retain, page))),
    the point below which SGLang frees a running request's window rows itself
    (mem_cache/common.py, free_swa_out_of_window_slots). Tokens before it need no copy. Page-aligned
    (a run starting inside a page starts at the next page: its first rows count as left)."""
    n = int(num_tokens)
    if n == 0:
        return 0
    live = (mapping[slots[:n].to(mapping.device, torch.int64)] > 0).cpu()
    dead = torch.nonzero(~live).flatten()
    start = int(dead[-1]) + 1 if dead.numel() else 0
    start = min(n, -(-start // page_size) * page_size)  # SGLang frees window rows by whole pages
    if retain is not None:
        keep = -(-max(int(retain), page_size) // page_size) * page_size
        start = max(start, max(0, n - keep) // page_size * page_size)
    return start


def save_window(layout: SWALayout, slots: torch.Tensor, num_tokens: int, start: int,
                pin: bool = False) -> HostWindow:
    """Copy the window rows of tokens [start, num_tokens) (slots: the request's full-pool slots) to host,
    byte for byte, and wait. WindowNotRestorable when one of them has no window row."""
    n = int(num_tokens)
    if not 0 <= start <= n <= slots.numel():
        raise ValueError(f"window [{start}, {n}) outside {slots.numel()} slots")
    rows = layout.mapping[slots[start:n].to(layout.mapping.device, torch.int64)]
    if bool((rows <= 0).any()):
        hole = start + int(torch.nonzero(rows <= 0).flatten()[0])
        raise WindowNotRestorable(f"token {hole} inside the window [{start}, {n}) has no window row")

    def host(plane: torch.Tensor) -> torch.Tensor:
        out = torch.empty((n - start, *plane.shape[1:]), dtype=plane.dtype, device="cpu", pin_memory=pin)
        # raw bytes: a copy of values could canonicalize NaN payloads
        out.view(torch.uint8).copy_(plane.view(torch.uint8).index_select(0, rows), non_blocking=pin)
        return out

    k = tuple(host(p) for p in layout.window.k_planes)
    v = tuple(host(p) for p in layout.window.v_planes)
    if pin and layout.mapping.is_cuda:
        torch.cuda.current_stream(layout.mapping.device).synchronize()
    return HostWindow(start, n, k, v)


def load_window(layout: SWALayout, window: HostWindow, slots: torch.Tensor) -> None:
    """Write a saved window back into the window rows that `mapping` now gives slots[start:num_tokens]
    (the resume allocated and mapped them: kv_adapter.SWAWindowRotation.alloc). Tokens before
    `start` must have no window row (mapping 0): attention never reads them, and SGLang treats them as
    evicted."""
    n, start = window.num_tokens, window.start
    if slots.numel() != n:
        raise ValueError(f"{slots.numel()} slots for a {n}-token window")
    idx = slots.to(layout.mapping.device, torch.int64)
    rows = layout.mapping[idx[start:]]
    if bool((rows <= 0).any()) or bool((layout.mapping[idx[:start]] != 0).any()):
        raise ValueError(f"the window slots of tokens [{start}, {n}) are not mapped as allocated "
                         "(only they may have window rows)")
    for plane, saved in (*zip(layout.window.k_planes, window.k), *zip(layout.window.v_planes, window.v)):
        plane.view(torch.uint8).index_copy_(0, rows, saved.view(torch.uint8).to(plane.device,
                                                                               non_blocking=saved.is_pinned()))
