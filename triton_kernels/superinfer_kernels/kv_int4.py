"""int4 rotary blocks: gather device KV into block-first memory as packed 4-bit codes with a scale
byte per group of GROUP head_dim values, and scatter them back dequantized, in one launch each.

Same block layout and index math as kv_gather / kv_fp8 (token i in block ids[i // block_tokens], row
i % block_tokens), except that a (token, head) row is row_bytes(head_dim) = ceil(head_dim / 2) code
bytes + ceil(head_dim / GROUP) scale bytes of uint8: blocks [blocks, layers, 2, block_tokens,
kv_heads, row_bytes]. The scheme is superinfer_sgl/duplexkv/quant_int4.py's (kept import-free of
it: this package runs without superinfer_sgl): symmetric codes in [-7, 7], scale m * 2**k with a
3-bit mantissa, codes by counting exact thresholds, so the kernels produce the torch reference's
bytes and values. Conversions are integer bit arithmetic (the interpreter cannot cast to bf16).
One work item = (block of the launch, layer, K or V); it loops over heads and groups, a tile being
BLOCK_T tokens x one group's even and odd values. Device KV: float32, float16, bfloat16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superinfer_kernels._common import check_block_memory, check_float_pool, check_rows, fail, program_count, runnable
from superinfer_kernels.kv_fp8 import SRC_CODES, _load_f32, _max2, _row_base, _store_from_f32

GROUP = 32  # = quant_int4.GROUP
K_MIN, K_MAX = -20, 11  # = quant_int4.K_MIN, K_MAX
MAX_TILE_ELEMS = 4096


def row_bytes(head_dim: int) -> int:
    return (head_dim + 1) // 2 + -(-head_dim // GROUP)


@triton.jit
def _pow2(k):
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _quantize(x, s):
    """|round(x / s)| by exact thresholds (ties away from zero), clipped to 7, signed (int32)."""
    a2 = 2.0 * tl.abs(x)
    # (not tl.zeros: triton.language's own @jit helpers fail under an interpreter set after triton was
    # first imported, as kv_fp8.py notes for tl.max)
    q = (a2 >= s).to(tl.int32)
    for j in tl.static_range(1, 7):
        q += (a2 >= (2 * j + 1) * s).to(tl.int32)
    return tl.where(x < 0, -q, q)


@triton.jit
def _gather_int4_kernel(
    k_ptrs, v_ptrs, slots, block_ids, dst,
    num_tokens, num_items, layers, heads, head_dim, block_tokens, block_stride, row_b, code_b,
    SRC: tl.constexpr, BLOCK_T: tl.constexpr, HALF_G: tl.constexpr,
):
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        base, lkv, j = _row_base(item, k_ptrs, v_ptrs, layers, SRC)
        blk = tl.load(block_ids + j).to(tl.int64)
        i = tl.arange(0, HALF_G)
        row = heads * head_dim
        for h in range(0, heads):
            for g0 in range(0, head_dim, 2 * HALF_G):
                de = g0 + 2 * i  # the group's even values; d + 1 the odd ones
                for t0 in range(0, block_tokens, BLOCK_T):
                    t = t0 + tl.arange(0, BLOCK_T)
                    tok = j * block_tokens + t
                    tmask = (t < block_tokens) & (tok < num_tokens)
                    slot = tl.load(slots + tok, mask=tmask, other=0).to(tl.int64)
                    src = slot[:, None] * row + h * head_dim + de[None, :]
                    me = tmask[:, None] & (de < head_dim)[None, :]
                    mo = tmask[:, None] & (de + 1 < head_dim)[None, :]
                    xe = _load_f32(base, src, me, SRC)
                    xo = _load_f32(base, src + 1, mo, SRC)
                    amax = tl.reduce(tl.maximum(tl.abs(xe), tl.abs(xo)), 1, _max2)  # per token; not tl.max
                    ab = amax.to(tl.int32, bitcast=True)
                    k = ((ab >> 23) & 0xFF) - 133 + ((ab & 0x7FFFFF) > 0x520000).to(tl.int32)
                    k = tl.minimum(tl.maximum(k, K_MIN), K_MAX)
                    p = _pow2(k)
                    m = tl.full(k.shape, 8, tl.int32)
                    for jj in tl.static_range(8, 15):
                        m += (amax > (7 * jj) * p).to(tl.int32)
                    s = m.to(tl.float32) * p
                    qe = _quantize(xe, s[:, None])
                    qo = _quantize(xo, s[:, None])
                    byte = (qe & 0xF) | ((qo & 0xF) << 4)
                    out = blk * block_stride + ((lkv * block_tokens + t).to(tl.int64) * heads + h) * row_b
                    tl.store(dst + out[:, None] + (g0 // 2 + i)[None, :], byte.to(tl.uint8), mask=me)
                    code = ((k - K_MIN) << 3) | (m - 8)
                    smask = (t < block_tokens) & (tok < num_tokens)
                    tl.store(dst + out + code_b + g0 // (2 * HALF_G), code.to(tl.uint8), mask=smask)


@triton.jit
def _scatter_int4_kernel(
    k_ptrs, v_ptrs, slots, block_ids, src,
    num_tokens, num_items, layers, heads, head_dim, block_tokens, block_stride, row_b, code_b,
    SRC: tl.constexpr, BLOCK_T: tl.constexpr, HALF_G: tl.constexpr,
):
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        base, lkv, j = _row_base(item, k_ptrs, v_ptrs, layers, SRC)
        blk = tl.load(block_ids + j).to(tl.int64)
        i = tl.arange(0, HALF_G)
        row = heads * head_dim
        for h in range(0, heads):
            for g0 in range(0, head_dim, 2 * HALF_G):
                de = g0 + 2 * i
                for t0 in range(0, block_tokens, BLOCK_T):
                    t = t0 + tl.arange(0, BLOCK_T)
                    tok = j * block_tokens + t
                    tmask = (t < block_tokens) & (tok < num_tokens)
                    slot = tl.load(slots + tok, mask=tmask, other=0).to(tl.int64)
                    me = tmask[:, None] & (de < head_dim)[None, :]
                    mo = tmask[:, None] & (de + 1 < head_dim)[None, :]
                    off = blk * block_stride + ((lkv * block_tokens + t).to(tl.int64) * heads + h) * row_b
                    code = tl.load(src + off + code_b + g0 // (2 * HALF_G), mask=tmask, other=0).to(tl.int32)
                    s = ((code & 7) + 8).to(tl.float32) * _pow2((code >> 3) + K_MIN)
                    byte = tl.load(src + off[:, None] + (g0 // 2 + i)[None, :], mask=me, other=0).to(tl.int32)
                    qe = ((byte & 0xF) ^ 8) - 8
                    qo = (((byte >> 4) & 0xF) ^ 8) - 8
                    dst = slot[:, None] * row + h * head_dim + de[None, :]
                    _store_from_f32(base, dst, qe.to(tl.float32) * s[:, None], me, SRC)
                    _store_from_f32(base, dst + 1, qo.to(tl.float32) * s[:, None], mo, SRC)


def _launch(kernel, k_ptrs, v_ptrs, slots, blocks, block_ids, layer_shape, dtype, max_programs, pool_align):
    rows, heads, head_dim = layer_shape
    device = k_ptrs.device
    layers = check_float_pool("int4", dtype, SRC_CODES, k_ptrs, v_ptrs, slots, block_ids)
    if blocks.dtype != torch.uint8:
        fail(f"int4 block memory must be uint8, got {blocks.dtype}")
    rb = row_bytes(head_dim)
    if blocks.dim() != 6 or tuple(blocks.shape[1:3]) + tuple(blocks.shape[4:]) != (layers, 2, heads, rb):
        fail(f"int4 blocks must be [blocks, {layers}, 2, block_tokens, {heads}, {rb}] (row_bytes of head_dim "
             f"{head_dim}), got {tuple(blocks.shape)}")
    block_tokens = blocks.shape[3]
    if block_tokens < 1:
        fail(f"blocks has block_tokens={block_tokens}")
    if blocks.shape[0] > 0 and not blocks[0].is_contiguous():
        fail("blocks must be contiguous within a block (only the block stride may differ)")
    check_block_memory("blocks", blocks, device)
    check_rows(k_ptrs, v_ptrs, slots, block_ids, blocks.shape[0], block_tokens, layer_shape, dtype, pool_align)
    n = slots.numel()
    if n == 0:
        return
    # a tile spans one group (GROUP values), or the whole row when it is shorter than a group
    half_g = GROUP // 2 if head_dim >= GROUP else triton.next_power_of_2((head_dim + 1) // 2)
    block_t = max(1, min(triton.next_power_of_2(block_tokens), MAX_TILE_ELEMS // (2 * half_g)))
    num_items = triton.cdiv(n, block_tokens) * layers * 2
    runnable(kernel, device)[(program_count(device, max_programs, num_items),)](
        k_ptrs.view(torch.int64), v_ptrs.view(torch.int64), slots, block_ids, blocks,
        n, num_items, layers, heads, head_dim, block_tokens, blocks.stride(0), rb, (head_dim + 1) // 2,
        SRC=SRC_CODES[dtype], BLOCK_T=block_t, HALF_G=half_g,
    )


def gather_kv_blocks_int4(k_ptrs, v_ptrs, slots, dst, dst_blocks, *, layer_shape, dtype,
                          max_programs: int | None = None, pool_align: int | None = None) -> None:
    """gather_kv_blocks into int4 blocks: `dst` [blocks, layers, 2, block_tokens, kv_heads,
    row_bytes(head_dim)] uint8, each (token, head) row packed codes then its groups' scale bytes.
    Rows depend only on their own token, so any launch writes the bytes a whole-block launch
    would. Asynchronous on CUDA."""
    _launch(_gather_int4_kernel, k_ptrs, v_ptrs, slots, dst, dst_blocks, layer_shape, dtype, max_programs,
            pool_align)


def scatter_kv_blocks_int4(k_ptrs, v_ptrs, slots, src, src_blocks, *, layer_shape, dtype,
                           max_programs: int | None = None, pool_align: int | None = None) -> None:
    """The inverse: dequantize the int4 rows of `src` into the pool at `slots` (exact in the pool's
    dtype). Only the rows of real tokens are written."""
    _launch(_scatter_int4_kernel, k_ptrs, v_ptrs, slots, src, src_blocks, layer_shape, dtype, max_programs,
            pool_align)
