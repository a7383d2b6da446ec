"""Gather the KV of arbitrary token slots of every layer into block-first memory, in one launch.

Source: SGLang-style per-layer buffers k[l], v[l] of [rows, kv_heads, head_dim], given as per-layer
data-pointer tables (MHATokenToKVPool.k_data_ptrs / v_data_ptrs). Destination: [blocks, layers, 2,
block_tokens, kv_heads, head_dim] on the pool's device (staging) or pinned host memory (direct).
Token i goes to block dst_blocks[i // block_tokens], row i % block_tokens; rows of a partial last
block that no token maps to are left untouched.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superinfer_kernels._common import NUM_WARPS, TILE_WORDS, copy_rows, prepare, reference_rows, runnable, tile_rows


@triton.jit
def _gather_kv_kernel(
    k_ptrs,
    v_ptrs,
    slots,
    dst_blocks,
    dst,
    num_tokens,
    num_tiles,
    num_items,
    row_words,
    block_stride,
    block_tokens,
    BLOCK_T: tl.constexpr,
    BLOCK_W: tl.constexpr,
    ROWS_ALIGNED16: tl.constexpr,
):
    # Persistent grid: the launcher caps the program count (SMs taken from the forward pass).
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        src, src_off, dst_off, tok_mask = tile_rows(
            item, k_ptrs, v_ptrs, slots, dst_blocks, num_tokens, num_tiles,
            row_words, block_stride, block_tokens, dst.dtype.element_ty, BLOCK_T, ROWS_ALIGNED16,
        )
        copy_rows(src, src_off, dst, dst_off, tok_mask, row_words, BLOCK_W)


def gather_kv_blocks(
    k_ptrs: torch.Tensor,
    v_ptrs: torch.Tensor,
    slots: torch.Tensor,
    dst: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    layer_shape: tuple[int, int, int],
    dtype: torch.dtype,
    max_programs: int | None = None,
    pool_align: int | None = None,
    tile_words: int = TILE_WORDS,
    num_warps: int = NUM_WARPS,
) -> None:
    """Copy K and V of `slots` (all layers) into `dst` at `dst_blocks`, in one kernel launch.

    layer_shape = (rows, kv_heads, head_dim) of every per-layer buffer (each one contiguous).
    pool_align: byte alignment (power of two) of every per-layer pointer; None assumes pointers at
    row boundaries of 16-byte-aligned allocations, as in SGLang's pools: gcd(row bytes, 16). It is
    verified when the pointer tables are on the CPU; on CUDA it is the caller's promise.
    max_programs caps the persistent grid (default: one program per SM; 16 on CPU).
    tile_words / num_warps: words one program moves per step and the warps doing it (tuning only).
    Asynchronous on CUDA (current stream), like any kernel launch.
    """
    prep = prepare(
        k_ptrs, v_ptrs, slots, dst, dst_blocks, layer_shape, dtype, max_programs, pool_align, ("dst", "dst_blocks"),
        tile_words, num_warps,
    )
    if prep is None:
        return
    plan = prep.plan
    kernel = runnable(_gather_kv_kernel, k_ptrs.device)
    kernel[(plan.num_programs,)](
        prep.k_ptrs, prep.v_ptrs, slots, dst_blocks, prep.words,
        plan.num_tokens, plan.num_tiles, plan.layers * 2 * plan.num_tiles,
        plan.row_words, plan.block_stride_words, plan.block_tokens,
        BLOCK_T=plan.block_t, BLOCK_W=plan.block_w, ROWS_ALIGNED16=plan.rows_aligned16,
        num_warps=plan.num_warps,
    )


def gather_kv_blocks_reference(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    slots: torch.Tensor,
    dst: torch.Tensor,
    dst_blocks: torch.Tensor,
) -> None:
    """Plain torch version of gather_kv_blocks over the per-layer buffers themselves."""
    slot, block, row = reference_rows(slots, dst_blocks, dst.shape[3], dst.device)
    for layer, (k, v) in enumerate(zip(k_buffers, v_buffers)):
        dst[block, layer, 0, row] = k[slot].to(dst.device)
        dst[block, layer, 1, row] = v[slot].to(dst.device)
