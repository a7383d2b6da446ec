"""DuplexKV rotation engine: move a request's KV between the device pool and block-first host blocks.

Transfer paths (the engine picks one at construction):
  torch          per layer, index_select / index_put vectorised over tokens (the CPU path)
  naive          one copy per page per layer per K/V, page = block_tokens tokens (what stock swap does)
  triton-direct  one kernel launch reads/writes pinned host memory directly
  triton-dma     one kernel launch gathers into device staging, then one DMA per contiguous run of
                 host blocks per direction (one in total when the blocks are contiguous)
The API is synchronous for now. On CUDA each direction already runs on its own stream, ordered after
the work queued on the current stream (the forward pass that wrote the KV), and save/load wait for
their event before returning; an asynchronous version would hand that event to the caller instead.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from superinfer_sgl.duplexkv.device_pool import DevicePoolView
from superinfer_sgl.duplexkv.host_pool import HostKVPool

TRANSFERS = ("auto", "triton-dma", "triton-direct", "naive", "torch")
_SUPERCHIPS = ("GH200", "GB200", "GB300")


@dataclass(frozen=True)
class HostKV:
    """A request's KV in host blocks: token i sits in block_ids[i // block_tokens], row i % block_tokens."""

    block_ids: tuple[int, ...]
    num_tokens: int
    block_tokens: int

    def __post_init__(self) -> None:
        assert self.num_tokens >= 0 and self.block_tokens >= 1
        assert len(self.block_ids) == math.ceil(self.num_tokens / self.block_tokens), self


def pick_transfer(device: torch.device | str) -> str:
    """Default transfer path for a device.

    CPU: "torch" (Triton would need the interpreter). CUDA: "triton-dma", except on superchips with
    NVLink-C2C (GH200/GB200), where "triton-direct". Why: over PCIe the copy engines reach near-peak
    bandwidth on MB-sized copies and use no SMs, while a kernel touching host memory directly needs
    many SMs in flight to hide PCIe latency, and those SMs are taken from the forward pass; the
    staging gather runs at HBM speed on a few SMs. Over coherent C2C, direct access is fast and skips
    the staging pass. To be confirmed by scripts/bench_kv_transfer.py on each GPU (not yet measured).
    """
    device = torch.device(device)
    if device.type != "cuda":
        return "torch"
    name = torch.cuda.get_device_properties(device).name
    return "triton-direct" if any(chip in name for chip in _SUPERCHIPS) else "triton-dma"


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(t: torch.Tensor) -> torch.Tensor:
    """Same-width integer view: indexing ops exist for every integer type but not for fp8, and bits
    move unchanged."""
    return t.view(_SAME_WIDTH_INT[t.element_size()])


def _int_buffers(dev: DevicePoolView) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [_as_int(b) for b in dev.k_buffers], [_as_int(b) for b in dev.v_buffers]


class _Path(Protocol):
    def to_host(self, slots: torch.Tensor, blocks: list[int]) -> None: ...

    def to_device(self, blocks: list[int], slots: torch.Tensor) -> None: ...


class _TorchOpsPath:
    """Base of the paths built from torch ops, which see every buffer as same-width integers."""

    def __init__(self, dev: DevicePoolView, host: HostKVPool, max_programs: int | None) -> None:
        self.dev, self.host = dev, host
        self.kv = _int_buffers(dev)
        self.data = _as_int(host.data)


