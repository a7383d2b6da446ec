"""Prefetched rotations in: host-to-device copies started before the iteration that needs them.

A record is keyed by the HostKV (a frozen value) and holds one allocator reference on its blocks, so
while it lives no other HostKV can be equal to it: equal key then means the same bytes. It also keeps
the caller's slots tensor alive, so that on CUDA "same tensor memory" means the same slots (comparing
device values would synchronise); CPU slots are compared by value.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from superinfer_sgl.duplexkv.host_pool import BlockAllocator, HostKV
from superinfer_sgl.duplexkv.streams import CopyEvent


@dataclass(frozen=True)
class Prefetch:
    slots: torch.Tensor
    values: torch.Tensor | None  # int64 copy of CPU slots
    event: CopyEvent

    def matches(self, slots: torch.Tensor) -> bool:
        if self.values is not None:
            return slots.device.type == "cpu" and torch.equal(slots.to(torch.int64), self.values)
        return slots is self.slots or _same_memory(slots, self.slots)


class PrefetchTable:
    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self._records: dict[HostKV, Prefetch] = {}

    def find(self, host_kv: HostKV, slots: torch.Tensor) -> CopyEvent | None:
        """The event of a prefetch of `host_kv` into these `slots`, if there is one."""
        record = self._records.get(host_kv)
        return record.event if record is not None and record.matches(slots) else None

    def add(self, host_kv: HostKV, slots: torch.Tensor, event: CopyEvent) -> None:
        self.drop(host_kv)
        self.allocator.incref(host_kv.block_ids)
        values = slots.to(torch.int64).clone() if slots.device.type == "cpu" else None
        self._records[host_kv] = Prefetch(slots, values, event)

    def has(self, host_kv: HostKV) -> bool:
        return host_kv in self._records

    def drop(self, host_kv: HostKV) -> bool:
        """Forget the prefetch of `host_kv` (consumed or cancelled) and its reference; False if none."""
        if self._records.pop(host_kv, None) is None:
            return False
        self.allocator.decref(host_kv.block_ids)
        return True

    def drop_overlapping(self, host_kv: HostKV) -> int:
        """Forget every prefetch sharing a block with `host_kv` (which is being freed): a prefetch of a
        prefix of it (HostKV(block_ids[:k], ...)) must not outlive it. Returns how many."""
        blocks = set(host_kv.block_ids)
        known = [hk for hk in self._records if blocks.intersection(hk.block_ids)]
        return sum(self.drop(hk) for hk in known)

    def refs(self) -> Counter[int]:
        return Counter(b for hk in self._records for b in hk.block_ids)


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    def key(t: torch.Tensor) -> tuple:
        return (t.device, t.dtype, t.shape, t.stride(), t.data_ptr())

    return key(a) == key(b)
