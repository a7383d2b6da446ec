"""What DuplexKV needs to know about the device KV pool, without importing SGLang.

SGLang's MHATokenToKVPool keeps per layer k_buffer[l] and v_buffer[l] of [rows, kv_heads, head_dim]
(views into one (2, rows, H, D) allocation per layer) and uint64 tables of their data pointers;
the one-launch kernels read those tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DevicePoolView:
    k_buffers: list[torch.Tensor]
    v_buffers: list[torch.Tensor]
    k_ptrs: torch.Tensor  # uint64 [layers], on `device`
    v_ptrs: torch.Tensor
    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def __post_init__(self) -> None:
        assert len(self.k_buffers) == len(self.v_buffers) == self.layers >= 1
        shape = self.k_buffers[0].shape
        for buf in (*self.k_buffers, *self.v_buffers):
            assert buf.shape == shape and buf.shape[1:] == (self.kv_heads, self.head_dim), buf.shape
            assert buf.dtype == self.dtype and buf.device == self.device and buf.is_contiguous()
        assert self.k_ptrs.shape == self.v_ptrs.shape == (self.layers,)
        assert self.k_ptrs.device == self.v_ptrs.device == self.device

    @property
    def rows(self) -> int:
        return self.k_buffers[0].shape[0]

    @property
    def layer_shape(self) -> tuple[int, int, int]:
        return (self.rows, self.kv_heads, self.head_dim)

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * self.k_buffers[0].element_size()

    @classmethod
    def from_buffers(cls, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor]) -> DevicePoolView:
        first = k_buffers[0]
        device = first.device
        return cls(
            k_buffers=list(k_buffers),
            v_buffers=list(v_buffers),
            k_ptrs=_pointer_table(k_buffers, device),
            v_ptrs=_pointer_table(v_buffers, device),
            layers=len(k_buffers),
            kv_heads=first.shape[1],
            head_dim=first.shape[2],
            dtype=first.dtype,
            device=device,
        )

    @classmethod
    def from_sglang(cls, pool: Any) -> DevicePoolView:
        """Duck-typed view of an SGLang MHATokenToKVPool (k_buffer, v_buffer, k_data_ptrs, v_data_ptrs).

        Only the NHD token-slot layout ([rows, H, D] per layer) without scale buffers is supported
        (`unsupported_reason` says why another is not). With fp8 KV, SGLang stores uint8
        (store_dtype) and so does this view; the host pool must use the same dtype."""
        reason = unsupported_reason(pool)
        if reason is not None:
            raise ValueError(reason)
        view = cls.from_buffers(pool.k_buffer, pool.v_buffer)
        view.k_ptrs, view.v_ptrs = pool.k_data_ptrs, pool.v_data_ptrs  # share SGLang's own tables
        view.__post_init__()
        return view

    @classmethod
    def synthetic(
        cls,
        rows: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> DevicePoolView:
        """A pool laid out like MHATokenToKVPool, for tests and benchmarks (contents uninitialised)."""
        per_layer = [torch.empty((2, rows, kv_heads, head_dim), dtype=dtype, device=device) for _ in range(layers)]
        return cls.from_buffers([kv[0] for kv in per_layer], [kv[1] for kv in per_layer])


def unsupported_reason(pool: Any) -> str | None:
    """Why DuplexKV cannot rotate this SGLang KV pool, or None when it can. Duck-typed (no SGLang
    import): the pool's layout label, its per-layer buffers' shape, and its scale buffers.

    A pool with scale buffers (FP4 KV: packed codes plus per-16-value scales in separate tensors)
    would be rotated without its scales and come back as different numbers: refused, not moved.
    HND ([pages, heads, page, dim] per layer) and other paged layouts are not token-slot rows."""
    k = getattr(pool, "k_buffer", None)
    if not isinstance(k, list) or not k or not isinstance(getattr(pool, "v_buffer", None), list):
        return f"{type(pool).__name__} has no per-layer k_buffer/v_buffer lists (MLA, hybrid, ...)"
    scales = [name for name in SCALE_BUFFERS if getattr(pool, name, None) is not None]
    if scales:
        return (f"the KV cache is quantized with scale buffers ({', '.join(scales)}; e.g. FP4 KV): rotation "
                "would move the codes without their scales, so it is off (recompute only). Serve with a "
                "bf16/fp16/fp8 KV cache to rotate.")
    layout = getattr(pool, "kv_cache_layout", None) or "nhd"
    if layout != "nhd" or k[0].dim() != 3:
        return (f"the {layout!r} KV layout (per-layer shape {tuple(k[0].shape)}) is unsupported: DuplexKV "
                "moves NHD token-slot rows [rows, heads, dim] (unset SGLANG_USE_HND_KVCACHE to rotate)")
    return None


# Tensors that quantized SGLang KV pools keep beside the codes (memory_pool.py, 0.5.23).
SCALE_BUFFERS = ("k_scale_buffer", "v_scale_buffer", "native_k_scale_buffer", "native_v_scale_buffer")


def _pointer_table(buffers: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64, device=device)
