"""What DuplexKV needs to know about the device KV pool, without importing SGLang.

The view is a list of copy pairs ("layers" here): per pair two equally shaped [rows, kv_heads,
head_dim] buffers and uint64 tables of their data pointers, which the one-launch kernels read.
SGLang's MHATokenToKVPool gives one pair per layer (k_buffer[l], v_buffer[l]: views into one
(2, rows, H, D) allocation); MLATokenToKVPool's latent buffers pair up two layers at a time
(pool_layout.py says which pools rotate and how).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from superinfer_sgl.duplexkv.pool_layout import SCALE_BUFFERS, PoolLayout, layout_of, unsupported_reason

__all__ = ["SCALE_BUFFERS", "DevicePoolView", "unsupported_reason"]


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
    kind: str = "mha"  # the pool layout (pool_layout.PoolLayout.kind)

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
    def from_buffers(cls, k_buffers: list[torch.Tensor], v_buffers: list[torch.Tensor],
                     kind: str = "mha") -> DevicePoolView:
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
            kind=kind,
        )

    @classmethod
    def from_sglang(cls, pool: Any) -> DevicePoolView:
        """View of an SGLang KV pool DuplexKV rotates (pool_layout.py: MHATokenToKVPool's K/V rows,
        MLATokenToKVPool's latent rows); pool_layout.UnrotatablePool (a ValueError) naming the pool
        class and why for any other. With fp8 KV, SGLang stores uint8 (store_dtype) and so does this
        view; the host pool must use the same dtype."""
        return cls.from_layout(layout_of(pool), pool)

    @classmethod
    def from_layout(cls, layout: PoolLayout, pool: Any = None) -> DevicePoolView:
        view = cls.from_buffers(list(layout.k_planes), list(layout.v_planes), layout.kind)
        k_ptrs, v_ptrs = getattr(pool, "k_data_ptrs", None), getattr(pool, "v_data_ptrs", None)
        if layout.kind == "mha" and k_ptrs is not None and v_ptrs is not None:
            view.k_ptrs, view.v_ptrs = k_ptrs, v_ptrs  # share SGLang's own tables
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


def _pointer_table(buffers: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    return torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64, device=device)


def check_compatible(dev: DevicePoolView, host: Any) -> None:
    """A host pool (`HostKVPool`) holds blocks of this device pool's shape and dtype."""
    ours = (dev.layers, dev.kv_heads, dev.head_dim, dev.dtype)
    theirs = (host.layers, host.kv_heads, host.head_dim, host.dtype)
    if ours != theirs:
        raise ValueError(f"device pool (layers, kv_heads, head_dim, dtype) {ours} != host pool {theirs}")
