"""fp8 (e4m3) rotary host blocks (--rotary-kv-dtype fp8_e4m3): the quantization scheme, the Triton
kernels against its torch reference (bit for bit, under TRITON_INTERPRET=1 on CPU), the host pool
and engine with fp8 blocks, and the flag's validation. The default (bit-exact) path stays default."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "triton_kernels"))

from superinfer_kernels import gather_kv_blocks_fp8, scatter_kv_blocks_fp8  # noqa: E402
from superinfer_sgl.config import ConfigError, SuperInferConfig, check_rotary_kv_dtype  # noqa: E402
from superinfer_sgl.duplexkv import DevicePoolView, HostKVPool, RotationEngine, quant  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
needs_kernels = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs Triton")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def kv_values(shape, gen, dtype=torch.float32, spread=(1e-3, 1.0, 300.0)):
    """Random KV whose heads differ in magnitude by orders (per-head scales must matter)."""
    x = torch.randn(shape, generator=gen)
    heads = shape[-2]
    x *= torch.tensor([spread[h % len(spread)] for h in range(heads)])[:, None]
    return x.to(dtype)


# ---------------------------------------------------------------- the scheme (quant.py)


@pytest.mark.parametrize("bt", [1, 4, 16])
def test_round_trip_within_the_e4m3_bound(bt):
    gen = torch.Generator().manual_seed(1)
    rows = kv_values((37, 3, 16), gen)
    codes, scales = quant.quantize_rows(rows, bt)
    assert codes.dtype == quant.FP8_DTYPE and codes.shape == rows.shape
    assert scales.shape == (math.ceil(37 / bt), 3) and scales.dtype == torch.float32
    tok_scales = scales.repeat_interleave(bt, 0)[:37]
    back = quant.dequantize_rows(codes, tok_scales, torch.float32)
    bound = quant.error_bound(rows, tok_scales[:, :, None])
    assert bool(((back - rows).abs() <= bound).all())
    assert (back - rows).abs().max() > 0  # lossy: it is not a copy
    # scales are powers of two, the smallest with amax <= 448 * scale
    amax = rows.new_zeros(scales.shape)
    for j in range(scales.shape[0]):
        amax[j] = rows[j * bt : (j + 1) * bt].abs().amax(dim=(0, 2))
    mant, _ = torch.frexp(scales)
    assert bool((mant == 0.5).all())
    assert bool((amax <= 448 * scales).all()) and bool(((amax > 224 * scales) | (scales == 2.0**-126)).all())


def test_zero_block_round_trips_to_zero_and_is_finite():
    rows = torch.zeros(8, 2, 4)
    rows[4:, 1] = torch.tensor([1e-38, -3.0, 0.5, 448.0 * 2**100])  # a block with one zero head
    codes, scales = quant.quantize_rows(rows, 4)
    back = quant.dequantize_rows(codes, scales.repeat_interleave(4, 0), torch.float32)
    assert torch.isfinite(scales).all() and torch.isfinite(back).all()
    assert bool((back[:4] == 0).all()) and bool((back[4:, 0] == 0).all())
    assert scales[0, 0] == 2.0**-126 and scales[1, 0] == 2.0**-126
    assert back[4, 1, 3] == 448.0 * 2**100  # the block's amax itself is exact
    assert (rows - back).abs().le(quant.error_bound(rows, scales.repeat_interleave(4, 0)[:, :, None])).all()


def test_scale_exponent_at_binade_edges():
    amax = torch.tensor([448.0, 448.0 * 1.0000001, 224.0, 1.0, 0.0, 1e-45, 3.4e38])
    s = quant.scales_for(amax)
    assert s.tolist()[:4] == [1.0, 2.0, 0.5, 2.0**-8]
    assert s[4] == s[5] == 2.0**-126
    assert bool((amax <= 448 * s).all())


# ---------------------------------------------------------------- kernels vs the torch reference


def _pool(layers, heads, dim, dtype, rows, gen):
    per_layer = [kv_values((2, rows, heads, dim), gen, dtype).to(DEVICE) for _ in range(layers)]
    k, v = [p[0] for p in per_layer], [p[1] for p in per_layer]
    ptrs = [torch.tensor([b.data_ptr() for b in bufs], dtype=torch.uint64, device=DEVICE) for bufs in (k, v)]
    return k, v, *ptrs


# (layers, kv_heads, head_dim, block_tokens, num_tokens): partial tails, one token, odd dims, and
# block_tokens * head_dim over one tile (128 x 64: the kernel loops over token chunks)
CASES = [(2, 3, 5, 4, 10), (1, 1, 8, 1, 3), (2, 2, 16, 16, 37), (1, 1, 7, 4, 1), (1, 1, 64, 128, 130)]


@needs_kernels
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_match_the_torch_reference_bit_for_bit(case, dtype):
    layers, heads, dim, bt, n = case
    gen = torch.Generator().manual_seed(2)
    rows = n + 9
    k, v, kp, vp = _pool(layers, heads, dim, dtype, rows, gen)
    k[0][:, 0] = 0  # a zero head in every block
    slots = torch.randperm(rows, generator=gen)[:n].to(DEVICE)
    nb = math.ceil(n / bt) + 2
    ids = torch.randperm(nb, generator=gen)[: math.ceil(n / bt)].to(DEVICE)
    shape = (nb, layers, 2, bt, heads, dim)
    dst = torch.full(shape, 0x33, dtype=torch.uint8, device=DEVICE).view(quant.FP8_DTYPE)
    scales = torch.full((nb, layers, 2, heads), -1.0, device=DEVICE)
    ref, ref_scales = dst.cpu().clone(), scales.cpu().clone()
    gather_kv_blocks_fp8(kp, vp, slots, dst, scales, ids, layer_shape=(rows, heads, dim), dtype=dtype)
    quant.gather_fp8_reference(k, v, slots.cpu(), ref, ref_scales, ids.cpu())
    assert torch.equal(bits(dst).cpu(), bits(ref)) and torch.equal(scales.cpu(), ref_scales)
    # back into a poisoned pool: the reference's values in the slots, the other rows untouched
    k2, v2, kp2, vp2 = _pool(layers, heads, dim, dtype, rows, torch.Generator().manual_seed(3))
    k3, v3 = [b.cpu().clone() for b in k2], [b.cpu().clone() for b in v2]
    scatter_kv_blocks_fp8(kp2, vp2, slots, dst, scales, ids, layer_shape=(rows, heads, dim), dtype=dtype)
    quant.scatter_fp8_reference(k3, v3, slots.cpu(), ref, ref_scales, ids.cpu())
    for got, want in zip(k2 + v2, k3 + v3):
        assert torch.equal(bits(got).cpu(), bits(want))


@needs_kernels
def test_kernel_launchers_reject_what_cannot_work():
    gen = torch.Generator().manual_seed(4)
    k, v, kp, vp = _pool(1, 1, 8, torch.float32, 16, gen)
    slots = torch.arange(4, device=DEVICE)
    ids = torch.tensor([0], device=DEVICE)
    dst = torch.empty((2, 1, 2, 4, 1, 8), dtype=quant.FP8_DTYPE, device=DEVICE)
    scales = torch.empty((2, 1, 2, 1), device=DEVICE)
    launch = dict(layer_shape=(16, 1, 8), dtype=torch.float32)
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        gather_kv_blocks_fp8(kp, vp, slots, dst, scales, ids, layer_shape=(16, 1, 8), dtype=torch.uint8)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gather_kv_blocks_fp8(kp, vp, slots, dst.float(), scales, ids, **launch)
    with pytest.raises(ValueError, match="scales"):
        scatter_kv_blocks_fp8(kp, vp, slots, dst, scales[:, :, :1], ids, **launch)
    with pytest.raises(ValueError, match="entries"):
        scatter_kv_blocks_fp8(kp, vp, slots, dst, scales, ids[:0], **launch)


# ---------------------------------------------------------------- host pool and engine


def make_engine(transfer, store=quant.FP8_DTYPE, dtype=torch.float32, blocks=12, bt=4, layers=2, heads=3, dim=8):
    gen = torch.Generator().manual_seed(5)
    dev = DevicePoolView.synthetic(48, layers, heads, dim, dtype, DEVICE)
    for buf in dev.k_buffers + dev.v_buffers:
        buf.copy_(kv_values(buf.shape, gen, dtype))
    host = HostKVPool(blocks, layers, heads, dim, bt, dtype, pin=None, store_dtype=store)
    return RotationEngine(dev, host, transfer=transfer, max_programs=4)


def device_rows(engine, slots):
    d = engine.device_pool
    return [b[slots.to(d.device)].float().cpu() for b in d.k_buffers + d.v_buffers]


def zero_rows(engine, slots):
    for b in engine.device_pool.k_buffers + engine.device_pool.v_buffers:
        b[slots.to(b.device)] = 0


PATHS = ["torch", *(["triton-direct", "triton-dma"] if INTERPRET or torch.cuda.is_available() else [])]


@pytest.mark.parametrize("transfer", PATHS)
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_engine_rotates_out_and_back_within_the_bound(transfer, dtype):
    eng = make_engine(transfer, dtype=dtype)
    assert eng.host_pool.quantized and eng.host_pool.data.dtype == quant.FP8_DTYPE
    slots = torch.tensor([7, 3, 30, 31, 32, 11, 1, 40, 41, 2], dtype=torch.int64)  # 2 blocks + a tail of 2
    before = device_rows(eng, slots)
    hk = eng.save(slots)
    zero_rows(eng, slots)
    eng.load(hk, slots)
    after = device_rows(eng, slots)
    bt = eng.host_pool.block_tokens
    ids = torch.tensor(hk.block_ids)[torch.arange(slots.numel()) // bt]
    for i, (x, y) in enumerate(zip(before, after)):
        layer, kv = i % eng.device_pool.layers, i // eng.device_pool.layers
        scale = eng.host_pool.scales[ids, layer, kv][:, :, None]
        # the e4m3 bound, plus the device dtype's own rounding of the dequantized value
        slack = 0 if dtype == torch.float32 else y.abs() * torch.finfo(dtype).eps
        assert bool(((x - y).abs() <= quant.error_bound(x, scale) + slack).all()), (transfer, dtype, i)
    # host bytes moved: 1 byte per value each way
    per_token = eng.device_pool.layers * 2 * eng.device_pool.kv_heads * eng.device_pool.head_dim
    assert eng.bytes_out == eng.bytes_in == slots.numel() * per_token
    eng.free(hk)
    eng.check_invariants()


@pytest.mark.parametrize("transfer", PATHS[1:])
def test_triton_paths_store_the_torch_paths_bytes(transfer):
    slots = torch.tensor([5, 6, 7, 8, 20, 21, 22, 23, 9], dtype=torch.int64)
    ref, eng = make_engine("torch"), make_engine(transfer)
    a, b = ref.save(slots), eng.save(slots)
    assert a == b
    ids = list(a.block_ids)
    tok = torch.arange(slots.numel())  # rows past the last token are undefined (DMA copies whole blocks)
    block, row = torch.tensor(ids)[tok // 4], tok % 4
    got = bits(eng.host_pool.data).cpu()[block, :, :, row]
    assert torch.equal(bits(ref.host_pool.data)[block, :, :, row], got)
    assert torch.equal(ref.host_pool.scales[ids], eng.host_pool.scales[ids].cpu())


def test_eager_mirror_blocks_are_reused_in_fp8():
    eng = make_engine("torch", blocks=16)
    slots = torch.arange(10, 20)
    eng.track("r")
    assert eng.sync_full_blocks("r", slots, 10) == 2
    assert eng.bytes_eager_out == 2 * eng.host_pool.bytes_per_block
    before = device_rows(eng, slots)
    hk = eng.save_request("r", slots, 10)
    assert eng.bytes_reused == 8 * eng.host_pool.bytes_per_token and eng.bytes_out == 2 * eng.host_pool.bytes_per_token
    zero_rows(eng, slots)
    eng.load(hk, slots)
    for x, y in zip(before, device_rows(eng, slots)):
        assert bool(((x - y).abs() <= x.abs() * 2**-4 + 1e-3).all())
    eng.free(hk)
    eng.untrack("r")
    eng.check_invariants()


def test_default_host_pool_is_still_bit_exact():
    eng = make_engine("torch", store=None, dtype=torch.bfloat16)
    assert not eng.host_pool.quantized and eng.host_pool.scales is None
    assert eng.host_pool.data.dtype == torch.bfloat16
    slots = torch.tensor([4, 9, 2, 17, 33], dtype=torch.int64)
    before = [bits(b[slots]).clone() for b in eng.device_pool.k_buffers + eng.device_pool.v_buffers]
    hk = eng.save(slots)
    zero_rows(eng, slots)
    eng.load(hk, slots)
    for x, b in zip(before, eng.device_pool.k_buffers + eng.device_pool.v_buffers):
        assert torch.equal(x, bits(b[slots]))


def test_naive_path_refuses_fp8_blocks():
    with pytest.raises(ValueError, match="naive"):
        make_engine("naive")


def test_pool_sizing_counts_fp8_blocks_and_their_scales():
    args = (30, 3, 64, 16)  # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64
    f32 = HostKVPool.default_num_blocks(*args, torch.float32, gb=1.0)
    bf16 = HostKVPool.default_num_blocks(*args, torch.bfloat16, gb=1.0)
    fp8 = HostKVPool.default_num_blocks(*args, torch.float32, gb=1.0, store_dtype=quant.FP8_DTYPE)
    payload = 30 * 2 * 16 * 3 * 64
    assert fp8 == int(2**30 // (payload + 30 * 2 * 3 * 4)) and bf16 < fp8 < 2 * bf16 and fp8 > 3.9 * f32
    dev = DevicePoolView.synthetic(8, 2, 3, 8, torch.float32, "cpu")
    pool = HostKVPool.for_device(dev, 4, "fp8_e4m3", gb=0.001)
    assert pool.num_blocks * pool.bytes_per_block <= 0.001 * 2**30 < (pool.num_blocks + 1) * pool.bytes_per_block
    assert pool.bytes_per_block == 4 * 2 * 2 * 3 * 8 + 2 * 2 * 3 * 4
    assert HostKVPool.for_device(dev, 4, gb=0.001).data.dtype == torch.float32  # auto: the device dtype


def test_fp8_device_kv_is_refused():
    with pytest.raises(ValueError, match="auto"):
        quant.host_dtype("fp8_e4m3", torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="auto"):
        quant.host_dtype("fp8_e4m3", torch.uint8)  # SGLang's fp8 store dtype
    assert quant.host_dtype("auto", torch.uint8) == torch.uint8


# ---------------------------------------------------------------- the flag


def test_flag_default_is_the_exact_path():
    assert SuperInferConfig().rotary_kv_dtype == "auto"


@pytest.mark.parametrize("kwargs, match", [
    ({"rotary_kv_dtype": "fp8"}, "--rotary-kv-dtype must be one of"),
    ({"rotary_kv_dtype": "fp8_e4m3", "verify_rotation": True}, "SUPERINFER_VERIFY_ROTATION=1"),
    ({"rotary_kv_dtype": "fp8_e4m3", "kv_transfer": "naive"}, "--kv-transfer"),
])
def test_flag_refuses_what_cannot_work(kwargs, match):
    with pytest.raises(ConfigError, match=match) as exc:
        SuperInferConfig(**kwargs)
    assert "--rotary-kv-dtype" in str(exc.value)


def test_flag_with_an_fp8_device_cache_fails_at_launch():
    cfg = SuperInferConfig(rotary_kv_dtype="fp8_e4m3")
    check_rotary_kv_dtype(cfg, None)
    check_rotary_kv_dtype(cfg, "bfloat16")
    check_rotary_kv_dtype(SuperInferConfig(), "fp8_e5m2")
    with pytest.raises(ConfigError, match="--rotary-kv-dtype fp8_e4m3.*--kv-cache-dtype fp8_e5m2"):
        check_rotary_kv_dtype(cfg, "fp8_e5m2")
    from superinfer_sgl.launch_server import prepare

    with pytest.raises(ConfigError, match="--kv-cache-dtype"):
        prepare(["--rotary-kv-dtype", "fp8_e4m3", "--kv-cache-dtype", "fp8_e4m3"])


def test_flag_parses_and_its_help_states_the_measured_cost():
    import argparse

    from superinfer_sgl.config import add_cli_args, from_namespace

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    assert from_namespace(parser.parse_args([]), environ={}).rotary_kv_dtype == "auto"
    cfg = from_namespace(parser.parse_args(["--rotary-kv-dtype", "fp8_e4m3"]), environ={})
    assert cfg.rotary_kv_dtype == "fp8_e4m3"
    help_text = next(a.help for a in parser._actions if "--rotary-kv-dtype" in a.option_strings)
    assert "lossy" in help_text.lower() and "measured" in help_text
