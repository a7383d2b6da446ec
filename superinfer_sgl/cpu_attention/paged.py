"""Attention over SGLang's paged (token-slot) KV pool, in plain torch (no sglang import).

The KV pool is one [slots, kv_heads, head_dim] tensor per layer for K and for V; a request's
tokens live at the slots listed in its row of `req_to_token`. A *plan* is built once per forward
pass (it depends on the batch, not on the layer) and every layer reuses it:

    plan = plan_decode(req_to_token, req_pool_indices, seq_lens)       # once per step
    decode_attention(q, k_cache, v_cache, plan, scale, out)            # per layer

Decode batches all requests: one gather of every request's K/V rows, padded to the longest
request with slot 0 (a real, zeroed pool row SGLang reserves for padding, so the gather never
reads an arbitrary index), then two matmuls and a masked float32 softmax. GQA needs no K/V
repeat: the query heads sharing a KV head are stacked, [B, Hq, D] -> [B, Hkv, G, D].
(native.py has a faster C kernel for decode; this is its fallback and its reference.)

Extend (prefill) runs one SDPA per request, but unlike torch_native it queries only the new
tokens (not prefix + new), with a causal mask offset by the prefix length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention


@dataclass(frozen=True)
class DecodePlan:
    """Per-step decode metadata shared by all layers: one query token per request."""

    slots: torch.Tensor  # [B * Lmax] int64: padded KV slots, row-major by request
    valid: torch.Tensor  # [B, 1, 1, Lmax] bool: key position < seq_len
    batch: int
    max_len: int

    def __post_init__(self) -> None:
        assert self.slots.dtype == torch.int64 and self.slots.dim() == 1
        assert self.slots.numel() == self.batch * self.max_len
        assert self.valid.shape == (self.batch, 1, 1, self.max_len)


@dataclass(frozen=True)
class ExtendSegment:
    """One request of an extend batch: q rows [q_start, q_start + q_len) attend to `slots`."""

    q_start: int
    q_len: int
    slots: torch.Tensor  # [seq_len] int64: prefix + new tokens
    mask: torch.Tensor | None  # [q_len, seq_len] bool when there is a prefix; None: plain causal

    def __post_init__(self) -> None:
        assert 0 < self.q_len <= self.slots.numel()


def _padded_slots(
    req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, lens: torch.Tensor, max_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, max_len] slots (0 past each length) and the [B, max_len] validity mask."""
    assert req_to_token.dim() == 2 and max_len <= req_to_token.shape[1], "seq longer than req_to_token"
    cols = torch.arange(max_len, device=lens.device)
    valid = cols.unsqueeze(0) < lens.unsqueeze(1)
    rows = req_to_token.index_select(0, req_pool_indices.long())[:, :max_len].long()
    return rows.masked_fill_(~valid, 0), valid


def plan_decode(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int | None = None,
) -> DecodePlan:
    """Build the decode plan. max_len: max(seq_lens) if the caller already has it on the host."""
    batch = seq_lens.shape[0]
    if max_len is None:
        max_len = int(seq_lens.max()) if batch else 0
    slots, valid = _padded_slots(req_to_token, req_pool_indices, seq_lens, max_len)
    return DecodePlan(slots.reshape(-1), valid.view(batch, 1, 1, max_len), batch, max_len)


