"""Defects a review of the CPU attention backend and its op patches found (2026-12-03), each
driven the way SGLang drives the code and compared with what stock torch_native does:

- the C decode kernel's shape limits (more than 32 query heads per KV head, head dims over 256)
  and K / V head dims that differ: the forward raised where stock serves; now the kernel choice
  is made once for the model's shapes and such models take the torch batched path;
- sliding-window layers over a plain pool, encoder-only and cross-attention layers: refused at
  start-up where stock serves them; now served by the stock code, layer by layer (sliding-window
  KV pools stay refused: stock reads them wrongly);
- attention arguments neither backend takes (`sinks`, ...): silently dropped; now refused;
- packed bf16 weights after an online weight update (SGLang writes through `param.data`, which
  leaves the version counter alone): the old weights kept serving; now dropped on the update;
- the kernel cache: a cached .so that does not load, a `CC` with a launcher, an unwritable cache
  folder: each turned the kernel off for good; now rebuilt, split, or built under the temp dir.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from superinfer_sgl.cpu_attention import linear, native

torch_native_backend = pytest.importorskip("sglang.srt.layers.attention.torch_native_backend")
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.model_runner_components import weight_updater  # noqa: E402

from superinfer_patches import packed_weights_refresh  # noqa: E402
from superinfer_sgl.cpu_attention import backend as cpu_backend  # noqa: E402

needs_c = pytest.mark.skipif(native.load() is None, reason="no C compiler")


def run_both(hq: int, hkv: int, d: int, dv: int, mode: ForwardMode, monkeypatch: pytest.MonkeyPatch,
             kernel: str = "auto", **layer_kw) -> tuple[torch.Tensor, torch.Tensor, object]:
    """One layer's forward through stock torch_native and through ours, on one random pool."""
    monkeypatch.setenv("SUPERINFER_CPU_ATTENTION_KERNEL", kernel)
    gen = torch.Generator().manual_seed(hq * 1000 + d)
    prefix, new = ([5, 17, 30], [1, 1, 1]) if mode == ForwardMode.DECODE else ([0, 9, 12], [6, 1, 20])
    seq = [p + n for p, n in zip(prefix, new)]
    width = max(seq) + 4
    r2t = torch.zeros(len(seq) + 1, width, dtype=torch.int32)
    nxt = 1
    for i, n in enumerate(seq):
        r2t[i + 1, :n] = torch.arange(nxt, nxt + n, dtype=torch.int32)
        nxt += n
    pool = MHATokenToKVPool(size=nxt + 8, page_size=1, dtype=torch.float32, head_num=hkv, head_dim=d,
                            v_head_dim=dv, layer_num=1, device="cpu", enable_memory_saver=False)
    pool.get_key_buffer(0).copy_(torch.randn(pool.get_key_buffer(0).shape, generator=gen))
    pool.get_value_buffer(0).copy_(torch.randn(pool.get_value_buffer(0).shape, generator=gen))
    rows = torch.arange(1, len(seq) + 1)
    out_loc = torch.cat([r2t[r, s - n: s].long() for r, s, n in zip(rows.tolist(), seq, new)])
    fb = SimpleNamespace(
        forward_mode=mode, req_pool_indices=rows, seq_lens=torch.tensor(seq), seq_lens_cpu=torch.tensor(seq),
        out_cache_loc=out_loc, encoder_lens=None, extend_prefix_lens=torch.tensor(prefix),
        extend_seq_lens=torch.tensor(new), extend_prefix_lens_cpu=prefix, extend_seq_lens_cpu=new,
    )
    layer = RadixAttention(num_heads=hq, head_dim=d, scaling=d**-0.5, num_kv_heads=hkv, layer_id=0, v_head_dim=dv,
                           **layer_kw)
    q = torch.randn(sum(new), hq * d, generator=gen)
    k, v = torch.randn(sum(new), hkv, d, generator=gen), torch.randn(sum(new), hkv, dv, generator=gen)
    outs, ours = [], None
    for cls in (torch_native_backend.TorchNativeAttnBackend, cpu_backend.SuperInferCpuAttnBackend):
        runner = SimpleNamespace(device="cpu", req_to_token_pool=SimpleNamespace(req_to_token=r2t),
                                 token_to_kv_pool=pool, model=torch.nn.ModuleList([layer]), dtype=torch.float32)
        backend = cls(runner)
        backend.init_forward_metadata(fb)
        run = backend.forward_decode if mode == ForwardMode.DECODE else backend.forward_extend
        outs.append(run(q, k, v, layer, fb, save_kv_cache=False))
        ours = backend
    return outs[0], outs[1], ours


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.MIXED])
@pytest.mark.parametrize(("hq", "hkv", "d", "dv"), [(48, 1, 64, 64), (8, 2, 192, 128), (4, 2, 320, 320)],
                         ids=["mqa-48", "v-head-dim", "wide-head"])
