"""Shared pieces of the KV gather/scatter kernels: validation, integer views, the tile index math.

Both kernels move raw bits: every tensor is reinterpreted as the widest integer type ("word") that
divides a token row, so the copy is byte-exact for any dtype (fp8 and bf16 included) and the Triton
interpreter, which cannot downcast to bf16/fp8, runs the same code on CPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NoReturn

import torch
import triton
import triton.language as tl

INDEX_DTYPES = (torch.int32, torch.int64)
POINTER_DTYPES = (torch.int64, torch.uint64)
WORD_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}

# One tile holds about this many words; large enough to keep loads wide, small enough for registers.
# Bytes in flight per program are what hide memory (HBM or PCIe) latency; more words per tile need
# more warps to stay in registers (tile_words / (32 * num_warps) words per thread).
TILE_WORDS = 4096
NUM_WARPS = 4
MAX_ROW_CHUNK_WORDS = 1024


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launcher derived from its arguments; the kernel sees only integers and views."""

    num_tokens: int
    layers: int
    block_tokens: int
    word_bytes: int
    row_words: int
    block_stride_words: int
    block_t: int
    block_w: int
    num_tiles: int
    num_programs: int
    rows_aligned16: bool  # every pool row starts 16-byte aligned: lets the compiler emit 16-byte accesses
    num_warps: int = NUM_WARPS


# ---------------------------------------------------------------- validation (launchers)


def fail(message: str) -> NoReturn:
    raise ValueError(message)


