"""Host side of DuplexKV: a block allocator with reference counts and the block-first host KV pool.

One host block holds block_tokens tokens of every layer, K and V, contiguous
([layers, 2, block_tokens, kv_heads, head_dim]), so a rotation moves MB-sized segments instead of
the per-layer pieces that keep PCIe far below peak. Independent of SGLang.
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from superinfer_sgl import host_memory
from superinfer_sgl.duplexkv import quant, quant_int4


@dataclass(frozen=True)
class HostKV:
    """A request's KV in host blocks: token i sits in block_ids[i // block_tokens], row i % block_tokens.

    Whoever holds a HostKV holds one allocator reference on each of its blocks (engine.free drops it).
    A block is written once, right after it is allocated, and never again while referenced, so two
    equal HostKVs that are both alive denote the same bytes. Rows of a partial last block beyond
    num_tokens are undefined."""

    block_ids: tuple[int, ...]
    num_tokens: int
    block_tokens: int
    # the format of the host pool its blocks are in (HostKVPool.kv_format), where an engine keeps a
    # pool per format; None: the engine's only (or default) pool
    kv_format: str | None = None

    def __post_init__(self) -> None:
        assert self.num_tokens >= 0 and self.block_tokens >= 1
        assert len(self.block_ids) == math.ceil(self.num_tokens / self.block_tokens), self

    def prefix(self, n: int) -> HostKV:
        """The HostKV of its first n tokens (its leading blocks; same pool)."""
        assert 0 <= n <= self.num_tokens, (n, self.num_tokens)
        return HostKV(self.block_ids[: math.ceil(n / self.block_tokens)], n, self.block_tokens, self.kv_format)


class HostPoolFull(RuntimeError):
    """Not enough free host blocks; nothing was allocated. `kv_format`: which format's pool, where
    one call spans several (EnginesByFormat)."""

    kv_format: str | None = None


class HostPinError(RuntimeError):
    """Page-locking the host pool was requested but failed."""


class BlockAllocator:
    """Free list plus reference counts over block ids 0..num_blocks-1.

    alloc() hands out the lowest free ids (a min-heap), so fresh allocations tend to be contiguous
    runs, which the DMA path copies with one call per run.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks))  # sorted, hence already a heap
        self._refs: list[int] = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refcount(self, block: int) -> int:
        self._check_id(block)
        return self._refs[block]

    def alloc(self, n: int) -> list[int]:
        """n blocks with reference count 1, or HostPoolFull (and no change) if fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise HostPoolFull(f"need {n} host blocks, {len(self._free)} of {self.num_blocks} free")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def incref(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        for b in ids:
            self._check_used(b)
        for b in ids:
            self._refs[b] += 1

    def decref(self, ids: Iterable[int]) -> None:
        """Drop one reference each; a block whose count reaches 0 is free again. Validates first,
        so a double free raises without changing anything."""
        ids = list(ids)
        drops: dict[int, int] = {}
        for b in ids:
            drops[b] = drops.get(b, 0) + 1
            self._check_used(b)
            if drops[b] > self._refs[b]:
                raise ValueError(f"double free of host block {b} (refcount {self._refs[b]})")
        for b in ids:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                heapq.heappush(self._free, b)

    free = decref

    def check_invariants(self) -> None:
        """Every block is free with count 0 or used with count >= 1; the free list has no duplicates."""
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate ids in the free list"
        for b, r in enumerate(self._refs):
            assert (b in free) == (r == 0), f"block {b}: refcount {r}, in free list: {b in free}"
            assert r >= 0, f"block {b}: negative refcount {r}"

    def _check_id(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"host block id {block} out of range [0, {self.num_blocks})")

    def _check_used(self, block: int) -> None:
        self._check_id(block)
        if self._refs[block] == 0:
            raise ValueError(f"host block {block} is not allocated")


class HostKVPool:
    """Block-first host KV memory [num_blocks, layers, 2, block_tokens, kv_heads, head_dim] + allocator.

    `dtype` is the device pool's. `kv_format` (a --rotary-kv-dtype value, quant.FORMATS) says what a
    block stores: "auto" that dtype (bits copied exactly); "fp8_e4m3" (for a 16/32-bit device pool)
    e4m3 codes plus `scales` [num_blocks, layers, 2, kv_heads] float32 beside them (quant.py);
    "int4" uint8 rows of row_width = quant_int4.row_bytes(head_dim) bytes, packed codes with their
    scale bytes inside ([num_blocks, layers, 2, block_tokens, kv_heads, row_width], no `scales`;
    quant_int4.py). The last two are lossy (`quantized`). store_dtype (the older spelling) still
    selects auto (None or `dtype`) or fp8 (quant.FP8_DTYPE). A pool holds one format; an engine
    serving classes of several formats keeps one pool per format (for_formats).
    pin=None pins when CUDA is available (DMA and kernels need page-locked memory to reach full
    bandwidth and to address it from the device); pin=True insists and raises HostPinError if it
    cannot; pin=False never pins.
    """

    def __init__(
        self,
        num_blocks: int,
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_tokens: int,
        dtype: torch.dtype,
        pin: bool | None = None,
        store_dtype: torch.dtype | None = None,
        kv_format: str | None = None,
    ) -> None:
        if min(num_blocks, layers, kv_heads, head_dim, block_tokens) < 1:
            raise ValueError("num_blocks, layers, kv_heads, head_dim and block_tokens must all be >= 1")
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.block_tokens, self.dtype = block_tokens, dtype
        self.kv_format = _format_of(dtype, store_dtype, kv_format)
        self.store_dtype = quant.host_dtype(self.kv_format, dtype)
        self.quantized = self.kv_format in quant.LOSSY_FORMATS
        self.row_width = row_width(self.kv_format, head_dim)  # store_dtype elements per (token, head) row
        shape = (num_blocks, layers, 2, block_tokens, kv_heads, self.row_width)
        # int4: zeros decode to zeros, so an unwritten block reads back as zeros (as fp8's below)
        self.data = (torch.zeros if self.kv_format == "int4" else torch.empty)(shape, dtype=self.store_dtype)
        # fp8: per block, layer, K/V and head; zeros, so an unwritten block decodes to zeros
        fp8 = self.kv_format == "fp8_e4m3"
        self.scales = torch.zeros(shape[:3] + (kv_heads,), dtype=quant.SCALE_DTYPE) if fp8 else None
        want_pin = torch.cuda.is_available() if pin is None else pin
        self.pinned = _pin(self.data) if want_pin else False
        if self.pinned and self.scales is not None:
            _pin(self.scales)
        self.allocator = BlockAllocator(num_blocks)
        # read every scheduler step (the rotation budget); block_bytes allocates a tensor to ask
        self._bytes_per_block = block_bytes(layers, kv_heads, head_dim, block_tokens, dtype, self.kv_format)

    @property
    def num_blocks(self) -> int:
        return self.data.shape[0]

    @property
    def bytes_per_token(self) -> int:
        """Host bytes of one token's rows (int4: its scale bytes included; fp8: its scales not)."""
        return self.layers * 2 * self.kv_heads * self.row_width * self.data.element_size()

    @property
    def bytes_per_block(self) -> int:
        """Host bytes of one block: its KV, plus fp8's scales beside it."""
        return self._bytes_per_block

    @property
    def bytes_used(self) -> int:
        """Host bytes of the blocks allocated now."""
        return self.allocator.num_used * self.bytes_per_block

    def blocks_for_tokens(self, n: int) -> int:
        return math.ceil(n / self.block_tokens)

    @staticmethod
    def default_num_blocks(
        layers: int,
        kv_heads: int,
        head_dim: int,
        block_tokens: int,
        dtype: torch.dtype,
        *,
        free_ram_fraction: float = 0.5,
        gb: float | None = None,
        store_dtype: torch.dtype | None = None,
        kv_format: str | None = None,
    ) -> int:
        """Blocks that fit in `gb` GiB, or else in free_ram_fraction of the RAM available now
        (blocks of the format, fp8's scales included)."""
        fmt = _format_of(dtype, store_dtype, kv_format)
        budget = gb * 2**30 if gb is not None else free_ram_fraction * host_memory.available_ram_bytes()
        return max(1, int(budget // block_bytes(layers, kv_heads, head_dim, block_tokens, dtype, fmt)))

    @classmethod
    def for_device(cls, dev, block_tokens: int, rotary_kv_dtype: str = "auto", *,
                   free_ram_fraction: float = 0.5, gb: float | None = None) -> HostKVPool:
        """The host pool for a DevicePoolView, sized by default_num_blocks (--rotary-pool-gb)."""
        quant.host_dtype(rotary_kv_dtype, dev.dtype)  # ValueError: an unknown format, or fp8 device KV
        shape = (dev.layers, dev.kv_heads, dev.head_dim, block_tokens, dev.dtype)
        blocks = cls.default_num_blocks(*shape, free_ram_fraction=free_ram_fraction, gb=gb, kv_format=rotary_kv_dtype)
        return cls(blocks, *shape, kv_format=rotary_kv_dtype)

    @classmethod
    def for_formats(cls, dev, block_tokens: int, formats: Iterable[str], *, free_ram_fraction: float = 0.5,
                    gb: float | None = None) -> dict[str, HostKVPool]:
        """One pool per distinct format (e.g. SloClasses.rotary_kv_dtypes' values), in first-seen
        order; the byte budget (`gb`, else free_ram_fraction of the available RAM, measured once) is
        split evenly between them, so each format gets the same host bytes and an int4 pool ~1.9x
        an fp8 pool's tokens. (An even split is a placeholder: by each format's share of paused
        tokens would fit a load better.)"""
        fmts = list(dict.fromkeys(formats))
        if not fmts:
            raise ValueError("for_formats needs at least one format")
        for fmt in fmts:
            quant.host_dtype(fmt, dev.dtype)
        total = gb * 2**30 if gb is not None else free_ram_fraction * host_memory.available_ram_bytes()
        share = total / len(fmts) / 2**30
        return {fmt: cls.for_device(dev, block_tokens, fmt, gb=share) for fmt in fmts}


def row_width(kv_format: str, head_dim: int) -> int:
    """Host elements per (token, KV head) row: head_dim, or int4's packed bytes plus scale bytes."""
    return quant_int4.row_bytes(head_dim) if kv_format == "int4" else head_dim


def block_bytes(layers: int, kv_heads: int, head_dim: int, block_tokens: int, dtype: torch.dtype,
                kv_format: str = "auto") -> int:
    """Host bytes of one block of `kv_format` for a device KV pool of `dtype` (fp8's scales included)."""
    elem = torch.empty((), dtype=quant.host_dtype(kv_format, dtype)).element_size()
    payload = layers * 2 * block_tokens * kv_heads * row_width(kv_format, head_dim) * elem
    return payload + (quant.scale_bytes_per_block(layers, kv_heads) if kv_format == "fp8_e4m3" else 0)


def _format_of(dtype: torch.dtype, store_dtype: torch.dtype | None, kv_format: str | None) -> str:
    """The format a pool's arguments ask for: kv_format, else what store_dtype implies."""
    if kv_format is not None:
        if kv_format not in quant.FORMATS:
            raise ValueError(f"kv_format must be one of {quant.FORMATS}, got {kv_format!r}")
        if store_dtype is not None and store_dtype != quant.host_dtype(kv_format, dtype):
            raise ValueError(f"store_dtype {store_dtype} contradicts kv_format {kv_format!r}")
        return kv_format
    if store_dtype is None or store_dtype == dtype:
        return "auto"
    if quant.is_quantized(store_dtype, dtype):
        return "fp8_e4m3"
    raise ValueError(f"host blocks store {dtype}, fp8 e4m3 or int4 (quantized; kv_format='int4'), not {store_dtype}")


def _pin(data: torch.Tensor) -> bool:
    """Page-lock `data` in place. cudaHostRegister avoids the caching host allocator, which rounds
    pinned allocations up to a power of two (a 40 GiB pool would take 64 GiB)."""
    if not torch.cuda.is_available():
        raise HostPinError("pin=True but CUDA is not available, so host memory cannot be page-locked")
    nbytes = data.numel() * data.element_size()
    cudart = torch.cuda.cudart()
    # flags: cudaHostRegisterPortable | cudaHostRegisterMapped (device-addressable for direct kernels)
    err = cudart.cudaHostRegister(data.data_ptr(), nbytes, 3)
    if int(err) != 0 or not data.is_pinned():
        raise HostPinError(f"cudaHostRegister of {nbytes / 2**30:.2f} GiB host KV pool failed ({err})")
    weakref.finalize(data, cudart.cudaHostUnregister, data.data_ptr())
    return True
