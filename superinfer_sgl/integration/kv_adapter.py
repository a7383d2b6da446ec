"""Adapter from SGLang's device KV pool to DuplexKV's sglang-free DevicePoolView (which pools rotate,
and which buffers are copied of each: duplexkv/pool_layout.py)."""

from __future__ import annotations

from typing import Any

from ..duplexkv.device_pool import DevicePoolView
from ..duplexkv.pool_layout import UnrotatablePool, layout_of


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
