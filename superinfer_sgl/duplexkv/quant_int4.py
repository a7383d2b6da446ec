"""int4 rotary host blocks (`--rotary-kv-dtype int4`, or a class's "rotary_kv_dtype": "int4"):
symmetric 4-bit codes with a one-byte scale per group of GROUP head_dim values of one token and KV
head. Lossy, opt-in; the default path copies bits (docs/duplexkv.md).

Layout. Each (token, KV head) row of head_dim values becomes row_bytes(head_dim) bytes:
ceil(head_dim / 2) bytes of codes (value 2i in the low nibble of byte i, value 2i+1 in the high
nibble; a missing last value of an odd head_dim is a zero nibble), then ceil(head_dim / GROUP)
scale bytes, one per group (group g = values [g*GROUP, (g+1)*GROUP)). A host block is uint8
[layers, 2, block_tokens, kv_heads, row_bytes(head_dim)]: the scales travel inside the block, so a
transfer moves one tensor (no scale tensor beside it, unlike fp8). A row depends on nothing but
itself (no per-block statistics), so any subset of tokens quantizes to the same bytes.

Codes. q in [-7, 7] as a two's-complement nibble (-8 is never written): x' = q * s. Symmetric, so
0 is exact, zero (or unwritten, all-zero) memory decodes to zeros, and no zero point is stored;
RoPE'd K and V rows are near sign-symmetric within a group. q = round(x / s), ties away from
zero, computed as the number of thresholds (j + 1/2) s, j = 0..6, that |x| reaches; every
threshold is exact in float32, so there is no division and no rounding to disagree about.

Scales. s = m * 2**k with m in 8..15 (a 3-bit mantissa) and k in [K_MIN, K_MAX] = [-20, 11],
stored as the byte ((k - K_MIN) << 3) | (m - 8); the group's s is the smallest such value with
amax <= 7 s (k from amax's float32 exponent bits, m by exact comparisons), S_MIN = 2**-17 when the
group is smaller. q * s needs at most 7 significant bits, so the decoded value is exact in float32,
bfloat16 and float16 alike (fp16 subnormals included): torch and the Triton kernels, compiled or
interpreted, produce the same bytes both ways.

Error bound (per element, s its group's scale): |x - x'| <= s / 2 <= max(amax * 9 / 112, 2**-18)
(s is within 9/8 of amax / 7), i.e. about 8% of the group's largest magnitude, where fp8's is 6%
of the element's own. Preconditions: finite KV, and |x| <= 7 * S_MAX = 215040 (beyond it s
saturates at S_MAX = 30720 and codes clip to +-7; no bfloat16 KV of a working model comes near).

Bytes: GROUP = 32 gives 17 bytes per 32 values, 0.53125 per value: at head_dim 64 a row is 34
bytes where fp8 stores 64 (+ 4 scale bytes per block_tokens rows), 0.529 of fp8's bytes at
block_tokens 16 (0.266 of bf16, 0.133 of float32). GROUP 64 would save 1/64 byte per value (3%)
but spread one group's scale over twice the values, doubling the reach of one outlier; 16 would
cost 6% more bytes. A one-byte scale (3-bit mantissa: at most 12.5% of the code range unused, where
a power-of-two scale would waste up to half of it, i.e. one of int4's few bits) keeps the
overhead at 1/32 byte per value.
"""

from __future__ import annotations

import torch

GROUP = 32  # head_dim values per scale
QMAX = 7
K_MIN, K_MAX = -20, 11
S_MIN = 2.0**-17  # 8 * 2**K_MIN
S_MAX = 15.0 * 2.0**K_MAX  # 30720
STORE_DTYPE = torch.uint8


def code_bytes(head_dim: int) -> int:
    return (head_dim + 1) // 2


