"""CPU attention (superinfer_sgl.cpu_attention) against SGLang's torch_native implementation.

Inputs are built directly: a random paged KV pool, req_to_token rows whose slots come from
page-aligned allocations (page_size 1 and 16, with stale slots past each length), ragged
lengths, prefix + extend. The reference is TorchNativeAttnBackend's own per-request SDPA code.

Tolerances: float32 atol/rtol 2e-5 (both sides are exact softmax in float32; only summation
order differs). bfloat16: the reference keeps scores in float32 inside SDPA and so do we, but
rounding of inputs/outputs differs: |ours - torch_native| <= 2e-2 abs + 2e-2 rel on O(1)
outputs, and our error against a float32 evaluation of the same bf16 inputs must not exceed
torch_native's own by more than 2x + 1e-3.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from superinfer_sgl.cpu_attention import cpu_attention_enabled, kernel_choice, native, paged

torch_native_backend = pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")
from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from superinfer_sgl.cpu_attention import backend as cpu_backend  # noqa: E402

HQ, HKV, D = 9, 3, 64  # SmolLM2-135M: GQA group of 3
KERNELS = ["torch", pytest.param("native", marks=pytest.mark.skipif(native.load() is None, reason="no C compiler"))]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def stock() -> object:
    """A TorchNativeAttnBackend shell: its _run_sdpa_* methods need no model runner."""
    return object.__new__(torch_native_backend.TorchNativeAttnBackend)


def make_pool(seq_lens: list[int], page_size: int, dtype: torch.dtype, seed: int = 0, heads: int = HKV):
    """K/V pools and req_to_token for requests of the given lengths, slots allocated page-wise.

    Pages are handed out in a shuffled order (as after frees), rows are padded with stale slots
    of other requests (as req_to_token rows are in a live server), row 0 is unused.
    """
    gen = torch.Generator().manual_seed(seed)
    pages_per = [-(-n // page_size) + 1 for n in seq_lens]  # one spare page of stale slots
    num_pages = sum(pages_per) + 1  # page 0 reserved for padding, as in SGLang
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    width = max(p * page_size for p in pages_per) + 8
    req_to_token = torch.zeros(len(seq_lens) + 3, width, dtype=torch.int32)
    rows = torch.randperm(len(seq_lens) + 2, generator=gen)[: len(seq_lens)] + 1
    for r, pages in zip(rows.tolist(), pages_per):
        mine, order = order[:pages], order[pages:]
        slots = torch.tensor([p * page_size + i for p in mine for i in range(page_size)], dtype=torch.int32)
        req_to_token[r, : slots.numel()] = slots
    size = num_pages * page_size
    k = (torch.randn(size, heads, D, generator=gen) * 2).to(dtype)
    v = torch.randn(size, heads, D, generator=gen).to(dtype)
    k[:page_size] = 0  # the padding page is zero in SGLang's pools
    v[:page_size] = 0
    return k, v, req_to_token, rows.long()


CASES = [  # (seq_lens, page_size)
    ([1], 1),
    ([37], 1),
    ([5, 1, 17, 64], 1),
    ([3, 200, 31, 8, 9, 1, 65, 2], 16),
    ([int(x) for x in torch.randint(1, 300, (32,), generator=torch.Generator().manual_seed(3))], 16),
]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens,page_size", CASES)
def test_decode_matches_torch_native(kernel: str, dtype: torch.dtype, seq_lens: list[int], page_size: int) -> None:
    k, v, r2t, rows = make_pool(seq_lens, page_size, dtype)
    lens = torch.tensor(seq_lens)
    q = (torch.randn(len(seq_lens), HQ, D, generator=torch.Generator().manual_seed(1)) * 2).to(dtype)
    scale = D**-0.5
    ref = torch.empty_like(q)
    stock()._run_sdpa_forward_decode(q, ref, k, v, r2t, rows, lens, scaling=scale, enable_gqa=True)
    ours = run_decode(kernel, q, k, v, r2t, rows, lens, scale)
    torch.testing.assert_close(ours, ref, **TOL[dtype])
    if dtype == torch.bfloat16:
        exact = torch.empty_like(q, dtype=torch.float32)
        stock()._run_sdpa_forward_decode(q.float(), exact, k.float(), v.float(), r2t, rows, lens, scaling=scale,
                                         enable_gqa=True)
        ref_err = (ref.float() - exact).abs().max().item()
        assert (ours.float() - exact).abs().max().item() <= 2 * ref_err + 1e-3


def run_decode(kernel: str, q, k, v, r2t, rows, lens, scale) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    if kernel == "native":
        return native.decode_attention(q, k, v, r2t, rows, lens, int(lens.max()), scale, out)
    return paged.decode_attention(q, k, v, paged.plan_decode(r2t, rows, lens), scale, out)


@pytest.mark.parametrize("kernel", KERNELS)
def test_decode_strided_query_and_output(kernel: str) -> None:
    """q as a view into a fused qkv row (SGLang's layout), out a view with a row stride."""
    seq_lens = [4, 40, 9]
    k, v, r2t, rows = make_pool(seq_lens, 1, torch.float32)
    lens = torch.tensor(seq_lens)
    qkv = torch.randn(3, (HQ + 2 * HKV) * D)
    q = qkv[:, : HQ * D].view(3, HQ, D)
    ref = torch.empty(3, HQ, D)
    stock()._run_sdpa_forward_decode(q, ref, k, v, r2t, rows, lens, scaling=0.1, enable_gqa=True)
    wide = torch.zeros(3, HQ + 1, D)
    out = wide[:, :HQ]
    if kernel == "native":
        native.decode_attention(q, k, v, r2t, rows, lens, 40, 0.1, out)
    else:
        paged.decode_attention(q, k, v, paged.plan_decode(r2t, rows, lens), 0.1, out)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    assert wide[:, HQ].abs().sum() == 0


def test_native_rejects_bad_lengths() -> None:
    if native.load() is None:
        pytest.skip("no C compiler")
    k, v, r2t, rows = make_pool([5], 1, torch.float32)
    q = torch.randn(1, HQ, D)
    with pytest.raises(native.NativeKernelError):
        native.decode_attention(q, k, v, r2t, rows, torch.tensor([0]), 5, 0.1, torch.empty_like(q))


EXTEND_CASES = [  # (prefix_lens, extend_lens, page_size)
    ([0], [1], 1),
    ([0], [33], 1),
    ([12], [20], 1),
    ([0, 7, 0, 30], [5, 1, 16, 9], 1),
    ([16, 0, 48, 3, 0], [17, 64, 1, 29, 2], 16),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("prefix_lens,extend_lens,page_size", EXTEND_CASES)
def test_extend_matches_torch_native(dtype, prefix_lens, extend_lens, page_size) -> None:
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k, v, r2t, rows = make_pool(seq_lens, page_size, dtype, seed=5)
    q = (torch.randn(sum(extend_lens), HQ, D, generator=torch.Generator().manual_seed(2)) * 2).to(dtype)
    scale = 0.11
    ref = torch.empty_like(q)
    stock()._run_sdpa_forward_extend(
        q, ref, k, v, r2t, rows, torch.tensor(seq_lens), torch.tensor(prefix_lens), torch.tensor(extend_lens),
        scaling=scale, enable_gqa=True, causal=True,
    )
    segments = paged.plan_extend(r2t, rows.tolist(), seq_lens, prefix_lens, extend_lens)
    ours = paged.extend_attention(q, k, v, segments, scale, torch.full_like(q, float("nan")))
    torch.testing.assert_close(ours, ref, **TOL[dtype])


# ---- the SGLang backend class, driven the way ModelRunner drives it ----


def make_backend(cls, pool: MHATokenToKVPool, req_to_token: torch.Tensor):
    runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                             token_to_kv_pool=pool, model=None)
    return cls(runner)


def make_layer(layer_id: int = 0, **kw) -> RadixAttention:
    return RadixAttention(num_heads=HQ, head_dim=D, scaling=D**-0.5, num_kv_heads=HKV, layer_id=layer_id, **kw)


def fill_pool(pool: MHATokenToKVPool, k: torch.Tensor, v: torch.Tensor) -> None:
    for layer in range(pool.layer_num):
        pool.get_key_buffer(layer)[: k.shape[0]] = k
        pool.get_value_buffer(layer)[: v.shape[0]] = v


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["decode", "extend", "mixed_one_token", "mixed"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_backend_matches_torch_native(monkeypatch, kernel: str, mode: str, page_size: int) -> None:
    monkeypatch.setenv("SUPERINFER_CPU_ATTENTION_KERNEL", kernel)
    dtype = torch.float32
    prefix = [20, 3, 0, 45] if mode != "decode" else [19, 2, 6, 44]
    # mixed: a chunk of prefills (30 and 4 new tokens) with decode rows (one new token each).
    new = {"extend": [7, 1, 30, 4], "mixed": [1, 1, 30, 4]}.get(mode, [1, 1, 1, 1])
    seq_lens = [p + n for p, n in zip(prefix, new)]
    k, v, r2t, rows = make_pool(seq_lens, page_size, dtype, seed=9)
    pool = MHATokenToKVPool(size=k.shape[0] - page_size, page_size=page_size, dtype=dtype, head_num=HKV,
                            head_dim=D, layer_num=2, device="cpu", enable_memory_saver=False)
    fill_pool(pool, k, v)
    # The new tokens' slots: the last `new` slots of each request's row.
    out_loc = torch.cat([r2t[r, s - n: s].long() for r, s, n in zip(rows.tolist(), seq_lens, new)])
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(sum(new), HQ * D, generator=gen)
    knew, vnew = torch.randn(sum(new), HKV * D, generator=gen), torch.randn(sum(new), HKV * D, generator=gen)
    fm = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND, "mixed_one_token": ForwardMode.MIXED,
          "mixed": ForwardMode.MIXED}[mode]
    fb = SimpleNamespace(
        forward_mode=fm, req_pool_indices=rows, seq_lens=torch.tensor(seq_lens), seq_lens_cpu=torch.tensor(seq_lens),
        out_cache_loc=out_loc, encoder_lens=None, extend_prefix_lens=torch.tensor(prefix),
        extend_seq_lens=torch.tensor(new), extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=new,
    )
    outs = []
    for cls in (torch_native_backend.TorchNativeAttnBackend, cpu_backend.SuperInferCpuAttnBackend):
        backend = make_backend(cls, pool, r2t)
        backend.init_forward_metadata(fb)
        for layer_id in range(2):
            layer = make_layer(layer_id)
            kv = (knew.view(-1, HKV, D), vnew.view(-1, HKV, D))
            run = backend.forward_decode if fm == ForwardMode.DECODE else backend.forward_extend
            outs.append(run(q, *kv, layer, fb))
    for ref, ours in zip(outs[:2], outs[2:]):
        torch.testing.assert_close(ours, ref, **TOL[dtype])
    assert pool.get_key_buffer(1)[out_loc].flatten(1).equal(knew)  # the KV write happened


def test_backend_rejects_unsupported_layers() -> None:
    k, v, r2t, rows = make_pool([4], 1, torch.float32)
    pool = MHATokenToKVPool(size=k.shape[0] - 1, page_size=1, dtype=torch.float32, head_num=HKV, head_dim=D,
                            layer_num=1, device="cpu", enable_memory_saver=False)
    model = torch.nn.ModuleList([make_layer(0, logit_cap=30.0)])
    runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=r2t),
                             token_to_kv_pool=pool, model=model)
    with pytest.raises(cpu_backend.UnsupportedAttentionError, match="soft-capping"):
        cpu_backend.SuperInferCpuAttnBackend(runner)  # at start-up, where the model shows it
    with pytest.raises(cpu_backend.UnsupportedAttentionError, match="soft-capping"):
        cpu_backend.check_layer(make_layer(0, logit_cap=30.0))
    cpu_backend.check_layer(make_layer(0))


