"""DuplexKV: block-first host KV pool and the engine that rotates request KV between device and host."""

from superinfer_sgl.duplexkv.device_pool import DevicePoolView
from superinfer_sgl.duplexkv.eager import EagerMirror
from superinfer_sgl.duplexkv.engine import TRANSFERS, HostKV, RotateIn, RotateOut, RotationEngine, pick_transfer
from superinfer_sgl.duplexkv.host_pool import BlockAllocator, HostKVPool, HostPinError, HostPoolFull
from superinfer_sgl.duplexkv.streams import DONE, CopyEvent, RotationHandle

__all__ = [
    "DONE",
    "TRANSFERS",
    "BlockAllocator",
    "CopyEvent",
    "DevicePoolView",
    "EagerMirror",
    "HostKV",
    "HostKVPool",
    "HostPinError",
    "HostPoolFull",
    "RotateIn",
    "RotateOut",
    "RotationEngine",
    "RotationHandle",
    "pick_transfer",
]
