"""CPU op patches (patches/{rmsnorm_cpu,rotary_forward_cpu,silu_and_mul_cpu,linear_packed_cpu,
lm_head_packed_cpu}.py) against SGLang's own implementations, on random inputs, float32 and bfloat16.

- rotary: bit-identical to RotaryEmbedding.forward_native (same rounding at every step);
- RMSNorm: float32 within 1e-6 relative (summation order of the mean of squares differs);
  bfloat16 outputs within one bf16 ulp of forward_native's, residual sums bit-identical;
- SiLU-and-mul: float32 within 2 ulp (our exp polynomial vs torch's Sleef exp), bfloat16 within
  one bf16 ulp and almost always bit-identical;
- packed linear / lm_head: bit-identical to F.linear / torch.matmul (same oneDNN kernel).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from superinfer_sgl.cpu_attention import cpu_fast_ops_enabled, linear, ops

pytest.importorskip("sglang.srt.layers.layernorm")
from sglang.srt.layers.layernorm import RMSNorm  # noqa: E402
from sglang.srt.layers.rotary_embedding import base as rope_base  # noqa: E402

from superinfer_patches import (  # noqa: E402
    linear_packed_cpu,
    lm_head_packed_cpu,
    rmsnorm_cpu,
    rotary_embedding_cpu,
    rotary_forward_cpu,
    silu_and_mul_cpu,
)

needs_c = pytest.mark.skipif(ops.load() is None, reason="no C compiler")
DTYPES = [torch.float32, torch.bfloat16]


def test_switch() -> None:
    assert cpu_fast_ops_enabled({"SUPERINFER_CPU_COMPAT": "1"})
    assert not cpu_fast_ops_enabled({"SUPERINFER_CPU_COMPAT": "1", "SUPERINFER_CPU_FAST_OPS": "0"})
    assert not cpu_fast_ops_enabled({"SUPERINFER_CPU_ATTENTION": "0", "SUPERINFER_CPU_COMPAT": "1"})
    assert not cpu_fast_ops_enabled({})
    with pytest.raises(ValueError):
        cpu_fast_ops_enabled({"SUPERINFER_CPU_COMPAT": "1", "SUPERINFER_CPU_FAST_OPS": "yes"})


def test_patch_targets_exist() -> None:
    from superinfer_patches import check_target

    for patch in (linear_packed_cpu, lm_head_packed_cpu, rmsnorm_cpu, rotary_forward_cpu, silu_and_mul_cpu):
        check_target(patch.TARGET)


# ---- RMSNorm ----


def make_norm(hidden: int, dtype: torch.dtype, cast_before: bool = False, seed: int = 0) -> RMSNorm:
    norm = RMSNorm(hidden, eps=1e-5, cast_x_before_out_mul=cast_before)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=torch.Generator().manual_seed(seed)) * 0.5 + 1)
    return norm.to(dtype)


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """One bfloat16 ulp at |x| (float32 tensor)."""
    exp = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.pow(2.0, exp - 7)


@needs_c
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 8, 33])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("cast_before", [False, True])
def test_rmsnorm_matches_forward_native(dtype, tokens, with_residual, cast_before) -> None:
    hidden = 576
    norm = make_norm(hidden, dtype, cast_before)
    gen = torch.Generator().manual_seed(tokens)
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype)
    res = (torch.randn(tokens, hidden, generator=gen) * 3).to(dtype) if with_residual else None
    with torch.no_grad():
        ref = RMSNorm.forward_native(norm, x, res)
        ours = rmsnorm_cpu._forward_native(RMSNorm.forward_native, norm, x, res)
    refs = ref if with_residual else (ref,)
    outs = ours if with_residual else (ours,)
    assert len(outs) == len(refs)
    if with_residual:
        assert torch.equal(outs[1], refs[1])  # residual sum: same rounding
    o, r = outs[0].float(), refs[0].float()
    assert o.dtype == r.dtype and o.shape == r.shape
    if dtype == torch.float32:
        torch.testing.assert_close(o, r, atol=1e-6, rtol=1e-6)
    else:
        assert ((o - r).abs() <= ulp_bf16(r)).all()
        assert (o != r).float().mean() < 0.01  # almost all bit-identical


@needs_c
def test_rmsnorm_strided_rows_and_fallbacks() -> None:
    norm = make_norm(64, torch.float32)
    wide = torch.randn(5, 80)
    x = wide[:, :64]  # row stride 80
    with torch.no_grad():
        ref = RMSNorm.forward_native(norm, x)
        ours = rmsnorm_cpu._forward_native(RMSNorm.forward_native, norm, x)
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
        calls = []

        def original(*args, **kwargs):
            calls.append(1)
            return RMSNorm.forward_native(*args, **kwargs)

        rmsnorm_cpu._forward_native(original, norm, x.to(torch.bfloat16))  # weight dtype differs
        rmsnorm_cpu._forward_native(original, norm, x, None, torch.ones(5, 64))  # post_residual_addition
        rmsnorm_cpu._forward_native(original, norm, x.reshape(1, 5, 64))  # 3-D
    assert len(calls) == 3


# ---- rotary ----


def make_rope(dtype: torch.dtype, head_size: int = 64, rot_dim: int = 64, neox: bool = True):
    rope = rope_base.RotaryEmbedding.__new__(rope_base.RotaryEmbedding)
    rotary_embedding_cpu._around_init(rope_base.RotaryEmbedding.__init__, rope, head_size, rot_dim, 4096, 10000,
                                      neox, dtype)
    return rope


@needs_c
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_size,rot_dim", [(64, 64), (64, 32)])
@pytest.mark.parametrize("tokens", [1, 8, 40])
def test_rope_bit_identical(dtype, neox, head_size, rot_dim, tokens) -> None:
    rope = make_rope(dtype, head_size, rot_dim, neox)
    gen = torch.Generator().manual_seed(tokens)
    hq, hkv = 9, 3
    qkv = (torch.randn(tokens, (hq + 2 * hkv) * head_size, generator=gen) * 2).to(dtype)
    q, k, _ = qkv.split([hq * head_size, hkv * head_size, hkv * head_size], dim=-1)  # strided views
    pos = torch.randint(0, 4096, (tokens,), generator=gen)
    with torch.no_grad():
        rq, rk = rope_base.RotaryEmbedding.forward_native(rope, pos, q, k)
        q_before = q.clone()
        oq, ok = rotary_forward_cpu._forward_native(rope_base.RotaryEmbedding.forward_native, rope, pos, q, k)
    assert torch.equal(q, q_before)  # inputs untouched, like forward_native
    assert oq.shape == rq.shape and ok.shape == rk.shape
    assert torch.equal(oq, rq) and torch.equal(ok, rk)


@needs_c
def test_rope_fallbacks_and_bad_position() -> None:
    rope = make_rope(torch.float32)
    q, k = torch.randn(3, 9 * 64), torch.randn(3, 3 * 64)
    calls = []

    def original(*args, **kwargs):
        calls.append(1)
        return rope_base.RotaryEmbedding.forward_native(*args, **kwargs)

    with torch.no_grad():
        rotary_forward_cpu._forward_native(original, rope, torch.tensor([1, 2, 3]), q, k, torch.tensor([1, 1, 1]))
        rotary_forward_cpu._forward_native(original, rope, torch.tensor([1, 2, 3], dtype=torch.int32), q, k)
        rotary_forward_cpu._forward_native(original, rope, torch.tensor([1, 2, 3]), q.bfloat16(), k.bfloat16())
        assert len(calls) == 3
        with pytest.raises(IndexError):
            ops.rope(torch.tensor([0, 4096, 1]), q, 64, 64, rope.cos_sin_cache, True)


# ---- SiLU-and-mul ----


@needs_c
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,d", [(1, 1536), (8, 1536), (33, 100), (4, 7)])
def test_silu_mul_matches_forward_native(dtype, tokens, d) -> None:
    from sglang.srt.layers.activation import SiluAndMul

    act = SiluAndMul()
    gen = torch.Generator().manual_seed(d)
    wide = torch.randn(tokens, 2 * d + 3, generator=gen) * 4
    wide[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    x = wide[:, : 2 * d].to(dtype)  # row stride 2d + 3
    with torch.no_grad():
        ref = SiluAndMul.forward_native(act, x)
        ours = silu_and_mul_cpu._forward_native(SiluAndMul.forward_native, act, x)
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    o, r = ours.float(), ref.float()
    if dtype == torch.float32:
        torch.testing.assert_close(o, r, atol=1e-30, rtol=3e-7)
    else:
        assert ((o - r).abs() <= ulp_bf16(r)).all()
        assert (o != r).float().mean() < 0.01


# ---- packed linear / lm_head ----


@pytest.mark.skipif(not linear._mkldnn_bf16_ok(), reason="no oneDNN bf16")
@pytest.mark.parametrize("tokens", [1, 8, 32, 77])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_bit_identical(tokens, with_bias) -> None:
    from types import SimpleNamespace

    from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod

    gen = torch.Generator().manual_seed(tokens)
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter((torch.randn(960, 576, generator=gen) * 0.05).bfloat16(), requires_grad=False)
    bias = torch.randn(960, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(tokens, 576, generator=gen).bfloat16()
    method = object.__new__(UnquantizedLinearMethod)
    with torch.no_grad():
        ref = F.linear(x, layer.weight, bias)
        out = linear_packed_cpu._apply(UnquantizedLinearMethod.apply, method, layer, x, bias)
        assert torch.equal(out, ref)
        # in-place weight update: repacked
        layer.weight.mul_(2)
        assert torch.equal(linear_packed_cpu._apply(UnquantizedLinearMethod.apply, method, layer, x, bias),
                           F.linear(x, layer.weight, bias))
        # float32 goes to the original
        seen = []
        linear_packed_cpu._apply(lambda *a: seen.append(a) or 0, method, layer, x.float(), None)
        assert len(seen) == 1
    # lm_head: the plain-weight branch of LogitsProcessor._compute_lm_head
    head = SimpleNamespace(weight=layer.weight, quant_method=None)
    proc = SimpleNamespace(use_fp32_lm_head=False, rl_on_policy_target=None)
    with torch.no_grad():
        logits = lm_head_packed_cpu._compute_lm_head(lambda *a, **k: None, proc, x, head)
        assert logits is not None and torch.equal(logits, torch.matmul(x, layer.weight.T))


@pytest.mark.skipif(not linear._mkldnn_bf16_ok(), reason="no oneDNN bf16")
def test_pack_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the memory budget, layers keep F.linear (same results); repacking frees the old bytes."""
    monkeypatch.setattr(linear, "_packed_bytes", 0)
    monkeypatch.setattr(linear, "_budget_bytes", 3 * 64 * 32 * 2)  # room for three 64x32 bf16 weights
    layers = [torch.nn.Module() for _ in range(4)]
    for layer in layers:
        layer.weight = torch.nn.Parameter(torch.randn(64, 32).bfloat16(), requires_grad=False)
    x = torch.randn(5, 32).bfloat16()
    with torch.no_grad():
        for layer in layers:
            assert torch.equal(linear.linear(layer, x, layer.weight), F.linear(x, layer.weight))
        assert [linear.packed(layer, layer.weight) is not None for layer in layers] == [True, True, True, False]
        assert linear._packed_bytes == 3 * 64 * 32 * 2
        layers[0].weight.mul_(2)  # repack in place of the old copy: still within budget
        assert linear.packed(layers[0], layers[0].weight) is not None
        assert linear._packed_bytes == 3 * 64 * 32 * 2
        assert torch.equal(linear.linear(layers[0], x, layers[0].weight), F.linear(x, layers[0].weight))