# ---- switch and patch target ----


def test_switch_follows_cpu_compat() -> None:
    assert cpu_attention_enabled({}) is False
    assert cpu_attention_enabled({"SUPERINFER_CPU_COMPAT": "1"}) is True
    assert cpu_attention_enabled({"SUPERINFER_CPU_COMPAT": "1", "SUPERINFER_CPU_ATTENTION": "0"}) is False
    assert cpu_attention_enabled({"SUPERINFER_CPU_ATTENTION": "1"}) is True
    with pytest.raises(ValueError):
        cpu_attention_enabled({"SUPERINFER_CPU_ATTENTION": "yes"})
    assert kernel_choice({}) == "auto"
    with pytest.raises(ValueError):
        kernel_choice({"SUPERINFER_CPU_ATTENTION_KERNEL": "cuda"})


def test_patch_target_exists_and_factory_imports_lazily() -> None:
    from superinfer_patches import cpu_attention_backend
    from superinfer_patches import resolve

    cpu_attention_backend.check()
    factory = resolve(cpu_attention_backend.FACTORY)
    # The REPLACE only reaches the registry because the factory imports the class at call time.
    assert "import TorchNativeAttnBackend" in inspect.getsource(factory)
    assert issubclass(cpu_backend.SuperInferCpuAttnBackend, torch_native_backend.TorchNativeAttnBackend)


def test_kernel_choice_falls_back_for_other_kv_dtypes() -> None:
    assert cpu_backend._resolve_kernel("torch", torch.bfloat16) == "torch"
    assert cpu_backend._resolve_kernel("auto", torch.float8_e4m3fn) == "torch"
    with pytest.raises(RuntimeError, match="KV cache dtype"):
        cpu_backend._resolve_kernel("native", torch.float8_e4m3fn)
    if native.load() is not None:
        assert cpu_backend._resolve_kernel("auto", torch.bfloat16) == "native"