def test_shapes_past_the_c_kernel_are_served(monkeypatch, mode, hq, hkv, d, dv) -> None:
    ref, out, backend = run_both(hq, hkv, d, dv, mode, monkeypatch)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert backend.kernel == "torch"  # decided once for the model, not per call


def test_native_refuses_what_it_cannot_take() -> None:
    q = torch.zeros(2, 48, 64)
    assert not native.supports(q, torch.zeros(10, 1, 64), torch.zeros(10, 1, 64))
    assert not native.supports(torch.zeros(2, 8, 192), torch.zeros(10, 2, 192), torch.zeros(10, 2, 128))
    assert native.shape_supported(32, 1, 256, 256) and not native.shape_supported(33, 1, 64, 64)
    with pytest.raises(RuntimeError, match="shape"):
        layer = RadixAttention(num_heads=48, head_dim=64, scaling=0.125, num_kv_heads=1, layer_id=3)
        cpu_backend._resolve_kernel("native", torch.float32, torch.float32, [layer])
    with pytest.raises(RuntimeError, match="model dtype"):
        cpu_backend._resolve_kernel("native", torch.bfloat16, torch.float32, [])


@needs_c
def test_c_kernel_limits_are_the_ones_supports_uses() -> None:
    """The Python limits and the C kernel's MAX_G / MAX_D agree: at the limit it runs, past it -2."""
    lib = native.load()
    for hq, d, ok in ((32, 256, True), (33, 64, False), (4, 257, False)):
        q = torch.randn(1, hq, d)
        kv = torch.randn(4, 1, d)
        r2t = torch.arange(4, dtype=torch.int32).view(1, 4)
        out = torch.empty(1, hq, d)
        rows, lens = torch.zeros(1, dtype=torch.int64), torch.tensor([3])
        assert native.shape_supported(hq, 1, d, d) is ok
        rc = lib.superinfer_paged_decode_f32(
            q.data_ptr(), q.stride(0), q.stride(1), kv.data_ptr(), kv.data_ptr(), kv.stride(0), kv.stride(1),
            r2t.data_ptr(), r2t.stride(0), rows.data_ptr(), lens.data_ptr(),
            out.data_ptr(), out.stride(0), out.stride(1),
            1, hq, 1, d, d, 0.1, 4, 1)  # fmt: skip
        assert (rc == 0) is ok, (hq, d, rc)


@pytest.mark.parametrize(("mode", "layer_kw"), [
    (ForwardMode.DECODE, dict(sliding_window_size=4)),
    (ForwardMode.EXTEND, dict(sliding_window_size=4)),
    (ForwardMode.EXTEND, dict(attn_type=AttentionType.ENCODER_ONLY)),  # (an encoder-only model never decodes)
], ids=["sliding-window-decode", "sliding-window-extend", "encoder-only"])
def test_layers_stock_serves_are_served_by_stock(monkeypatch, mode, layer_kw) -> None:
    ref, out, _ = run_both(4, 2, 32, 32, mode, monkeypatch, **layer_kw)
    torch.testing.assert_close(out, ref, atol=0, rtol=0)


def test_a_sliding_window_pool_stays_refused(monkeypatch) -> None:
    """Stock torch_native reads a window sub-pool with full-pool slot ids (docs/models.md): wrong
    reads, so a sliding-window pool is not handed to it."""
    monkeypatch.setattr(torch_native_backend.TorchNativeAttnBackend, "__init__",
                        lambda self, runner: setattr(self, "use_sliding_window_kv_pool", True))
    with pytest.raises(cpu_backend.UnsupportedAttentionError, match="sliding-window KV pools"):
        cpu_backend.SuperInferCpuAttnBackend(SimpleNamespace(model=None))


