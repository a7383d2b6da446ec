"""DuplexKV: block-first host KV pool and the engine that rotates request KV between device and host."""

from superinfer_sgl.duplexkv.device_pool import DevicePoolView
from superinfer_sgl.duplexkv.engine import TRANSFERS, HostKV, RotationEngine, pick_transfer
from superinfer_sgl.duplexkv.host_pool import BlockAllocator, HostKVPool, HostPinError, HostPoolFull

__all__ = [
    "TRANSFERS",
    "BlockAllocator",
    "DevicePoolView",
    "HostKV",
    "HostKVPool",
    "HostPinError",
    "HostPoolFull",
    "RotationEngine",
    "pick_transfer",
]
