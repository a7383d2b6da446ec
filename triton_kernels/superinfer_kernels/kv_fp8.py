"""fp8 (e4m3) rotary blocks: gather device KV into block-first memory as e4m3 codes plus per-block,
per-head scales, and scatter them back dequantized, in one launch each.

Same layout and index math as kv_gather / kv_scatter (token i in block ids[i // block_tokens], row
i % block_tokens), plus scales [blocks, layers, 2, kv_heads] float32. The scheme is
superinfer_sgl/duplexkv/quant.py's: scale = the smallest power of two s >= 2**-126 with amax <= 448 s,
codes = e4m3(x / s) rounded to nearest even. Power-of-two scales make x / s and q * s exact, so
the kernels produce the torch reference's bytes. The e4m3 and bf16 conversions are integer bit
arithmetic (the Triton interpreter cannot cast to fp8 or bf16), so interpreted and compiled kernels
run the same code; (*) nor do they call triton.language's own @jit helpers (tl.max), which are
compiled-only objects when Triton was imported before TRITON_INTERPRET was set. One work item = (block of the launch, layer, K or V); it loops over the KV heads,
and per head reads the block's rows twice (amax, then codes). Device KV: float32, float16, bfloat16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from superinfer_kernels._common import (
    check_block_memory,
    check_blocks_tensor,
    check_float_pool,
    check_rows,
    fail,
    program_count,
    runnable,
)

SRC_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
FP8_STORE = (torch.float8_e4m3fn, torch.uint8)
MAX_TILE_ELEMS = 4096


@triton.jit
def _max2(a, b):
    return tl.maximum(a, b)


@triton.jit
def _row_base(item, k_ptrs, v_ptrs, layers, SRC: tl.constexpr):
    lkv = item % (layers * 2)
    layer = lkv // 2
    ptr = tl.where(lkv % 2 == 0, tl.load(k_ptrs + layer), tl.load(v_ptrs + layer))
    if SRC == 0:
        base = ptr.to(tl.pointer_type(tl.float32))
    elif SRC == 1:
        base = ptr.to(tl.pointer_type(tl.float16))
    else:
        base = ptr.to(tl.pointer_type(tl.uint16))
    return base, lkv, item // (layers * 2)


@triton.jit
def _load_f32(base, offs, mask, SRC: tl.constexpr):
    x = tl.load(base + offs, mask=mask, other=0)
    if SRC == 2:  # bf16 bits -> float32, exact
        return (x.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    return x.to(tl.float32)


@triton.jit
def _store_from_f32(base, offs, x, mask, SRC: tl.constexpr):
    if SRC == 2:  # float32 -> bf16 bits, round to nearest even (x is finite)
        b = x.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        tl.store(base + offs, (b & 0xFFFF).to(tl.uint16), mask=mask)
    elif SRC == 1:
        tl.store(base + offs, x.to(tl.float16), mask=mask)
    else:
        tl.store(base + offs, x, mask=mask)


@triton.jit
def _encode_e4m3(y):
    """float32 in [-448, 448] -> e4m3fn code (int32 0..255), round to nearest even."""
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    a = tl.abs(y)
    ab = a.to(tl.int32, bitcast=True)
    normal = ((ab + 0x7FFFF + ((ab >> 20) & 1)) >> 20) - (120 << 3)
    s = a * 512.0  # subnormal steps of 2**-9, exact
    f = tl.floor(s)
    fi = f.to(tl.int32)
    d = s - f
    sub = fi + ((d > 0.5) | ((d == 0.5) & ((fi & 1) == 1))).to(tl.int32)
    return tl.where(a >= 0.015625, normal, sub) | sign


@triton.jit
def _decode_e4m3(c):
    """e4m3fn code (int32) -> float32, exact (codes 0x7F/0xFF, NaN, are never written)."""
    e = (c >> 3) & 0xF
    m = c & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    v = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    return tl.where((c & 0x80) != 0, -v, v)


@triton.jit
def _gather_fp8_kernel(
    k_ptrs, v_ptrs, slots, block_ids, dst, scales,
    num_tokens, num_items, layers, heads, head_dim, block_tokens, block_stride, scale_stride,
    SRC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        base, lkv, j = _row_base(item, k_ptrs, v_ptrs, layers, SRC)
        blk = tl.load(block_ids + j).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        row = heads * head_dim
        for h in range(0, heads):
            amax = tl.full((), 0.0, tl.float32)
            for t0 in range(0, block_tokens, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                tok = j * block_tokens + t
                tmask = (t < block_tokens) & (tok < num_tokens)
                slot = tl.load(slots + tok, mask=tmask, other=0).to(tl.int64)
                mask = tmask[:, None] & (d < head_dim)[None, :]
                x = _load_f32(base, slot[:, None] * row + h * head_dim + d[None, :], mask, SRC)
                amax = tl.maximum(amax, tl.reduce(tl.reduce(tl.abs(x), 1, _max2), 0, _max2))  # not tl.max (*)
            ab = tl.maximum(amax, 1.1754943508222875e-38).to(tl.int32, bitcast=True)
            k = tl.maximum(((ab >> 23) & 0xFF) - 135 + ((ab & 0x7FFFFF) > 0x600000).to(tl.int32), -126)
            inv = ((127 - k) << 23).to(tl.float32, bitcast=True)
            for t0 in range(0, block_tokens, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                tok = j * block_tokens + t
                tmask = (t < block_tokens) & (tok < num_tokens)
                slot = tl.load(slots + tok, mask=tmask, other=0).to(tl.int64)
                mask = tmask[:, None] & (d < head_dim)[None, :]
                x = _load_f32(base, slot[:, None] * row + h * head_dim + d[None, :], mask, SRC)
                y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
                off = blk * block_stride + (lkv * block_tokens + t).to(tl.int64)[:, None] * row + h * head_dim
                tl.store(dst + off + d[None, :], _encode_e4m3(y).to(tl.uint8), mask=mask)
            scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
            tl.store(scales + blk * scale_stride + lkv * heads + h, scale)


@triton.jit
def _scatter_fp8_kernel(
    k_ptrs, v_ptrs, slots, block_ids, src, scales,
    num_tokens, num_items, layers, heads, head_dim, block_tokens, block_stride, scale_stride,
    SRC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        base, lkv, j = _row_base(item, k_ptrs, v_ptrs, layers, SRC)
        blk = tl.load(block_ids + j).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        row = heads * head_dim
        for h in range(0, heads):
            scale = tl.load(scales + blk * scale_stride + lkv * heads + h)
            for t0 in range(0, block_tokens, BLOCK_T):
                t = t0 + tl.arange(0, BLOCK_T)
                tok = j * block_tokens + t
                tmask = (t < block_tokens) & (tok < num_tokens)
                slot = tl.load(slots + tok, mask=tmask, other=0).to(tl.int64)
                mask = tmask[:, None] & (d < head_dim)[None, :]
                off = blk * block_stride + (lkv * block_tokens + t).to(tl.int64)[:, None] * row + h * head_dim
                c = tl.load(src + off + d[None, :], mask=mask, other=0).to(tl.int32)
                x = _decode_e4m3(c) * scale
                _store_from_f32(base, slot[:, None] * row + h * head_dim + d[None, :], x, mask, SRC)


def _launch(kernel, k_ptrs, v_ptrs, slots, blocks, scales, block_ids, layer_shape, dtype, max_programs, pool_align):
    rows, heads, head_dim = layer_shape
    device = k_ptrs.device
    layers = check_float_pool("fp8", dtype, SRC_CODES, k_ptrs, v_ptrs, slots, block_ids)
    if blocks.dtype not in FP8_STORE:
        fail(f"fp8 block memory must be float8_e4m3fn (or its uint8 view), got {blocks.dtype}")
    block_tokens = check_blocks_tensor("blocks", blocks, layers, heads, head_dim, blocks.dtype)
    check_block_memory("blocks", blocks, device)
    if scales.shape != (blocks.shape[0], layers, 2, heads) or scales.dtype != torch.float32:
        fail(f"scales must be float32 [{blocks.shape[0]}, {layers}, 2, {heads}], got {scales.dtype} "
             f"{tuple(scales.shape)}")
    if scales.shape[0] > 0 and not scales[0].is_contiguous():
        fail("scales must be contiguous within a block")
    check_block_memory("scales", scales, device)
    check_rows(k_ptrs, v_ptrs, slots, block_ids, blocks.shape[0], block_tokens, layer_shape, dtype, pool_align)
    n = slots.numel()
    if n == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_t = max(1, min(triton.next_power_of_2(block_tokens), MAX_TILE_ELEMS // block_d))
    num_items = triton.cdiv(n, block_tokens) * layers * 2
    runnable(kernel, device)[(program_count(device, max_programs, num_items),)](
        k_ptrs.view(torch.int64), v_ptrs.view(torch.int64), slots, block_ids, blocks.view(torch.uint8), scales,
        n, num_items, layers, heads, head_dim, block_tokens, blocks.stride(0), scales.stride(0),
        SRC=SRC_CODES[dtype], BLOCK_T=block_t, BLOCK_D=block_d,
    )


def gather_kv_blocks_fp8(k_ptrs, v_ptrs, slots, dst, dst_scales, dst_blocks, *, layer_shape, dtype,
                         max_programs: int | None = None, pool_align: int | None = None) -> None:
    """gather_kv_blocks into fp8 blocks: e4m3 codes in `dst` [blocks, layers, 2, block_tokens,
    kv_heads, head_dim] (float8_e4m3fn or uint8) and, per block of `dst_blocks`, layer, K/V and head,
    the scale in `dst_scales` [blocks, layers, 2, kv_heads] float32. The blocks' scales cover only the
    tokens of this launch (a block is written by one launch). Asynchronous on CUDA."""
    _launch(_gather_fp8_kernel, k_ptrs, v_ptrs, slots, dst, dst_scales, dst_blocks, layer_shape, dtype,
            max_programs, pool_align)


def scatter_kv_blocks_fp8(k_ptrs, v_ptrs, slots, src, src_scales, src_blocks, *, layer_shape, dtype,
                          max_programs: int | None = None, pool_align: int | None = None) -> None:
    """The inverse: dequantize the fp8 rows of `src` (scales `src_scales`) into the pool at `slots`,
    rounded to the pool's dtype. Only the rows of real tokens are written."""
    _launch(_scatter_fp8_kernel, k_ptrs, v_ptrs, slots, src, src_scales, src_blocks, layer_shape, dtype,
            max_programs, pool_align)