def groups(head_dim: int) -> int:
    return -(-head_dim // GROUP)


def row_bytes(head_dim: int) -> int:
    """Host bytes of one (token, KV head) row: packed codes, then one scale byte per group."""
    return code_bytes(head_dim) + groups(head_dim)


def scale_codes(amax: torch.Tensor) -> torch.Tensor:
    """The scale byte (int32 0..255) of groups with largest magnitude `amax` (finite, >= 0): the
    smallest s = m * 2**k (m in 8..15, k in [K_MIN, K_MAX]) with amax <= 7 s, clamped to the range."""
    a = amax.float().contiguous()
    bits = a.view(torch.int32)
    biased = (bits >> 23) & 0xFF  # amax = 1.f * 2**(biased - 127); 0 and subnormals clamp to K_MIN
    # 7 * 15 * 2**(biased - 133) = 1.640625 * 2**(biased - 127): above it, the next binade
    k = (biased - 133 + ((bits & 0x7FFFFF) > 0x520000).to(torch.int32)).clamp(K_MIN, K_MAX)
    pow2 = torch.ldexp(torch.ones_like(a), k)
    m = torch.full_like(k, 8)
    for j in range(8, 15):  # 7 * j * 2**k is exact: the first j with amax <= 7 j 2**k
        m += (a > 7 * j * pow2).to(torch.int32)
    return ((k - K_MIN) << 3) | (m - 8)


def scales_of(codes: torch.Tensor) -> torch.Tensor:
    """Scale bytes -> float32 scales m * 2**k."""
    c = codes.to(torch.int32)
    return torch.ldexp(((c & 7) + 8).float(), (c >> 3) + K_MIN)


def encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q = round(x / scale) (ties away from zero), clipped to +-7, int32; scale broadcast to x."""
    a2 = 2 * x.float().abs()
    q = torch.zeros(x.shape, dtype=torch.int32)
    for j in range(QMAX):
        q += (a2 >= (2 * j + 1) * scale).to(torch.int32)
    return torch.where(x < 0, -q, q)


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float32 -> [..., groups, GROUP], zero-padded (zeros leave the amax alone)."""
    dim = x.shape[-1]
    pad = groups(dim) * GROUP - dim
    if pad:
        x = torch.cat([x, x.new_zeros((*x.shape[:-1], pad))], dim=-1)
    return x.reshape(*x.shape[:-1], groups(dim), GROUP)


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., head_dim] (float32/16, bfloat16) -> host rows [..., row_bytes(head_dim)] uint8."""
    dim = x.shape[-1]
    g = _grouped(x.float().cpu())
    sc = scale_codes(g.abs().amax(dim=-1))
    q = encode(g, scales_of(sc)[..., None]).reshape(*x.shape[:-1], -1)[..., :dim]
    if dim % 2:
        q = torch.cat([q, q.new_zeros((*q.shape[:-1], 1))], dim=-1)
    packed = (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)
    return torch.cat([packed, sc], dim=-1).to(STORE_DTYPE)


def dequantize(rows: torch.Tensor, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Host rows [..., row_bytes(head_dim)] -> values [..., head_dim] in `dtype` (exact: see above)."""
    if rows.shape[-1] != row_bytes(head_dim):
        raise ValueError(f"int4 rows of head_dim {head_dim} are {row_bytes(head_dim)} bytes, got {rows.shape[-1]}")
    r = rows.cpu().to(torch.int32)
    nb = code_bytes(head_dim)
    packed, sc = r[..., :nb], r[..., nb:]
    q = torch.stack([((packed & 0xF) ^ 8) - 8, (((packed >> 4) & 0xF) ^ 8) - 8], dim=-1)
    q = q.reshape(*r.shape[:-1], 2 * nb)[..., :head_dim]
    s = scales_of(sc).repeat_interleave(GROUP, dim=-1)[..., :head_dim]
    return (q.float() * s).to(dtype)


def group_scales(x: torch.Tensor) -> torch.Tensor:
    """The scale each element of x [..., head_dim] gets (float32, x's shape)."""
    dim = x.shape[-1]
    s = scales_of(scale_codes(_grouped(x.float().cpu()).abs().amax(dim=-1)))
    return s.repeat_interleave(GROUP, dim=-1)[..., :dim]


def error_bound(x: torch.Tensor) -> torch.Tensor:
    """The largest |x - dequantize(quantize(x))| allowed per element: half its group's scale
    (for |x| <= 7 * S_MAX)."""
    return group_scales(x) / 2


# ---------------------------------------------------------------- block-first references (kernels' tests)


def gather_int4_reference(k_buffers, v_buffers, slots, dst, dst_blocks) -> None:
    """Torch version of superinfer_kernels.gather_kv_blocks_int4: token i of `slots` into block
    dst_blocks[i // block_tokens], row i % block_tokens, of dst [blocks, layers, 2, block_tokens,
    kv_heads, row_bytes] uint8."""
    bt = dst.shape[3]
    tok = torch.arange(slots.numel())
    block = dst_blocks.cpu().long()[tok // bt]
    for layer, bufs in enumerate(zip(k_buffers, v_buffers)):
        for kv, buf in enumerate(bufs):
            dst[block, layer, kv, tok % bt] = quantize(buf[slots.long()]).to(dst.device)


def scatter_int4_reference(k_buffers, v_buffers, slots, src, src_blocks) -> None:
    """Torch version of superinfer_kernels.scatter_kv_blocks_int4 (the inverse of the gather)."""
    bt = src.shape[3]
    tok = torch.arange(slots.numel())
    block = src_blocks.cpu().long()[tok // bt]
    for layer, bufs in enumerate(zip(k_buffers, v_buffers)):
        for kv, buf in enumerate(bufs):
            rows = src[block, layer, kv, tok % bt]
            buf[slots.long()] = dequantize(rows, buf.shape[-1], buf.dtype).to(buf.device)
