"""Adapter from SGLang's MHATokenToKVPool to DuplexKV's sglang-free DevicePoolView."""

from __future__ import annotations

from typing import Any

import torch

from ..duplexkv.device_pool import DevicePoolView, unsupported_reason


class UnsupportedKVPool(RuntimeError):
    """Rotation cannot move this KV pool (not per-layer NHD token rows: MLA, hybrid, HND; or a
    quantized pool with scale buffers such as FP4). The runtime turns rotation off and says why."""


def device_pool_view(kvcache: Any) -> DevicePoolView:
    reason = unsupported_reason(kvcache)
    if reason is not None:
        raise UnsupportedKVPool(reason)
    k, v = kvcache.k_buffer, kvcache.v_buffer
    k_ptrs = getattr(kvcache, "k_data_ptrs", None)
    v_ptrs = getattr(kvcache, "v_data_ptrs", None)
    if k_ptrs is None or v_ptrs is None:
        k_ptrs = torch.tensor([b.data_ptr() for b in k], dtype=torch.uint64, device=k[0].device)
        v_ptrs = torch.tensor([b.data_ptr() for b in v], dtype=torch.uint64, device=v[0].device)
    _, heads, dim = k[0].shape
    return DevicePoolView(
        k_buffers=list(k), v_buffers=list(v), k_ptrs=k_ptrs, v_ptrs=v_ptrs,
        layers=len(k), kv_heads=heads, head_dim=dim, dtype=k[0].dtype, device=k[0].device,
    )
