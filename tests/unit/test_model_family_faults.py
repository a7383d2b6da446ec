"""Faults a review of the model-family layer reproduced: each test fails on the code before its fix."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.kv_geometry import kv_geometry
from superinfer_sgl.launch_checks import LaunchError, check_model_path

memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")


def _fp8_pool(**kw: object) -> object:
    return memory_pool.MHATokenToKVPool(size=64, page_size=1, dtype=torch.float8_e4m3fn, head_num=2, head_dim=16,
                                        layer_num=2, device="cpu", enable_memory_saver=False, **kw)


def test_cpu_fp8_kv_cache_rotates_byte_for_byte() -> None:
    """SGLang's CPU fp8 method keeps no scale buffers (per-tensor scales live on the layer): the
    codes are the whole KV. It was refused as 'quantized with scale buffers'."""
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import get_kv_cache_quant_method

    from superinfer_sgl.duplexkv.engine import RotationEngine
    from superinfer_sgl.duplexkv.host_pool import HostKVPool
    from superinfer_sgl.integration.kv_adapter import device_pool_view

    pool = _fp8_pool(quant_method=get_kv_cache_quant_method("cpu_fp8_e4m3"))
    assert pool.is_quantized_kv_cache and pool.k_scale_buffer is None
    dev = device_pool_view(pool)
    engine = RotationEngine(dev, HostKVPool.for_device(dev, 16, "auto", gb=0.001), "torch")
    planes = (*pool.k_buffer, *pool.v_buffer)
    gen = torch.Generator().manual_seed(0)
    for b in planes:
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=gen))
    src, dst = torch.arange(1, 21), torch.arange(30, 50)
    before = [b.view(torch.uint8)[src].clone() for b in planes]
    engine.load(engine.save(src), dst)
    assert all(torch.equal(x, b.view(torch.uint8)[dst]) for x, b in zip(before, planes))


def test_lossy_rotation_on_a_device_kv_sglang_made_fp8_rotates_exactly(caplog: pytest.LogCaptureFixture) -> None:
    """--kv-cache-dtype auto on a checkpoint with an fp8 KV quant config: SGLang picks fp8 itself,
    the launch check (which reads the flag) passes, and the scheduler's startup raised ValueError."""
    from superinfer_sgl.integration.startup import open_engine

    sched = SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=_fp8_pool), tp_size=1,
                            tree_cache=SimpleNamespace(disable=False, supports_prefix_sharing=lambda: True))
    for cfg in (SuperInferConfig(rotary_kv_dtype="fp8_e4m3", rotary_pool_gb=0.001, rotation_budget_blocks=4),
                SuperInferConfig(rotary_kv_dtype="int4", rotary_pool_gb=0.001, rotation_budget_blocks=4)):
        with caplog.at_level(logging.WARNING, logger="superinfer_sgl.integration.startup"):
            setup = open_engine(sched, cfg)
        assert setup.engine is not None and setup.engine.host_pool.kv_format == "auto"
        assert f"rotating it exactly, not as {cfg.rotary_kv_dtype}" in caplog.text


def test_kv_geometry_counts_v_head_dim_and_reads_text_config() -> None:
    """K 192 / V 128 (SGLang's asymmetric KV) was counted as 192 + 192; a multimodal config's
    text_config raised KeyError."""
    asym = {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "hidden_size": 1024,
            "head_dim": 192, "v_head_dim": 128}
    pool = memory_pool.MHATokenToKVPool(size=1000, page_size=1, dtype=torch.bfloat16, head_num=2, head_dim=192,
                                        v_head_dim=128, layer_num=4, device="cpu", enable_memory_saver=False)
    k, v = pool.get_kv_size_bytes()
    assert kv_geometry(asym).bytes_per_token(2) == (k + v) // 1001 == 4 * 2 * (192 + 128) * 2
    nested = {"architectures": ["Gemma3ForConditionalGeneration"], "vision_config": {"num_hidden_layers": 27},
              "text_config": {"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
                              "hidden_size": 1024, "head_dim": 256}}
    assert kv_geometry(nested).bytes_per_token(2) == 4 * 2 * 4 * 256 * 2


def test_model_paths_sglang_serves_are_not_called_missing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    check_model_path(str(gguf))
    magic = tmp_path / "weights.bin"
    magic.write_bytes(b"GGUF" + bytes(60))
    check_model_path(str(magic))  # SGLang's own test: the suffix or the magic
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(LaunchError, match="is a file, neither a model folder nor a GGUF checkpoint"):
        check_model_path(str(other))
    check_model_path("s3://bucket/models/llama")  # a remote URL: SGLang's loaders reach it
    asked: list[str] = []
    monkeypatch.setattr("superinfer_sgl.launch_checks._hub_model_known", lambda repo: asked.append(repo) or True)
    check_model_path("owner/repo/sub/model-Q4_K_M.gguf")
    check_model_path("owner/repo:Q4_K_M")
    assert asked == ["owner/repo", "owner/repo"]
    with pytest.raises(LaunchError, match="does not exist"):
        check_model_path("owner/repo/not-a-gguf")
