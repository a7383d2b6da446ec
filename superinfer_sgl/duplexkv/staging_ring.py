"""The triton-dma path's staging ring: a fixed set of device staging slots through which a transfer
flows chunk by chunk, so that the on-device gather (scatter) of one chunk runs while the copy engine
moves another over the link.

Serially, a gather at ~170 GB/s followed by a DMA at ~55 GB/s moves 1 / (1/170 + 1/55) = 41.6 GB/s
(41.9 measured on an H100 over PCIe Gen5, 76% of a pinned cudaMemcpy). Pipelined, the transfer takes
about max(gather, DMA) plus one chunk's gather to fill the pipe.

Out (device -> host), chunk k of `slot_blocks` blocks into slot k % slots:
    helper stream: wait slot free -> gather chunk k into the slot -> record `ready`
    lane stream:   wait `ready`   -> one DMA per run of consecutive host blocks -> record slot free
In (host -> device), mirrored:
    lane stream:   wait slot free -> DMA host runs into the slot -> record `ready`
    helper stream: wait `ready`   -> scatter the slot into device slots -> record slot free
    and at the end the lane waits for the helper, so the lane's event covers the scatters.
The lane is the caller's current stream (an engine lane); each lane gets its own helper stream of
the same priority. A slot's `free` event outlives the call, so lanes sharing a ring (the engine's
out and eager lanes share the out ring) never write a slot another lane's copy still reads.
On a CPU there are no streams: the same calls run in order (`_Inline`), byte for byte the same.

Sizing (DEFAULT_RING_SLOTS x DEFAULT_SLOT_BYTES, allocated once per direction when the path is built):
16 MiB slots: a slot's DMA takes ~300 us at 55 GB/s, while issuing one chunk from Python (a Triton
launch, a copy, two events) costs ~100-250 us (the H100 run timed one 4 MB block through
triton-direct at 316 us, ~80 us of it the copy), so the CPU stays ahead of the copy engine; the
pipe fills with one 16 MiB gather (~100 us at 170 GB/s: 4% of the 64-block startup probe of 2 MiB
blocks, 0.5% of a 1 GiB transfer). 3 slots: two are enough in steady state (a chunk's gather is
~3x faster than its DMA); the third lets the gather run one chunk further ahead when it has to wait
for SMs behind the forward pass. 48 MiB per direction, where the serial path allocated staging as
large as each whole transfer (512 MiB for a 4096-token Llama-3-8B rotation, kept by the caching
allocator afterwards). A block larger than a slot gets a slot of one block. The benchmark's `ring`
section sweeps 2-4 slots of 2-32 MiB: the defaults are to be set again from its GPU figures.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

DEFAULT_RING_SLOTS = 3
DEFAULT_SLOT_BYTES = 16 * 2**20

# gather(slots, *staged, ids) / scatter(slots, *staged, ids): the kernel launch of one chunk; staged
# are the slot's views (KV codes, and fp8 scales), ids = arange(blocks in the chunk) on the device.
ChunkOp = Callable[..., None]


class StreamOps(Protocol):
    """What the ring needs of streams and events; CUDA (_Cuda) or none at all (_Inline)."""

    def current(self) -> Any: ...

    def helper(self, lane: Any) -> Any: ...

    def run(self, stream: Any, fn: Callable[[], None]) -> None: ...

    def record(self, stream: Any) -> Any: ...

    def wait(self, stream: Any, event: Any) -> None: ...

    def keep(self, t: torch.Tensor, stream: Any) -> None: ...

    def synchronize(self, stream: Any) -> None: ...


class _Inline:
    """No streams (a CPU): every operation runs at once, in issue order; events are None."""

    def current(self) -> None:
        return None

    def helper(self, lane: Any) -> None:
        return None

    def run(self, stream: Any, fn: Callable[[], None]) -> None:
        fn()

    def record(self, stream: Any) -> None:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        return None

    def keep(self, t: torch.Tensor, stream: Any) -> None:
        return None

    def synchronize(self, stream: Any) -> None:
        return None


class _Cuda:
    """CUDA streams: the lane is the current stream; one helper stream per lane, same priority."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._helpers: dict[int, torch.cuda.Stream] = {}

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def helper(self, lane: torch.cuda.Stream) -> torch.cuda.Stream:
        key = lane.cuda_stream
        if key not in self._helpers:
            self._helpers[key] = torch.cuda.Stream(self.device, priority=lane.priority)
        return self._helpers[key]

    def run(self, stream: torch.cuda.Stream, fn: Callable[[], None]) -> None:
        with torch.cuda.stream(stream):
            fn()

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event | None) -> None:
        if event is not None:
            stream.wait_event(event)

    def keep(self, t: torch.Tensor, stream: torch.cuda.Stream) -> None:
        if t.is_cuda:
            t.record_stream(stream)

    def synchronize(self, stream: torch.cuda.Stream) -> None:
        stream.synchronize()