def check_index(name: str, t: torch.Tensor, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 1:
        fail(f"{name} must be a 1-D tensor")
    if t.dtype not in INDEX_DTYPES:
        fail(f"{name} must be int32 or int64, got {t.dtype}")
    if t.device != device:
        fail(f"{name} is on {t.device}, the KV pool is on {device}")
    if t.stride(0) != 1 and t.numel() > 1:
        fail(f"{name} must be contiguous")


def check_pointers(k_ptrs: torch.Tensor, v_ptrs: torch.Tensor, device: torch.device) -> int:
    """Validates the per-layer pointer tables and returns the number of layers."""
    for name, t in (("k_ptrs", k_ptrs), ("v_ptrs", v_ptrs)):
        if t.dim() != 1 or t.dtype not in POINTER_DTYPES:
            fail(f"{name} must be a 1-D uint64/int64 tensor of per-layer data pointers")
        if t.device != device:
            fail(f"{name} is on {t.device}, expected {device} (the kernel reads it)")
        if not t.is_contiguous():
            fail(f"{name} must be contiguous")
    if k_ptrs.numel() != v_ptrs.numel() or k_ptrs.numel() == 0:
        fail(f"k_ptrs and v_ptrs must have the same non-zero length, got {k_ptrs.numel()} and {v_ptrs.numel()}")
    return k_ptrs.numel()


def check_blocks_tensor(
    name: str, t: torch.Tensor, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Validates a block-first tensor [blocks, layers, 2, block_tokens, kv_heads, head_dim]; returns block_tokens."""
    if t.dim() != 6:
        fail(f"{name} must be [blocks, layers, 2, block_tokens, kv_heads, head_dim], got shape {tuple(t.shape)}")
    _, t_layers, two, block_tokens, t_heads, t_dim = t.shape
    if (t_layers, two, t_heads, t_dim) != (layers, 2, kv_heads, head_dim):
        fail(
            f"{name} shape {tuple(t.shape)} does not match the pool "
            f"(layers={layers}, 2, kv_heads={kv_heads}, head_dim={head_dim})"
        )
    if block_tokens < 1:
        fail(f"{name} has block_tokens={block_tokens}")
    if t.dtype != dtype:
        fail(f"{name} dtype {t.dtype} differs from the pool dtype {dtype}")
    if t.shape[0] > 0 and not t[0].is_contiguous():
        fail(f"{name} must be contiguous within a block (only the block stride may differ)")
    return block_tokens


def check_block_memory(name: str, t: torch.Tensor, device: torch.device) -> None:
    """Block memory is on the pool's device, or pinned host memory that a CUDA kernel can address."""
    if t.device == device:
        return
    if device.type == "cuda" and t.device.type == "cpu" and t.is_pinned():
        return
    fail(f"{name} is on {t.device}; it must be on {device} or (for a CUDA pool) pinned host memory")


def check_slots_in_range(slots: torch.Tensor, rows: int) -> None:
    """Bounds check, only where it costs no device sync (CPU index tensors)."""
    if slots.device.type == "cpu" and slots.numel() > 0:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 0 or hi >= rows:
            fail(f"slots must lie in [0, {rows}), got range [{lo}, {hi}]")


def check_block_ids(name: str, ids: torch.Tensor, num_tokens: int, block_tokens: int, num_blocks: int) -> None:
    need = math.ceil(num_tokens / block_tokens)
    if ids.numel() != need:
        fail(f"{name} has {ids.numel()} entries; {num_tokens} tokens in blocks of {block_tokens} need {need}")
    if ids.device.type == "cpu" and ids.numel() > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= num_blocks:
            fail(f"{name} must lie in [0, {num_blocks}), got range [{lo}, {hi}]")


def word_bytes_for(row_bytes: int, *addresses: int) -> int:
    """Widest integer (<= 8 bytes) that divides a token row and every base address / stride given."""
    for width in (8, 4, 2, 1):
        if row_bytes % width == 0 and all(a % width == 0 for a in addresses):
            return width
    return 1


def check_pointer_alignment(k_ptrs: torch.Tensor, v_ptrs: torch.Tensor, align: int) -> None:
    """Pointer tables on CPU are cheap to read, so verify the alignment the caller promised."""
    if align < 1 or align & (align - 1):
        fail(f"pool_align must be a power of two, got {align}")
    if k_ptrs.device.type != "cpu":
        return  # reading a CUDA table would sync; the promise is the caller's (see default_pool_align)
    for p in torch.cat([k_ptrs.view(torch.int64), v_ptrs.view(torch.int64)]).tolist():
        if p == 0 or p % align:
            fail(f"pool pointer {p:#x} is null or not {align}-byte aligned (pool_align={align})")


def default_pool_align(row_bytes: int) -> int:
    """Alignment of pointers at row boundaries of 16-byte-aligned allocations (SGLang's K and V halves
    of one (2, rows, H, D) tensor): the largest power of two <= 16 dividing the row size."""
    return math.gcd(row_bytes, 16)


def word_view(t: torch.Tensor, width: int) -> torch.Tensor:
    """[blocks, ...] -> [blocks, words_per_block] integer view over the same memory."""
    return t.view(torch.uint8).reshape(t.shape[0], -1).view(WORD_DTYPES[width])


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def default_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 16  # CPU interpreter: programs run one after another, the count only changes loop shape


def make_plan(
    num_tokens: int,
    layers: int,
    row_bytes: int,
    block_tokens: int,
    block_stride_bytes: int,
    word_bytes: int,
    max_programs: int | None,
    device: torch.device,
    pool_align: int,
    tile_words: int = TILE_WORDS,
    num_warps: int = NUM_WARPS,
) -> LaunchPlan:
    if tile_words < 1 or tile_words & (tile_words - 1):
        fail(f"tile_words must be a power of two, got {tile_words}")
    if num_warps not in (1, 2, 4, 8, 16, 32):
        fail(f"num_warps must be a power of two <= 32, got {num_warps}")
    row_words = row_bytes // word_bytes
    block_w = min(triton.next_power_of_2(row_words), MAX_ROW_CHUNK_WORDS, tile_words)
    block_t = max(1, min(tile_words // block_w, triton.next_power_of_2(num_tokens)))
    num_tiles = triton.cdiv(num_tokens, block_t)
    cap = default_programs(device) if max_programs is None else max_programs
    if cap < 1:
        fail(f"max_programs must be >= 1, got {cap}")
    return LaunchPlan(
        num_tokens=num_tokens,
        layers=layers,
        block_tokens=block_tokens,
        word_bytes=word_bytes,
        row_words=row_words,
        block_stride_words=block_stride_bytes // word_bytes,
        block_t=block_t,
        block_w=block_w,
        num_tiles=num_tiles,
        num_programs=min(cap, layers * 2 * num_tiles),
        rows_aligned16=pool_align % 16 == 0 and row_bytes % 16 == 0,
        num_warps=num_warps,
    )


def runnable(kernel, device: torch.device):
    """On CPU tensors a compiled kernel cannot launch; demand the interpreter with a clear message."""
    if device.type == "cpu" and not _is_interpreted(kernel):
        raise RuntimeError(
            "Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before superinfer_kernels is imported"
        )
    return kernel


def _is_interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class Prepared:
    """Validated launch inputs: int64 pointer tables, the integer view of the block memory, the plan."""

    k_ptrs: torch.Tensor
    v_ptrs: torch.Tensor
    words: torch.Tensor
    plan: LaunchPlan


def prepare(
    k_ptrs: torch.Tensor,
    v_ptrs: torch.Tensor,
    slots: torch.Tensor,
    blocks: torch.Tensor,
    block_ids: torch.Tensor,
    layer_shape: tuple[int, int, int],
    dtype: torch.dtype,
    max_programs: int | None,
    pool_align: int | None,
    names: tuple[str, str],
    tile_words: int = TILE_WORDS,
    num_warps: int = NUM_WARPS,
) -> Prepared | None:
    """Shared launcher checks; None when there is nothing to copy. names = (blocks name, block ids name)."""
    blocks_name, ids_name = names
    rows, kv_heads, head_dim = layer_shape
    device = k_ptrs.device
    layers = check_pointers(k_ptrs, v_ptrs, device)
    check_index("slots", slots, device)
    check_index(ids_name, block_ids, device)
    block_tokens = check_blocks_tensor(blocks_name, blocks, layers, kv_heads, head_dim, dtype)
    check_block_memory(blocks_name, blocks, device)
    num_tokens = slots.numel()
    check_block_ids(ids_name, block_ids, num_tokens, block_tokens, blocks.shape[0])
    check_slots_in_range(slots, rows)
    elem = blocks.element_size()
    row_bytes = kv_heads * head_dim * elem
    pool_align = default_pool_align(row_bytes) if pool_align is None else pool_align
    check_pointer_alignment(k_ptrs, v_ptrs, pool_align)
    if num_tokens == 0:
        return None
    block_stride_bytes = blocks.stride(0) * elem
    width = word_bytes_for(row_bytes, blocks.data_ptr(), block_stride_bytes, pool_align)
    plan = make_plan(
        num_tokens, layers, row_bytes, block_tokens, block_stride_bytes, width, max_programs, device, pool_align,
        tile_words, num_warps,
    )
    return Prepared(k_ptrs.view(torch.int64), v_ptrs.view(torch.int64), word_view(blocks, width), plan)


def reference_rows(
    slots: torch.Tensor, block_ids: torch.Tensor, block_tokens: int, blocks_device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Index math of the torch references: slot of each token (pool device), and its block and row
    in block-first memory (on that memory's device)."""
    tok = torch.arange(slots.numel(), device=blocks_device)
    block = block_ids.to(blocks_device).long()[tok // block_tokens]
    return slots.long(), block, tok % block_tokens


# ---------------------------------------------------------------- device code shared by both kernels


@triton.jit
def tile_rows(
    item,
    k_ptrs,
    v_ptrs,
    slots,
    block_ids,
    num_tokens,
    num_tiles,
    row_words,
    block_stride,
    block_tokens,
    WORD_TY: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ROWS_ALIGNED16: tl.constexpr,
):
    """For one work item (layer, K or V, token tile): the layer base pointer, the word offsets of each
    token's row in the pool and in the block-first memory, and the mask of real tokens."""
    lkv = item // num_tiles
    tile = item % num_tiles
    layer = lkv // 2
    k_base = tl.load(k_ptrs + layer)
    v_base = tl.load(v_ptrs + layer)
    base = tl.where(lkv % 2 == 0, k_base, v_base).to(tl.pointer_type(WORD_TY))
    if ROWS_ALIGNED16:  # a pointer loaded from a table has unknown alignment unless we say so
        base = tl.multiple_of(base, 16)
    tok = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    mask = tok < num_tokens
    slot = tl.load(slots + tok, mask=mask, other=0).to(tl.int64)
    block = tl.load(block_ids + tok // block_tokens, mask=mask, other=0).to(tl.int64)
    pool_off = slot * row_words
    block_off = block * block_stride + (lkv * block_tokens + tok % block_tokens).to(tl.int64) * row_words
    return base, pool_off, block_off, mask


@triton.jit
def copy_rows(src, src_off, dst, dst_off, tok_mask, row_words, BLOCK_W: tl.constexpr):
    """Copy one tile of token rows, BLOCK_W words at a time: src[src_off[t] + w] -> dst[dst_off[t] + w]."""
    for col in range(0, row_words, BLOCK_W):
        cols = col + tl.arange(0, BLOCK_W)
        mask = tok_mask[:, None] & (cols < row_words)[None, :]
        words = tl.load(src + src_off[:, None] + cols[None, :], mask=mask)
        tl.store(dst + dst_off[:, None] + cols[None, :], words, mask=mask)


# ---- shared checks of the quantizing launchers (kv_fp8.py, kv_int4.py) --------------------------
def check_float_pool(fmt: str, dtype: torch.dtype, codes: dict, k_ptrs: torch.Tensor, v_ptrs: torch.Tensor,
                     slots: torch.Tensor, block_ids: torch.Tensor) -> int:
    """The pool side of a quantizing launch: a float pool dtype it encodes (`codes`), valid pointer
    tables and index tensors. Returns the layer count."""
    if dtype not in codes:
        fail(f"{fmt} rotary blocks quantize a float32/float16/bfloat16 KV pool, not {dtype}")
    device = k_ptrs.device
    layers = check_pointers(k_ptrs, v_ptrs, device)
    check_index("slots", slots, device)
    check_index("block_ids", block_ids, device)
    return layers


def check_rows(k_ptrs: torch.Tensor, v_ptrs: torch.Tensor, slots: torch.Tensor, block_ids: torch.Tensor,
               num_blocks: int, block_tokens: int, layer_shape: tuple[int, int, int], dtype: torch.dtype,
               pool_align: int | None) -> None:
    """Block ids and slots in range, and the pool's pointers aligned to its rows and elements."""
    rows, heads, head_dim = layer_shape
    check_block_ids("block_ids", block_ids, slots.numel(), block_tokens, num_blocks)
    check_slots_in_range(slots, rows)
    elem = torch.empty((), dtype=dtype).element_size()
    align = default_pool_align(heads * head_dim * elem) if pool_align is None else pool_align
    check_pointer_alignment(k_ptrs, v_ptrs, align)
    if align % elem:
        fail(f"pool pointers must be aligned to the {elem}-byte elements, pool_align={align}")


def program_count(device: torch.device, max_programs: int | None, num_items: int) -> int:
    """Programs of a persistent launch over `num_items` work items."""
    cap = default_programs(device) if max_programs is None else max_programs
    if cap < 1:
        fail(f"max_programs must be >= 1, got {cap}")
    return min(cap, num_items)
