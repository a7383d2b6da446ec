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

Only these exact classes rotate: a subclass may lay out or quantize its buffers differently
(MHATokenToKVPoolFP4, MHATokenToKVPoolMXFP8, PageMajorMHATokenToKVPool, MLATokenToKVPoolFP4,
DSATokenToKVPool, the Unified* and NPU pools). Every other pool is refused by name with the reason
(`unsupported_reason`); the server then runs RotaSched without rotation (paused requests recompute).
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
_REFUSED = {
    "SWAKVPool": (
        "a sliding-window pool: full-attention and window layers live in two sub-pools with separate slot "
        "spaces (the allocator's full-to-window index map), and the window slots of tokens that left the "
        "window are freed while the request runs; a resume would have to rebuild that map, the request's "
        "SWA evicted length and the radix tree's window tombstones, which DuplexKV does not do"),
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
    if name in _REFUSED:
        return _REFUSED[name]
    if name == "MHATokenToKVPool":
        return _mha_why_not(pool)
    if name == "MLATokenToKVPool":
        return _mla_why_not(pool)
    if hasattr(pool, "full_kv_pool") and hasattr(pool, "swa_kv_pool"):
        return _REFUSED["SWAKVPool"]
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


def _quantized(pool: Any) -> bool:
    try:
        return bool(getattr(pool, "is_quantized_kv_cache", False))
    except AttributeError:  # a pool built without a quant method
        return False


def _dcp_span(pool: Any) -> int:
    """Token ids per stored row (decode context parallelism). SGLang reads it from the published
    parallel config; a pool built outside a server (tests) has none, and no DCP."""
    try:
        return int(getattr(pool, "_write_loc_dcp_span", 1))
    except RuntimeError:
        return 1
