"""fp8 (e4m3) rotary host blocks (`--rotary-kv-dtype fp8_e4m3`): quantize KV on its way to the host
pool, dequantize it on its way back. Lossy, opt-in; the default path copies bits (docs/duplexkv.md).

Scales: one float32 per host block, layer, K/V and KV head (`HostKVPool.scales`, shape
[num_blocks, layers, 2, kv_heads]), over the block's rows of that head (block_tokens x head_dim).
The scale is amax/448 rounded up to a power of two (at least 2**-126): the smallest s = 2**k with
amax <= 448 * s. A power of two makes x / s and q * s exact in float32, so the only error is e4m3's
own rounding of x / s (round to nearest even): |x - x'| <= max(|x| * 2**-4, s * 2**-10) (relative
2**-4 for normals, half of e4m3's smallest subnormal step below 2**-6), and every implementation
(this torch code, the Triton kernels, compiled or interpreted) produces the same bytes. It costs
e4m3 nothing but one binade of headroom for the smallest values of a block (s is at most twice
amax/448). A zero block gets s = 2**-126 and comes back as zeros, never NaN/inf. The KV must be
finite (a NaN or inf in a block makes the block's values undefined).

Host block codes are stored as float8_e4m3fn (viewed as uint8 for indexing, which CPU torch lacks
for fp8). Only the `torch` and Triton transfer paths implement it (`naive` is the stock-swap
baseline and stays bit-exact).

The int4 host format (`int4`: 4-bit codes, a scale byte per group of 32 values of a row) is
quant_int4.py's; this module names the formats (FORMATS) and their host dtypes for both.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_DTYPE = torch.float8_e4m3fn
MIN_SCALE_EXP = -126  # scales stay normal float32 numbers, so 1/s is one too
SCALE_DTYPE = torch.float32
# --rotary-kv-dtype values (config.ROTARY_KV_DTYPES) -> host block dtype; None = the device's dtype.
# int4 blocks are bytes: packed codes and their scale bytes (quant_int4.py).
HOST_DTYPES: dict[str, torch.dtype | None] = {"auto": None, "fp8_e4m3": FP8_DTYPE, "int4": torch.uint8}
FORMATS = tuple(HOST_DTYPES)
LOSSY_FORMATS = ("fp8_e4m3", "int4")  # a rotation through these changes the KV (within their bounds)


def host_dtype(rotary_kv_dtype: str, device_dtype: torch.dtype) -> torch.dtype:
    """The dtype host blocks store for a --rotary-kv-dtype value and the device KV dtype."""
    if rotary_kv_dtype not in HOST_DTYPES:
        raise ValueError(f"--rotary-kv-dtype must be one of {tuple(HOST_DTYPES)}, got {rotary_kv_dtype!r}")
    dtype = HOST_DTYPES[rotary_kv_dtype]
    if dtype is None:
        return device_dtype
    if not device_dtype.is_floating_point or torch.empty((), dtype=device_dtype).element_size() < 2:
        raise ValueError(
            f"--rotary-kv-dtype {rotary_kv_dtype} needs a 16- or 32-bit float device KV cache, not {device_dtype} "
            "(an fp8 KV cache is already 1 byte per value: use --rotary-kv-dtype auto; the host formats "
            "quantize 16/32-bit floats only)"
        )
    return dtype


def is_quantized(host_dtype_: torch.dtype, device_dtype: torch.dtype) -> bool:
    return host_dtype_ == FP8_DTYPE and device_dtype != FP8_DTYPE


def scale_bytes_per_block(layers: int, kv_heads: int) -> int:
    return layers * 2 * kv_heads * torch.empty((), dtype=SCALE_DTYPE).element_size()


def scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """k of the scale 2**k: the smallest k >= MIN_SCALE_EXP with amax <= 448 * 2**k (int32)."""
    amax = amax.float().clamp_min(2.0**MIN_SCALE_EXP)
    mant, exp = torch.frexp(amax)  # amax = mant * 2**exp, mant in [0.5, 1)
    # 448 * 2**(exp - 9) = 0.875 * 2**exp: enough when mant <= 0.875, else one more binade
    k = exp - 9 + (mant > 0.875).to(exp.dtype)
    return k.clamp_min(MIN_SCALE_EXP).to(torch.int32)


def scales_for(amax: torch.Tensor) -> torch.Tensor:
    return torch.ldexp(torch.ones_like(amax, dtype=SCALE_DTYPE), scale_exponent(amax))


def encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale (broadcast) in e4m3, saturated to +-448; x / scale is exact (power-of-two scale)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def decode(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (q.view(FP8_DTYPE).float() * scale).to(dtype)


def quantize_rows(rows: torch.Tensor, block_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token rows [n, kv_heads, head_dim] of one layer's K or V, token i in the launch's block
    i // block_tokens -> (e4m3 codes [n, kv_heads, head_dim], scales [ceil(n / block_tokens), kv_heads])."""
    n, heads, dim = rows.shape
    nb = -(-n // block_tokens)
    x = rows.float()
    padded = x.new_zeros((nb * block_tokens, heads, dim))  # zeros leave the amax alone
    padded[:n] = x
    amax = padded.view(nb, block_tokens, heads, dim).abs().amax(dim=(1, 3))
    scale = scales_for(amax)
    tok_scale = scale.repeat_interleave(block_tokens, dim=0)[:n]
    return encode(x, tok_scale[:, :, None]), scale


def dequantize_rows(codes: torch.Tensor, tok_scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Codes [n, kv_heads, head_dim] with each token's scales [n, kv_heads] -> values in `dtype`."""
    return decode(codes, tok_scales.float()[:, :, None], dtype)


def error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The largest |x - dequantize(quantize(x))| allowed per element (scale broadcast to x)."""
    return torch.maximum(x.float().abs() * 2.0**-4, scale * 2.0**-10)


# ---------------------------------------------------------------- block-first references (kernels' tests)


def gather_fp8_reference(k_buffers, v_buffers, slots, dst, dst_scales, dst_blocks) -> None:
    """Torch version of superinfer_kernels.gather_kv_blocks_fp8: token i of `slots` into block
    dst_blocks[i // block_tokens], row i % block_tokens, as e4m3 codes; the scales of those blocks."""
    bt = dst.shape[3]
    n = slots.numel()
    tok = torch.arange(n)
    block = dst_blocks.cpu().long()
    codes8 = dst.view(torch.uint8)
    for layer, bufs in enumerate(zip(k_buffers, v_buffers)):
        for kv, buf in enumerate(bufs):
            q, scale = quantize_rows(buf[slots.long()].cpu(), bt)
            codes8[block[tok // bt], layer, kv, tok % bt] = q.view(torch.uint8)
            dst_scales[block, layer, kv] = scale


def scatter_fp8_reference(k_buffers, v_buffers, slots, src, src_scales, src_blocks) -> None:
    """Torch version of superinfer_kernels.scatter_kv_blocks_fp8 (the inverse of the gather)."""
    bt = src.shape[3]
    tok = torch.arange(slots.numel())
    block = src_blocks.cpu().long()[tok // bt]
    for layer, bufs in enumerate(zip(k_buffers, v_buffers)):
        for kv, buf in enumerate(bufs):
            codes = src.view(torch.uint8)[block, layer, kv, tok % bt]
            buf[slots.long()] = dequantize_rows(codes, src_scales[block, layer, kv], buf.dtype).to(buf.device)
