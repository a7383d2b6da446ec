"""int4 rotary host blocks (--rotary-kv-dtype int4, or a class's "rotary_kv_dtype"): the format
(quant_int4.py) and its error bound (property tests), the Triton kernels against the torch reference
bit for bit (TRITON_INTERPRET=1 on CPU, small sizes), the host pool's int4 blocks and their bytes,
and per-class parsing with the config's checks."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "triton_kernels"))

from superinfer_kernels import gather_kv_blocks_int4, scatter_kv_blocks_int4  # noqa: E402
from superinfer_sgl.config import ConfigError, SuperInferConfig, check_rotary_kv_dtype  # noqa: E402
from superinfer_sgl.duplexkv import DevicePoolView, HostKVPool, quant, quant_int4 as q4  # noqa: E402
from superinfer_sgl.duplexkv.host_pool import block_bytes  # noqa: E402
from superinfer_sgl.rotasched.slo import SloClasses, SloError  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs Triton")
PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def kv_values(shape, gen, dtype=torch.float32, spread=(1e-3, 1.0, 300.0)):
    x = torch.randn(shape, generator=gen)
    x *= torch.tensor([spread[h % len(spread)] for h in range(shape[-2])])[:, None]
    return x.to(dtype)


# ---------------------------------------------------------------- the format (quant_int4.py)


def test_layout_and_bytes_against_fp8():
    assert q4.row_bytes(64) == 32 + 2 and q4.row_bytes(128) == 64 + 4 and q4.row_bytes(5) == 3 + 1
    assert q4.row_bytes(80) == 40 + 3  # a partial last group has its own scale byte
    # SmolLM2-135M (30 layers, 3 KV heads, head_dim 64), 16-token blocks
    args = (30, 3, 64, 16, torch.bfloat16)
    int4, fp8, bf16 = (block_bytes(*args, f) for f in ("int4", "fp8_e4m3", "auto"))
    assert int4 == 30 * 2 * 16 * 3 * 34 and fp8 == 30 * 2 * 16 * 3 * 64 + 30 * 2 * 3 * 4
    assert int4 / fp8 == pytest.approx(34 / 64.25) and 0.52 < int4 / fp8 < 0.53
    assert int4 / bf16 == pytest.approx(34 / 128)


def test_nibbles_and_scale_byte_are_where_the_docstring_says():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2], x[0, 33] = 7.0, -7.0, 3.0, 1.0
    r = q4.quantize(x)[0]
    # group 0: amax 7 -> s = 1 = 8 * 2**-3: k - K_MIN = 17, m - 8 = 0
    assert int(r[32]) == (17 << 3) and q4.scales_of(r[32:33]).item() == 1.0
    assert int(r[0]) == (7 | ((-7 & 0xF) << 4)) and int(r[1]) == 3
    assert q4.dequantize(r[None], 64, torch.float32)[0, :3].tolist() == [7.0, -7.0, 3.0]
    # value 33 (odd: high nibble), group 1's amax: s = 10 * 2**-6 (the smallest grid value >= 1/7),
    # so its code is round(6.4) = 6 (the amax's code is 6 or 7: s is within 9/8 of amax / 7)
    assert int(r[16]) == 0x60 and int(r[33]) == ((-6 - q4.K_MIN) << 3) | 2


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_round_trip_within_the_bound(dtype):
    gen = torch.Generator().manual_seed(1)
    x = kv_values((37, 3, 80), gen, dtype)
    back = q4.dequantize(q4.quantize(x), 80, dtype)
    assert back.dtype == dtype and back.shape == x.shape
    err = (back.float() - x.float()).abs()
    assert bool((err <= q4.error_bound(x)).all()) and err.max() > 0
    # the values are exact in every device dtype: decoding in float32 then casting changes nothing
    assert torch.equal(back.float(), q4.dequantize(q4.quantize(x), 80, torch.float32))


def test_scales_are_the_smallest_grid_value_covering_amax():
    amax = torch.tensor([7.0, 7.0 * 1.0000001, 105 * 2.0**-7, 105 * 2.0**-7 * 1.0000001, 0.0, 1e-45,
                         6.0, 7 * q4.S_MAX, 1e30])
    s = q4.scales_of(q4.scale_codes(amax))
    assert s.tolist()[:5] == [1.0, 1.125, 15 * 2.0**-7, 0.125 * 1.0, q4.S_MIN]
    assert s[5] == q4.S_MIN and s[6] == 7 / 7 * 0.875 and s[7] == q4.S_MAX and s[8] == q4.S_MAX
    grid = torch.tensor([m * 2.0**k for k in range(q4.K_MIN, q4.K_MAX + 1) for m in range(8, 16)])
    for a, sc in zip(amax[:7].tolist(), s[:7].tolist()):
        covering = grid[grid * 7 >= a]
        assert sc == max(q4.S_MIN, covering.min().item())


finite = st.floats(min_value=-2e5, max_value=2e5, allow_nan=False, allow_infinity=False, width=32)


@PROPS
@given(st.lists(finite, min_size=1, max_size=70), st.sampled_from(FLOATS))
def test_property_error_bound_and_exact_zero(values, dtype):
    big = torch.finfo(dtype).max  # float16 cannot hold the whole range
    x = torch.tensor(values, dtype=torch.float32).clamp(-big, big).to(dtype)[None]
    dim = x.shape[-1]
    back = q4.dequantize(q4.quantize(x), dim, dtype)
    err = (back.float() - x.float()).abs()
    s = q4.group_scales(x)
    assert bool((err <= s / 2).all())
    # the documented bound in terms of the group's amax
    amax = q4._grouped(x.float()).abs().amax(-1).repeat_interleave(q4.GROUP, -1)[..., :dim]
    assert bool((err <= torch.maximum(amax * 9 / 112, torch.tensor(2.0**-18))).all())
    assert bool((back[x == 0] == 0).all()) and bool(torch.isfinite(back.float()).all())
    assert bool((torch.sign(back.float()) * torch.sign(x.float()) >= 0).all())  # never flips a sign


@PROPS
@given(st.integers(1, 70), st.floats(0, 2e5, width=32), st.integers(0, 69))
def test_property_edge_groups(dim, big, where):
    """Zero rows, one value at the group's amax, tiny values: zeros come back as zeros, the amax
    element within s/2, the scale covers it."""
    x = torch.zeros(2, dim)
    x[1, where % dim] = big
    q = q4.quantize(x)
    back = q4.dequantize(q, dim, torch.float32)
    assert bool((back[0] == 0).all()) and bool((q[0, : q4.code_bytes(dim)] == 0).all())
    s = q4.group_scales(x)[1, where % dim].item()
    assert abs(back[1, where % dim].item() - big) <= s / 2 and 7 * s >= big
    assert bool((back[1][torch.arange(dim) != where % dim] == 0).all())


def test_all_zero_memory_decodes_to_zeros():
    assert bool((q4.dequantize(torch.zeros(4, 2, q4.row_bytes(64), dtype=torch.uint8), 64, torch.bfloat16) == 0).all())


def test_beyond_the_range_codes_saturate_finitely():
    x = torch.tensor([[3e5, -1e38, 1.0]])
    back = q4.dequantize(q4.quantize(x), 3, torch.float32)
    assert back.tolist()[0][:2] == [7 * q4.S_MAX, -7 * q4.S_MAX] and torch.isfinite(back).all()


# ---------------------------------------------------------------- kernels vs the torch reference


def _pool(layers, heads, dim, dtype, rows, gen):
    per_layer = [kv_values((2, rows, heads, dim), gen, dtype).to(DEVICE) for _ in range(layers)]
    k, v = [p[0] for p in per_layer], [p[1] for p in per_layer]
    ptrs = [torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=DEVICE) for bufs in (k, v)]
    return k, v, *ptrs


# (layers, kv_heads, head_dim, block_tokens, num_tokens): odd dims, a partial last group (80), two
# groups (64), one token, partial tails
CASES = [(2, 3, 5, 4, 10), (1, 1, 8, 1, 3), (1, 2, 64, 16, 37), (1, 1, 7, 4, 1), (1, 1, 80, 4, 6)]


@needs_kernels
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_match_the_torch_reference_bit_for_bit(case, dtype):
    layers, heads, dim, bt, n = case
    gen = torch.Generator().manual_seed(2)
    rows = n + 9
    k, v, kp, vp = _pool(layers, heads, dim, dtype, rows, gen)
    k[0][:, 0] = 0  # a zero head in every block
    if dtype != torch.float16:
        k[0][:, -1, 0] = 3e5  # a saturating value (float16 has none)
    slots = torch.randperm(rows, generator=gen)[:n].to(DEVICE)
    nb = math.ceil(n / bt) + 2
    ids = torch.randperm(nb, generator=gen)[: math.ceil(n / bt)].to(DEVICE)
    dst = torch.full((nb, layers, 2, bt, heads, q4.row_bytes(dim)), 0x33, dtype=torch.uint8, device=DEVICE)
    ref = dst.cpu().clone()
    gather_kv_blocks_int4(kp, vp, slots, dst, ids, layer_shape=(rows, heads, dim), dtype=dtype)
    q4.gather_int4_reference(k, v, slots.cpu(), ref, ids.cpu())
    assert torch.equal(dst.cpu(), ref)  # the rows past n stay untouched (0x33) in both
    k2, v2, kp2, vp2 = _pool(layers, heads, dim, dtype, rows, torch.Generator().manual_seed(3))
    k3, v3 = [b.cpu().clone() for b in k2], [b.cpu().clone() for b in v2]
    scatter_kv_blocks_int4(kp2, vp2, slots, dst, ids, layer_shape=(rows, heads, dim), dtype=dtype)
    q4.scatter_int4_reference(k3, v3, slots.cpu(), ref, ids.cpu())
    for got, want in zip(k2 + v2, k3 + v3):
        assert torch.equal(bits(got).cpu(), bits(want))


@needs_kernels
def test_kernel_launchers_reject_what_cannot_work():
    gen = torch.Generator().manual_seed(4)
    k, v, kp, vp = _pool(1, 1, 8, torch.float32, 16, gen)
    slots = torch.arange(4, device=DEVICE)
    ids = torch.tensor([0], device=DEVICE)
    dst = torch.empty((2, 1, 2, 4, 1, q4.row_bytes(8)), dtype=torch.uint8, device=DEVICE)
    launch = dict(layer_shape=(16, 1, 8), dtype=torch.float32)
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        gather_kv_blocks_int4(kp, vp, slots, dst, ids, layer_shape=(16, 1, 8), dtype=torch.uint8)
    with pytest.raises(ValueError, match="uint8"):
        gather_kv_blocks_int4(kp, vp, slots, dst.float(), ids, **launch)
    with pytest.raises(ValueError, match="row_bytes"):
        scatter_kv_blocks_int4(kp, vp, slots, torch.empty((2, 1, 2, 4, 1, 8), dtype=torch.uint8), ids, **launch)
    with pytest.raises(ValueError, match="entries"):
        scatter_kv_blocks_int4(kp, vp, slots, dst, ids[:0], **launch)


# ---------------------------------------------------------------- host pool


def test_host_pool_holds_int4_blocks():
    pool = HostKVPool(3, 2, 3, 64, 4, torch.bfloat16, pin=False, kv_format="int4")
    assert pool.kv_format == "int4" and pool.quantized and pool.scales is None
    assert pool.data.dtype == torch.uint8 and pool.data.shape == (3, 2, 2, 4, 3, 34) and pool.row_width == 34
    assert pool.bytes_per_token == 2 * 2 * 3 * 34 and pool.bytes_per_block == 4 * pool.bytes_per_token
    assert bool((pool.data == 0).all())  # unwritten blocks decode to zeros
    assert pool.bytes_used == 0
    pool.allocator.alloc(2)
    assert pool.bytes_used == 2 * pool.bytes_per_block
    with pytest.raises(ValueError, match="16- or 32-bit"):
        HostKVPool(3, 2, 3, 64, 4, torch.uint8, pin=False, kv_format="int4")
    with pytest.raises(ValueError, match="kv_format"):
        HostKVPool(3, 2, 3, 64, 4, torch.bfloat16, pin=False, kv_format="int3")
    with pytest.raises(ValueError, match="contradicts"):
        HostKVPool(3, 2, 3, 64, 4, torch.bfloat16, pin=False, kv_format="int4", store_dtype=quant.FP8_DTYPE)


def test_pools_per_format_split_the_budget():
    dev = DevicePoolView.synthetic(8, 30, 3, 64, torch.bfloat16, "cpu")
    pools = HostKVPool.for_formats(dev, 16, ["auto", "int4", "auto", "fp8_e4m3"], gb=0.3)
    assert list(pools) == ["auto", "int4", "fp8_e4m3"]
    for fmt, pool in pools.items():
        assert pool.kv_format == fmt
        assert pool.num_blocks * pool.bytes_per_block <= 0.1 * 2**30 < (pool.num_blocks + 1) * pool.bytes_per_block
    # what int4 buys: tokens held per host byte
    assert pools["int4"].num_blocks > 1.88 * pools["fp8_e4m3"].num_blocks > 3.7 * pools["auto"].num_blocks
    assert HostKVPool.default_num_blocks(30, 3, 64, 16, torch.bfloat16, gb=1.0, kv_format="int4") == \
        int(2**30 // (30 * 2 * 16 * 3 * 34))


# ---------------------------------------------------------------- per-class precision and the config


CLASSES = ('{"interactive": {"ttft_ms": 1000, "tbt_ms": 50, "rotary_kv_dtype": "auto"}, '
           '"standard": {"ttft_ms": 5000, "rotary_kv_dtype": "fp8_e4m3"}, '
           '"batch": {"ttft_ms": 30000, "rotary_kv_dtype": "int4"}, "other": {"tbt_ms": 200}}')


def test_classes_parse_their_precision_and_inherit_the_flag():
    classes = SloClasses.parse(CLASSES)
    assert classes.rotary_kv_dtypes("auto") == {"interactive": "auto", "standard": "fp8_e4m3", "batch": "int4",
                                                "other": "auto"}
    assert classes.rotary_kv_dtype("other", "int4") == "int4" and classes.rotary_kv_dtype(None, "fp8_e4m3") == "fp8_e4m3"
    assert classes.rotary_kv_dtype("interactive", "int4") == "auto"  # a class's own wins over the flag
    assert classes.kv_formats("auto") == ("auto", "fp8_e4m3", "int4")
    assert classes["batch"].ttft_ms == 30000  # the SLO itself is unchanged


@pytest.mark.parametrize("value", ['"int3"', '"fp8"', "4", "null", '"AUTO"'])
def test_classes_refuse_other_precisions(value):
    with pytest.raises(SloError, match=r"batch\.rotary_kv_dtype.*auto, fp8_e4m3, int4"):
        SloClasses.parse('{"batch": {"ttft_ms": 100, "rotary_kv_dtype": %s}}' % value)


def test_config_takes_int4_and_checks_lossy_classes():
    assert SuperInferConfig(rotary_kv_dtype="int4").rotary_kv_formats() == ("int4",)
    cfg = SuperInferConfig(slo_classes=CLASSES)
    assert cfg.rotary_kv_formats() == ("auto", "fp8_e4m3", "int4")
    assert cfg.class_rotary_kv_dtypes()["other"] == "auto"
    with pytest.raises(ConfigError, match="rotary-kv-dtype int4 is lossy"):
        SuperInferConfig(rotary_kv_dtype="int4", verify_rotation=True)
    with pytest.raises(ConfigError, match="class 'standard' rotary_kv_dtype fp8_e4m3 is lossy"):
        SuperInferConfig(slo_classes=CLASSES, verify_rotation=True)
    with pytest.raises(ConfigError, match="naive"):
        SuperInferConfig(slo_classes=CLASSES, kv_transfer="naive")
    with pytest.raises(ConfigError, match="kv-cache-dtype"):
        check_rotary_kv_dtype(SuperInferConfig(slo_classes=CLASSES), "fp8_e5m2")
    exact = '{"a": {"ttft_ms": 100, "rotary_kv_dtype": "auto"}}'
    SuperInferConfig(slo_classes=exact, verify_rotation=True, kv_transfer="naive")  # every class exact
    check_rotary_kv_dtype(SuperInferConfig(slo_classes=exact), "fp8_e4m3")
    with pytest.raises(ConfigError, match="rotary_kv_dtype"):
        SuperInferConfig(slo_classes='{"a": {"ttft_ms": 100, "rotary_kv_dtype": "int8"}}')
