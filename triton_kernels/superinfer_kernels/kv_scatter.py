"""Scatter block-first KV back into the per-layer buffers at arbitrary token slots, in one launch.

The reverse of kv_gather: source [blocks, layers, 2, block_tokens, kv_heads, head_dim] on the pool's
device (staging) or pinned host memory (direct); token i is read from block src_blocks[i //
block_tokens], row i % block_tokens, and written to slot slots[i] of every layer's K and V buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superinfer_kernels._common import NUM_WARPS, TILE_WORDS, copy_rows, prepare, reference_rows, runnable, tile_rows


@triton.jit
def _scatter_kv_kernel(
    k_ptrs,
    v_ptrs,
    slots,
    src_blocks,
    src,
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
        dst, dst_off, src_off, tok_mask = tile_rows(
            item, k_ptrs, v_ptrs, slots, src_blocks, num_tokens, num_tiles,
            row_words, block_stride, block_tokens, src.dtype.element_ty, BLOCK_T, ROWS_ALIGNED16,
        )
        copy_rows(src, src_off, dst, dst_off, tok_mask, row_words, BLOCK_W)


def scatter_kv_blocks(
    k_ptrs: torch.Tensor,
    v_ptrs: torch.Tensor,
    slots: torch.Tensor,
    src: torch.Tensor,
    src_blocks: torch.Tensor,
    *,
    layer_shape: tuple[int, int, int],
    dtype: torch.dtype,
    max_programs: int | None = None,
    pool_align: int | None = None,
    tile_words: int = TILE_WORDS,
    num_warps: int = NUM_WARPS,
) -> None:
    """Copy K and V of every layer from `src` at `src_blocks` into the pool at `slots`, in one launch.

    Same preconditions as gather_kv_blocks. Slots must be distinct (two tokens writing one slot race).
    """
    prep = prepare(
        k_ptrs, v_ptrs, slots, src, src_blocks, layer_shape, dtype, max_programs, pool_align, ("src", "src_blocks"),
        tile_words, num_warps,
    )
    if prep is None:
        return
    plan = prep.plan
    kernel = runnable(_scatter_kv_kernel, k_ptrs.device)
    kernel[(plan.num_programs,)](
        prep.k_ptrs, prep.v_ptrs, slots, src_blocks, prep.words,
        plan.num_tokens, plan.num_tiles, plan.layers * 2 * plan.num_tiles,
        plan.row_words, plan.block_stride_words, plan.block_tokens,
        BLOCK_T=plan.block_t, BLOCK_W=plan.block_w, ROWS_ALIGNED16=plan.rows_aligned16,
        num_warps=plan.num_warps,
    )


def scatter_kv_blocks_reference(
    k_buffers: list[torch.Tensor],
    v_buffers: list[torch.Tensor],
    slots: torch.Tensor,
    src: torch.Tensor,
    src_blocks: torch.Tensor,
) -> None:
    """Plain torch version of scatter_kv_blocks over the per-layer buffers themselves."""
    slot, block, row = reference_rows(slots, src_blocks, src.shape[3], src.device)
    for layer, (k, v) in enumerate(zip(k_buffers, v_buffers)):
        k[slot] = src[block, layer, 0, row].to(k.device)
        v[slot] = src[block, layer, 1, row].to(v.device)
