"""Transfer paths: how one batch of token slots moves between the device pool and host blocks.

Every path takes (slots, blocks) with token i of `slots` in block blocks[i // block_tokens], row
i % block_tokens, and copies on the current stream (the engine picks the stream; the staging ring
also runs its gathers / scatters on a helper stream of that stream, which the current stream has
waited for by the time the call returns).
  torch          per layer, index_select / index_put vectorised over tokens (the CPU path)
  naive          one copy per page per layer per K/V, page = block_tokens tokens (what stock swap does)
  triton-direct  one kernel launch reads/writes pinned host memory directly
  triton-dma     the gather into a fixed ring of device staging slots pipelined with the DMA out of
                 them, chunk by chunk on two streams (staging_ring.py); in: DMA into the ring, then
                 scatter, mirrored
  triton-dma-serial
                 the unpipelined form (the benchmark's baseline): one gather into staging as large as
                 the transfer, then one DMA per contiguous run of host blocks
  triton-hybrid  a duplex alternative to triton-direct: out as triton-direct (one kernel writes pinned
                 host memory), in as triton-dma (copy engine + scatter), so the two directions use
                 different engines of the link
On CUDA every path except torch is asynchronous with respect to the host (pinned host memory,
non_blocking copies); the torch path's .cpu() synchronises its stream.
With fp8 or int4 host blocks (HostKVPool.quantized, --rotary-kv-dtype fp8_e4m3 / int4, or a class's
rotary_kv_dtype) the torch and Triton paths quantize on the way out and dequantize on the way back
(quant.py, quant_int4.py); naive refuses them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

import torch

from superinfer_sgl.duplexkv.device_pool import DevicePoolView
from superinfer_sgl.duplexkv import quant, quant_int4
from superinfer_sgl.duplexkv.host_pool import HostKVPool
from superinfer_sgl.duplexkv.staging_ring import DEFAULT_RING_SLOTS, DEFAULT_SLOT_BYTES, StagingRing, runs
from superinfer_sgl.registry import Registry

_SUPERCHIPS = ("GH200", "GB200", "GB300")


def pick_transfer(device: torch.device | str) -> str:
    """Transfer path for a device by its kind alone (`auto` before, or without, the startup probe).

    CPU: "torch" (Triton would need the interpreter). CUDA: "triton-dma", except on superchips with
    NVLink-C2C (GH200/GB200), where "triton-direct". On an H100 over PCIe Gen5 at 8 SMs
    (docs/results.md#gpu) triton-direct is faster one way but slower with both directions at once, and
    it keeps its SMs for the whole transfer where triton-dma holds them only for the on-device
    gather; rotation steps move both ways, so PCIe GPUs keep triton-dma. Over coherent C2C direct
    access skips the staging pass (reasoned, not measured: no GH200 here). On CUDA, RotationEngine
    with `auto` then times the candidates (link_probe.probe_transfers) and keeps the fastest.
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


class TransferPath(Protocol):
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


class _TorchFp8Path(_TorchPath):
    """The torch path into fp8 host blocks: per layer and K/V, gather the rows, quantize them per
    block and head (quant.quantize_rows), store codes and scales; back: dequantize with each token's
    block scales and index_copy_ into the device buffer."""

    def to_host(self, slots: torch.Tensor, blocks: list[int]) -> None:
        block, row = self._rows(slots.numel(), blocks)
        ids = torch.tensor(blocks, dtype=torch.int64)
        for layer in range(self.dev.layers):
            for kv, bufs in enumerate((self.dev.k_buffers, self.dev.v_buffers)):
                codes, scales = quant.quantize_rows(bufs[layer].index_select(0, slots).cpu(), self.host.block_tokens)
                self.data[block, layer, kv, row] = codes.view(torch.uint8)
                self.host.scales[ids, layer, kv] = scales

    def to_device(self, blocks: list[int], slots: torch.Tensor) -> None:
        block, row = self._rows(slots.numel(), blocks)
        for layer in range(self.dev.layers):
            for kv, bufs in enumerate((self.dev.k_buffers, self.dev.v_buffers)):
                tok_scales = self.host.scales[block, layer, kv]
                rows = quant.dequantize_rows(self.data[block, layer, kv, row], tok_scales, self.dev.dtype)
                bufs[layer].index_copy_(0, slots, rows.to(self.dev.device, non_blocking=True))


class _TorchInt4Path(_TorchPath):
    """The torch path into int4 host blocks: a row quantizes on its own (quant_int4.quantize: codes
    and scale bytes in one uint8 row), so per layer and K/V the rows go to their host rows as they are."""

    def to_host(self, slots: torch.Tensor, blocks: list[int]) -> None:
        block, row = self._rows(slots.numel(), blocks)
        for layer in range(self.dev.layers):
            for kv, bufs in enumerate((self.dev.k_buffers, self.dev.v_buffers)):
                self.data[block, layer, kv, row] = quant_int4.quantize(bufs[layer].index_select(0, slots))

    def to_device(self, blocks: list[int], slots: torch.Tensor) -> None:
        block, row = self._rows(slots.numel(), blocks)
        for layer in range(self.dev.layers):
            for kv, bufs in enumerate((self.dev.k_buffers, self.dev.v_buffers)):
                rows = quant_int4.dequantize(self.data[block, layer, kv, row], self.dev.head_dim, self.dev.dtype)
                bufs[layer].index_copy_(0, slots, rows.to(self.dev.device, non_blocking=True))


class _NaivePath(_TorchOpsPath):
    """The baseline: a copy per page per layer per K/V. A page whose slots form a contiguous run is one
    slice copy (as in a paged pool); a scattered page needs an index gather first."""

    def __init__(self, dev: DevicePoolView, host: HostKVPool, max_programs: int | None) -> None:
        if host.quantized:
            raise ValueError(f"--kv-transfer naive copies bits; {host.kv_format} host blocks need torch or a triton path")
        super().__init__(dev, host, max_programs)

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
        d, h = self.dev, self.host
        gather = _kernel(self.kernels, "gather", h)
        gather(d.k_ptrs, d.v_ptrs, slots, *_host_tensors(h), self._ids(blocks), **self.launch)

    def to_device(self, blocks: list[int], slots: torch.Tensor) -> None:
        d, h = self.dev, self.host
        scatter = _kernel(self.kernels, "scatter", h)
        scatter(d.k_ptrs, d.v_ptrs, slots, *_host_tensors(h), self._ids(blocks), **self.launch)


class _TritonDmaSerialPath(_TritonDirectPath):
    """Staging on the device as large as the transfer, then one DMA per run of host blocks (and one
    for their fp8 scales): the gather and the DMA one after the other."""

    def _staging(self, num_blocks: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
        dev, host = self.dev.device, self.host
        pairs = [(torch.empty((num_blocks, *host.data.shape[1:]), dtype=host.data.dtype, device=dev), host.data)]
        if host.scales is not None:
            pairs.append((torch.empty((num_blocks, *host.scales.shape[1:]), dtype=host.scales.dtype, device=dev),
                          host.scales))
        return pairs, torch.arange(num_blocks, device=dev)

    def to_host(self, slots: torch.Tensor, blocks: list[int]) -> None:
        d = self.dev
        pairs, ids = self._staging(len(blocks))
        gather = _kernel(self.kernels, "gather", self.host)
        gather(d.k_ptrs, d.v_ptrs, slots, *[staged for staged, _ in pairs], ids, **self.launch)
        for start, first, length in runs(blocks):
            for staged, host in pairs:
                host[first : first + length].copy_(staged[start : start + length], non_blocking=True)

    def to_device(self, blocks: list[int], slots: torch.Tensor) -> None:
        d = self.dev
        pairs, ids = self._staging(len(blocks))
        for start, first, length in runs(blocks):
            for staged, host in pairs:
                staged[start : start + length].copy_(host[first : first + length], non_blocking=True)
        scatter = _kernel(self.kernels, "scatter", self.host)
        scatter(d.k_ptrs, d.v_ptrs, slots, *[staged for staged, _ in pairs], ids, **self.launch)


class _TritonRingPath(_TritonDirectPath):
    """triton-dma: the gather (scatter) kernel pipelined with the DMA through a staging ring per
    direction (staging_ring.py), allocated here, once."""

    def __init__(self, dev: DevicePoolView, host: HostKVPool, max_programs: int | None,
                 ring_slots: int = DEFAULT_RING_SLOTS, ring_slot_bytes: int = DEFAULT_SLOT_BYTES,
                 directions: tuple[str, ...] = ("out", "in")) -> None:
        super().__init__(dev, host, max_programs)
        tensors = _host_tensors(host)
        self.rings = {d: StagingRing(tensors, dev.device, ring_slots, ring_slot_bytes) for d in directions}

    def _kernel(self, name: str):  # type: ignore[no-untyped-def]
        kernel = _kernel(self.kernels, name, self.host)
        d = self.dev
        return lambda slots, *staged_and_ids: kernel(d.k_ptrs, d.v_ptrs, slots, *staged_and_ids, **self.launch)

    def to_host(self, slots: torch.Tensor, blocks: list[int]) -> None:
        self.rings["out"].to_host(self._kernel("gather"), slots, blocks, self.host.block_tokens)

    def to_device(self, blocks: list[int], slots: torch.Tensor) -> None:
        self.rings["in"].to_device(self._kernel("scatter"), blocks, slots, self.host.block_tokens)


class _TritonHybridPath(_TritonRingPath):
    """Out as triton-direct (one kernel writes pinned host memory: posted writes, no staging), in as
    triton-dma (copy engine into the ring, then scatter): a duplex alternative to triton-direct,
    whose kernels in both directions share the link's reads and writes at once."""

    def __init__(self, dev: DevicePoolView, host: HostKVPool, max_programs: int | None, **ring: int) -> None:
        super().__init__(dev, host, max_programs, directions=("in",), **ring)

    to_host = _TritonDirectPath.to_host


_KERNEL_SUFFIX = {"auto": "", "fp8_e4m3": "_fp8", "int4": "_int4"}  # HostKVPool.kv_format -> kernels


def _kernel(kernels, name: str, host: HostKVPool):  # type: ignore[no-untyped-def]
    """superinfer_kernels' gather/scatter for the host pool's format."""
    return getattr(kernels, f"{name}_kv_blocks{_KERNEL_SUFFIX[host.kv_format]}")


def _host_tensors(host: HostKVPool) -> list[torch.Tensor]:
    """The host tensors a kernel writes/reads and a DMA copies: the blocks, and fp8's scales beside
    them (int4 keeps its scales inside the blocks)."""
    return [host.data] if host.scales is None else [host.data, host.scales]


def _import_kernels():
    """Lazy: the torch and naive paths must work where Triton cannot run."""
    try:
        import superinfer_kernels
    except ImportError as e:
        raise ImportError("Triton transfer paths need the superinfer_kernels package (triton_kernels/)") from e
    return superinfer_kernels


# Every path by name (in --kv-transfer's order); "auto" is not a path but a choice among them
# (pick_transfer, then on CUDA the engine's startup probe).
PATHS: Registry[type] = Registry("transfer path", {
    "triton-dma": _TritonRingPath,
    "triton-dma-serial": _TritonDmaSerialPath,
    "triton-direct": _TritonDirectPath,
    "triton-hybrid": _TritonHybridPath,
    "naive": _NaivePath,
    "torch": _TorchPath,
})
AUTO = "auto"
RING_PATHS = ("triton-dma", "triton-hybrid")  # the paths that take ring options (ring_slots, ring_slot_bytes)
# What RotationEngine accepts; config.KV_TRANSFERS (--kv-transfer's choices, kept free of torch) is
# held equal to it by tests/unit/test_config.py.
TRANSFERS = (AUTO, *PATHS.names())


def make_path(transfer: str, dev: DevicePoolView, host: HostKVPool, max_programs: int | None,
              **ring: int) -> TransferPath:
    """The path object `transfer` over these pools; `ring` (ring_slots, ring_slot_bytes) sizes the
    staging rings of the RING_PATHS (the other paths have none and ignore it)."""
    unknown = set(ring) - {"ring_slots", "ring_slot_bytes"}
    if unknown:
        raise ValueError(f"unknown staging ring options {sorted(unknown)}: ring_slots, ring_slot_bytes")
    if transfer == "torch" and host.quantized:
        return (_TorchInt4Path if host.kv_format == "int4" else _TorchFp8Path)(dev, host, max_programs)
    return PATHS[transfer](dev, host, max_programs, **(ring if transfer in RING_PATHS else {}))


# ---------------------------------------------------------------- batching several requests into one launch

Part = tuple[torch.Tensor, list[int]]  # (slots of some tokens, the host blocks they fill from row 0)


def gather_batch(parts: list[Part], block_tokens: int) -> Part:
    """One device-to-host launch for several requests. A path maps token i to block i // block_tokens,
    so every part but the last is padded to whole blocks by repeating its last slot: those copies land
    in host rows past the part's tokens, which no reader looks at (HostKV leaves them undefined)."""
    slots: list[torch.Tensor] = []
    blocks: list[int] = []
    for i, (s, b) in enumerate(parts):
        assert s.numel() > 0 and -(-s.numel() // block_tokens) == len(b), (s.numel(), len(b))
        pad = len(b) * block_tokens - s.numel()
        slots.append(torch.cat([s, s[-1:].expand(pad)]) if pad and i < len(parts) - 1 else s)
        blocks += b
    return torch.cat(slots) if len(slots) > 1 else slots[0], blocks


def scatter_batches(parts: list[Part], block_tokens: int) -> list[Part]:
    """Host-to-device launches for several requests. Padding would write device rows, so partial last
    blocks cannot be padded: one launch takes every whole block plus one partial block (at its end),
    and each other partial block gets a launch of its own (one block each)."""
    full_slots: list[torch.Tensor] = []
    full_blocks: list[int] = []
    partial: list[Part] = []
    for s, b in parts:
        whole = s.numel() // block_tokens
        full_slots.append(s[: whole * block_tokens])
        full_blocks += b[:whole]
        if s.numel() > whole * block_tokens:
            partial.append((s[whole * block_tokens :], b[whole:]))
    if partial:
        s, b = partial.pop()
        full_slots.append(s)
        full_blocks += b
    main = (torch.cat(full_slots), full_blocks) if full_blocks else None
    return ([main] if main else []) + partial