class _TorchPath(_TorchOpsPath):
    def _rows(self, n: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tok = torch.arange(n)
        return torch.tensor(blocks, dtype=torch.int64)[tok // self.host.block_tokens], tok % self.host.block_tokens

    def to_host(self, slots: torch.Tensor, blocks: list[int]) -> None:
        block, row = self._rows(slots.numel(), blocks)
        for layer in range(self.dev.layers):
            for kv, bufs in enumerate(self.kv):
                self.data[block, layer, kv, row] = bufs[layer].index_select(0, slots).cpu()

    def to_device(self, blocks: list[int], slots: torch.Tensor) -> None:
        block, row = self._rows(slots.numel(), blocks)
        for layer in range(self.dev.layers):
            for kv, bufs in enumerate(self.kv):
                rows = self.data[block, layer, kv, row].to(self.dev.device, non_blocking=True)
                bufs[layer].index_copy_(0, slots, rows)


class _NaivePath(_TorchOpsPath):
    """The baseline: a copy per page per layer per K/V. A page whose slots form a contiguous run is one
    slice copy (as in a paged pool); a scattered page needs an index gather first."""

    def _pages(self, slots: torch.Tensor, blocks: list[int]) -> Iterator[tuple[int, int, slice | torch.Tensor]]:
        cpu = slots.cpu()
        bt = self.host.block_tokens
        for j, block in enumerate(blocks):
            page = cpu[j * bt : (j + 1) * bt]
            first, m = int(page[0]), page.numel()
            run = torch.equal(page, torch.arange(first, first + m, dtype=page.dtype))
            yield block, m, slice(first, first + m) if run else page.to(self.dev.device)

    def to_host(self, slots: torch.Tensor, blocks: list[int]) -> None:
        for block, m, src in self._pages(slots, blocks):
            for layer in range(self.dev.layers):
                for kv, bufs in enumerate(self.kv):
                    self.data[block, layer, kv, :m].copy_(bufs[layer][src], non_blocking=True)

    def to_device(self, blocks: list[int], slots: torch.Tensor) -> None:
        for block, m, dst in self._pages(slots, blocks):
            for layer in range(self.dev.layers):
                for kv, bufs in enumerate(self.kv):
                    bufs[layer][dst] = self.data[block, layer, kv, :m].to(self.dev.device, non_blocking=True)


class _TritonDirectPath:
    def __init__(self, dev: DevicePoolView, host: HostKVPool, max_programs: int | None) -> None:
        self.kernels = _import_kernels()
        self.dev, self.host = dev, host
        self.launch = dict(layer_shape=dev.layer_shape, dtype=dev.dtype, max_programs=max_programs)

    def _ids(self, blocks: list[int]) -> torch.Tensor:
        return torch.tensor(blocks, dtype=torch.int64).to(self.dev.device, non_blocking=True)

    def to_host(self, slots: torch.Tensor, blocks: list[int]) -> None:
        d = self.dev
        self.kernels.gather_kv_blocks(d.k_ptrs, d.v_ptrs, slots, self.host.data, self._ids(blocks), **self.launch)

    def to_device(self, blocks: list[int], slots: torch.Tensor) -> None:
        d = self.dev
        self.kernels.scatter_kv_blocks(d.k_ptrs, d.v_ptrs, slots, self.host.data, self._ids(blocks), **self.launch)


class _TritonDmaPath(_TritonDirectPath):
    def _staging(self, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_blocks, *self.host.data.shape[1:])
        staging = torch.empty(shape, dtype=self.dev.dtype, device=self.dev.device)
        return staging, torch.arange(num_blocks, device=self.dev.device)

    def to_host(self, slots: torch.Tensor, blocks: list[int]) -> None:
        d = self.dev
        staging, ids = self._staging(len(blocks))
        self.kernels.gather_kv_blocks(d.k_ptrs, d.v_ptrs, slots, staging, ids, **self.launch)
        for start, first, length in _runs(blocks):
            self.host.data[first : first + length].copy_(staging[start : start + length], non_blocking=True)

    def to_device(self, blocks: list[int], slots: torch.Tensor) -> None:
        d = self.dev
        staging, ids = self._staging(len(blocks))
        for start, first, length in _runs(blocks):
            staging[start : start + length].copy_(self.host.data[first : first + length], non_blocking=True)
        self.kernels.scatter_kv_blocks(d.k_ptrs, d.v_ptrs, slots, staging, ids, **self.launch)


def _import_kernels():
    """Lazy: the torch and naive paths must work where Triton cannot run."""
    try:
        import superinfer_kernels
    except ImportError as e:
        raise ImportError("Triton transfer paths need the superinfer_kernels package (triton_kernels/)") from e
    return superinfer_kernels


_PATHS: dict[str, type] = {
    "torch": _TorchPath,
    "naive": _NaivePath,
    "triton-direct": _TritonDirectPath,
    "triton-dma": _TritonDmaPath,
}


def _runs(blocks: list[int]) -> Iterator[tuple[int, int, int]]:
    """Maximal runs of consecutive block ids as (position in `blocks`, first id, length)."""
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            yield start, blocks[start], i - start
            start = i


class RotationEngine:
    """Rotates request KV out to host blocks (save) and back into device slots (load)."""

    def __init__(
        self,
        device_pool: DevicePoolView,
        host_pool: HostKVPool,
        transfer: str = "auto",
        max_programs: int | None = None,
    ) -> None:
        _check_compatible(device_pool, host_pool)
        if transfer not in TRANSFERS:
            raise ValueError(f"transfer must be one of {TRANSFERS}, got {transfer!r}")
        self.device_pool, self.host_pool = device_pool, host_pool
        self.transfer = pick_transfer(device_pool.device) if transfer == "auto" else transfer
        self._path: _Path = _PATHS[self.transfer](device_pool, host_pool, max_programs)
        cuda = device_pool.device.type == "cuda"
        self._out_stream = torch.cuda.Stream(device_pool.device) if cuda else None
        self._in_stream = torch.cuda.Stream(device_pool.device) if cuda else None
        self.bytes_out = self.bytes_in = 0
        self.rotations_out = self.rotations_in = 0

    def save(self, slots: torch.Tensor) -> HostKV:
        """Copy the KV of `slots` (all layers, K and V) into newly allocated host blocks.
        Raises HostPoolFull, with nothing allocated, when the host pool lacks blocks."""
        slots = self._slots(slots)
        n = slots.numel()
        blocks = self.host_pool.allocator.alloc(self.host_pool.blocks_for_tokens(n))
        try:
            if n:
                with _side_stream(self._out_stream):
                    self._path.to_host(slots, blocks)
        except BaseException:
            self.host_pool.allocator.decref(blocks)
            raise
        self.bytes_out += n * self.device_pool.bytes_per_token
        self.rotations_out += 1
        return HostKV(tuple(blocks), n, self.host_pool.block_tokens)

    def load(self, host_kv: HostKV, slots: torch.Tensor) -> None:
        """Copy `host_kv` back into device `slots` (one per token); the host blocks stay allocated."""
        slots = self._slots(slots)
        if slots.numel() != host_kv.num_tokens or host_kv.block_tokens != self.host_pool.block_tokens:
            raise ValueError(
                f"{slots.numel()} slots for {host_kv.num_tokens} tokens "
                f"(block_tokens {host_kv.block_tokens} vs pool {self.host_pool.block_tokens})"
            )
        if slots.numel():
            with _side_stream(self._in_stream):
                self._path.to_device(list(host_kv.block_ids), slots)
        self.bytes_in += host_kv.num_tokens * self.device_pool.bytes_per_token
        self.rotations_in += 1

    def free(self, host_kv: HostKV) -> None:
        self.host_pool.allocator.decref(host_kv.block_ids)

    def _slots(self, slots: torch.Tensor) -> torch.Tensor:
        if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots must be a 1-D int32/int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
        return slots.to(self.device_pool.device, torch.int64)


def _check_compatible(dev: DevicePoolView, host: HostKVPool) -> None:
    ours = (dev.layers, dev.kv_heads, dev.head_dim, dev.dtype)
    theirs = (host.layers, host.kv_heads, host.head_dim, host.dtype)
    if ours != theirs:
        raise ValueError(f"device pool (layers, kv_heads, head_dim, dtype) {ours} != host pool {theirs}")


@contextlib.contextmanager
def _side_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Run the body on `stream`, after everything already queued on the current stream, and wait."""
    if stream is None:
        yield
        return
    stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream):
        try:
            yield
        finally:  # also on error: the caller may free blocks that queued copies still touch
            done = torch.cuda.Event()
            done.record(stream)
            done.synchronize()  # synchronous API; an async one returns `done` for the scheduler to wait on