def test_soft_capping_and_extra_arguments_are_refused(monkeypatch) -> None:
    with pytest.raises(cpu_backend.UnsupportedAttentionError, match="soft-capping"):
        cpu_backend.check_layer(RadixAttention(num_heads=4, head_dim=32, scaling=0.1, num_kv_heads=2, layer_id=0,
                                               logit_cap=30.0))
    _, _, backend = run_both(4, 2, 32, 32, ForwardMode.DECODE, monkeypatch)
    layer = RadixAttention(num_heads=4, head_dim=32, scaling=0.1, num_kv_heads=2, layer_id=0)
    fb = backend._step_batch
    with pytest.raises(cpu_backend.UnsupportedAttentionError, match="sinks"):
        backend.forward_decode(torch.zeros(3, 128), None, None, layer, fb, save_kv_cache=False, sinks=torch.zeros(4))
    # an argument given as None / False is no request for the feature
    backend.forward_decode(torch.zeros(3, 128), None, None, layer, fb, save_kv_cache=False, return_lse=False)


# ---- packed weights and online weight updates ----


def test_every_weight_update_asks_the_derived_cache_check() -> None:
    """The hook's premise: each entry point that writes weights first calls the check."""
    check = "_unsupported_derived_weight_cache_error(self.get_model())"
    for name in ("update_weights_from_disk", "load_weights_from_distributed", "update_weights_from_tensor",
                 "update_weights_from_ipc"):
        assert check in inspect.getsource(getattr(weight_updater.WeightUpdater, name)), name
    assert weight_updater._unsupported_derived_weight_cache_error(torch.nn.Linear(2, 2)) is None


@pytest.mark.skipif(not linear._mkldnn_bf16_ok(), reason="no oneDNN bf16")
def test_weight_written_through_data_is_repacked(monkeypatch) -> None:
    monkeypatch.setattr(linear, "_packed_bytes", 0)
    model = torch.nn.Module()
    model.proj = torch.nn.Module()
    model.proj.weight = torch.nn.Parameter(torch.randn(64, 32).bfloat16(), requires_grad=False)
    x = torch.randn(5, 32).bfloat16()
    with torch.no_grad():
        assert torch.equal(linear.linear(model.proj, x, model.proj.weight), F.linear(x, model.proj.weight))
        new = torch.randn(64, 32).bfloat16()
        # what SGLang's loaders do; the version counter stays, so the key alone cannot see it
        packed_weights_refresh._after(weight_updater._unsupported_derived_weight_cache_error(model), model)
        model.proj.weight.data.copy_(new)
        assert torch.equal(linear.linear(model.proj, x, model.proj.weight), F.linear(x, new))
        assert linear._packed_bytes == 64 * 32 * 2  # the old copy's bytes were given back
        # a refused update (the check returns a reason) keeps the copies
        packed_weights_refresh._after("refused", model)
        assert linear._ATTR in model.proj.__dict__


# ---- the compiled-kernel cache ----


@needs_c
def test_a_cached_file_that_does_not_load_is_rebuilt(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SUPERINFER_CACHE_DIR", str(tmp_path))
    target = native.cached_library(native._compiler())
    target.write_bytes(b"")  # truncated, as by a full disk or a killed copy
    assert native.build_and_load(native.SOURCE, native.CFLAGS, native._declare, "x") is not None
    assert target.stat().st_size > 0


@needs_c
def test_cc_with_a_launcher(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SUPERINFER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", f"env {os.environ.get('CC') or 'cc'}")
    assert native.build_and_load(native.SOURCE, native.CFLAGS, native._declare, "x") is not None


@needs_c
def test_an_unusable_cache_folder_builds_under_the_temp_dir(monkeypatch, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # the cache folder would sit under a file: it cannot be created, even by root
    monkeypatch.setenv("SUPERINFER_CACHE_DIR", str(blocker / "cache"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(native.tempfile, "tempdir", str(tmp_path / "tmp"))
    assert native.build_and_load(native.SOURCE, native.CFLAGS, native._declare, "x") is not None
    assert list((tmp_path / "tmp").rglob("*.so"))


def test_no_writable_folder_is_a_clear_error(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(native.os, "access", lambda *a: False)
    monkeypatch.setenv("SUPERINFER_CACHE_DIR", str(tmp_path))
    with pytest.raises(OSError, match="no writable folder"):
        native._writable_cache_dir()