def stream_ops(device: torch.device) -> StreamOps:
    return _Cuda(device) if device.type == "cuda" else _Inline()


class StagingRing:
    """`slots` device staging slots of `slot_blocks` blocks each, for every host tensor of a pool
    (the KV blocks, and the fp8 scales beside them), used round-robin across calls."""

    def __init__(
        self,
        host_tensors: list[torch.Tensor],
        device: torch.device | str,
        slots: int = DEFAULT_RING_SLOTS,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        streams: StreamOps | None = None,
    ) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a staging ring needs slots >= 1 and slot_bytes >= 1, got {slots}, {slot_bytes}")
        device = torch.device(device)
        block_bytes = sum(h[0].numel() * h.element_size() for h in host_tensors)
        # never more blocks than the host pool has (a small pool in a test needs no 16 MiB slots)
        self.slots, self.slot_blocks = slots, max(1, min(slot_bytes // block_bytes, host_tensors[0].shape[0]))
        self.hosts = list(host_tensors)
        self.staged = [torch.empty((slots, self.slot_blocks, *h.shape[1:]), dtype=h.dtype, device=device)
                       for h in host_tensors]
        self.ids = torch.arange(self.slot_blocks, device=device)
        self.streams = streams if streams is not None else stream_ops(device)
        self._free: list[Any] = [None] * slots  # per slot: the event after which it may be written again
        self._next = 0

    @property
    def nbytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.staged)

    def chunks(self, num_blocks: int) -> Iterator[tuple[int, int, int]]:
        """(first block, end block, slot) of each chunk of a transfer of num_blocks blocks."""
        for start in range(0, num_blocks, self.slot_blocks):
            slot, self._next = self._next, (self._next + 1) % self.slots
            yield start, min(start + self.slot_blocks, num_blocks), slot

    def to_host(self, gather: ChunkOp, slots: torch.Tensor, blocks: list[int], block_tokens: int) -> None:
        """Token i of `slots` into host block blocks[i // block_tokens], row i % block_tokens."""
        s = self.streams
        lane = s.current()
        helper = s.helper(lane)
        s.wait(helper, s.record(lane))  # gathers after what the lane waits for (the KV, the slot indices)
        s.keep(slots, helper)
        try:
            for start, end, i in self.chunks(len(blocks)):
                views = [staged[i, : end - start] for staged in self.staged]
                tokens = slots[start * block_tokens : end * block_tokens]
                s.wait(helper, self._free[i])  # the slot's previous DMA has read it
                s.run(helper, functools.partial(gather, tokens, *views, self.ids[: end - start]))
                s.wait(lane, s.record(helper))
                s.run(lane, functools.partial(self._dma, views, blocks[start:end], out=True))
                self._free[i] = s.record(lane)
        except BaseException:
            s.synchronize(helper)
            raise

    def to_device(self, scatter: ChunkOp, blocks: list[int], slots: torch.Tensor, block_tokens: int) -> None:
        """Host block blocks[i // block_tokens], row i % block_tokens, into device slot slots[i]."""
        s = self.streams
        lane = s.current()
        helper = s.helper(lane)
        s.keep(slots, helper)
        try:
            for start, end, i in self.chunks(len(blocks)):
                views = [staged[i, : end - start] for staged in self.staged]
                tokens = slots[start * block_tokens : end * block_tokens]
                s.wait(lane, self._free[i])  # the slot's previous scatter has read it
                s.run(lane, functools.partial(self._dma, views, blocks[start:end], out=False))
                s.wait(helper, s.record(lane))
                s.run(helper, functools.partial(scatter, tokens, *views, self.ids[: end - start]))
                self._free[i] = s.record(helper)
        except BaseException:
            s.synchronize(helper)
            raise
        s.wait(lane, s.record(helper))  # the lane's own event now covers every scatter

    def _dma(self, views: list[torch.Tensor], blocks: list[int], out: bool) -> None:
        """One copy per run of consecutive host blocks, per host tensor."""
        for pos, first, length in runs(blocks):
            for view, host in zip(views, self.hosts):
                if out:
                    host[first : first + length].copy_(view[pos : pos + length], non_blocking=True)
                else:
                    view[pos : pos + length].copy_(host[first : first + length], non_blocking=True)


def runs(blocks: list[int]) -> Iterator[tuple[int, int, int]]:
    """Maximal runs of consecutive block ids as (position in `blocks`, first id, length)."""
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            yield start, blocks[start], i - start
            start = i