def plan_extend(
    req_to_token: torch.Tensor,
    req_pool_indices: list[int],
    seq_lens: list[int],
    prefix_lens: list[int],
    extend_lens: list[int],
) -> list[ExtendSegment]:
    """Per-request segments of an extend batch (host ints in, so no per-layer syncs later).

    Request b adds extend_lens[b] tokens after a cached prefix of prefix_lens[b] tokens; its
    keys are the first seq_lens[b] = prefix + extend slots of its req_to_token row.
    """
    assert len(req_pool_indices) == len(seq_lens) == len(prefix_lens) == len(extend_lens)
    segments, q_start = [], 0
    for row, seq_len, prefix, extend in zip(req_pool_indices, seq_lens, prefix_lens, extend_lens):
        assert prefix + extend == seq_len, f"prefix {prefix} + extend {extend} != seq_len {seq_len}"
        if extend > 0:
            slots = req_to_token[row, :seq_len].long()
            mask = None
            if prefix > 0:  # query i sits at position prefix + i and sees keys <= that
                q_pos = torch.arange(prefix, seq_len, device=slots.device).unsqueeze(1)
                mask = torch.arange(seq_len, device=slots.device).unsqueeze(0) <= q_pos
            segments.append(ExtendSegment(q_start, extend, slots, mask))
        q_start += extend
    return segments


def _check_pool(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
    assert q.dim() == 3 and k_cache.dim() == 3 and v_cache.dim() == 3, "q [T,Hq,D], pools [slots,Hkv,D]"
    assert k_cache.shape[:2] == v_cache.shape[:2] and k_cache.shape[2] == q.shape[2]
    assert q.shape[1] % k_cache.shape[1] == 0, "query heads must be a multiple of KV heads"
    assert out.shape == (q.shape[0], q.shape[1], v_cache.shape[2])
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and q.stride(-1) == 1


def _gather(cache: torch.Tensor, slots: torch.Tensor, batch: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, Hkv, L, D] contiguous copy of the padded slots in `dtype`.

    Two passes: a row gather (index_select of whole [Hkv*D] rows, the fast path) and one
    transposing copy that also does the dtype cast, so the matmuls below read contiguous
    [L, D] matrices per (request, KV head).
    """
    heads, dim = cache.shape[1], cache.shape[2]
    rows = cache.view(cache.shape[0], heads * dim).index_select(0, slots)
    out = torch.empty((batch, heads, length, dim), dtype=dtype, device=cache.device)
    out.copy_(rows.view(batch, length, heads, dim).transpose(1, 2))
    return out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """out[b] = softmax(q[b] K_b^T * scale) V_b for every request b at once.

    q: [B, Hq, D]; k_cache, v_cache: [slots, Hkv, D]; out: [B, Hq, Dv] (written in place).
    Scores and softmax are computed in float32 whatever the storage dtype.
    """
    _check_pool(q, k_cache, v_cache, out)
    batch, hq, dim = q.shape
    assert batch == plan.batch
    if batch == 0:
        return out
    hkv = k_cache.shape[1]
    k = _gather(k_cache, plan.slots, batch, plan.max_len, torch.float32)  # [B, Hkv, L, D]
    v = _gather(v_cache, plan.slots, batch, plan.max_len, torch.float32)
    qg = q.reshape(batch, hkv, hq // hkv, dim).float()  # query heads grouped by their KV head
    scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(scale)  # [B, Hkv, G, L]
    scores.masked_fill_(~plan.valid, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o = torch.matmul(probs, v)  # [B, Hkv, G, Dv]
    out.copy_(o.view(batch, hq, v_cache.shape[2]))
    return out


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    segments: list[ExtendSegment],
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its prefix + new tokens.

    q: [T, Hq, D] (requests' tokens back to back); out: [T, Hq, Dv] (written in place).
    The new tokens' K/V must already be in the pool.
    """
    _check_pool(q, k_cache, v_cache, out)
    gqa = q.shape[1] != k_cache.shape[1]
    for seg in segments:
        rows = slice(seg.q_start, seg.q_start + seg.q_len)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, E, D]
        k = k_cache.index_select(0, seg.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, Hkv, S, D]
        v = v_cache.index_select(0, seg.slots).transpose(0, 1).unsqueeze(0).to(q.dtype)
        o = scaled_dot_product_attention(
            qs, k, v, attn_mask=seg.mask, is_causal=seg.mask is None, scale=scale, enable_gqa=gqa
        )
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out
