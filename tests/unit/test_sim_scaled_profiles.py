"""MoE and MLA shapes in the simulator and the A/B harness: KV geometry from config.json, the scaled
profiles regenerate exactly from the measured one, and the simulator serves them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superinfer_sgl.bench.profiles import DUMMY_SHAPES, make_dummy_model
from superinfer_sgl.bench.servers import kv_bytes_per_token as harness_kv_bytes
from superinfer_sgl.kv_geometry import KvGeometry, kv_geometry, model_kv_bytes_per_token
from superinfer_sgl.sim import scale_profile
from superinfer_sgl.sim.profile import PROFILE_DIR, load_profile
from superinfer_sgl.sim.runner import Job, run_job


@pytest.mark.parametrize("shape, layout, per_token", [
    ("llama3-8b", "mha", 32 * 2 * 8 * 128 * 2),
    ("qwen2.5-32b", "mha", 64 * 2 * 8 * 128 * 2),
    ("mixtral-8x7b", "mha", 32 * 2 * 8 * 128 * 2),
    ("deepseek-v2-lite", "mla", 27 * 1 * (512 + 64) * 2),  # one latent per layer, no per-head K/V
])
def test_kv_geometry_of_each_shape(shape: str, layout: str, per_token: int) -> None:
    geo = kv_geometry(DUMMY_SHAPES[shape])
    assert geo.layout == layout and geo.bytes_per_token(2) == per_token


def test_every_kv_budget_reads_the_same_rule(tmp_path: Path) -> None:
    """The launcher's CPU budget and the harness's vLLM byte budget both follow kv_geometry."""
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    model = make_dummy_model("deepseek-v2-lite", tok, tmp_path)
    assert model_kv_bytes_per_token(model, "bfloat16") == harness_kv_bytes(str(model)) == 31104
    assert model_kv_bytes_per_token(model, "float32") == 62208


def test_geometry_rejects_nonsense() -> None:
    with pytest.raises(AssertionError):
        KvGeometry("mla", 4, 3, 576)


@pytest.mark.parametrize("name", sorted(scale_profile.TARGETS))
def test_scaled_profile_regenerates_exactly(name: str, tmp_path: Path) -> None:
    """The committed profile is the scaler's output, not hand-edited numbers."""
    written = scale_profile.write(name, tmp_path)
    assert json.loads(written.read_text()) == json.loads((PROFILE_DIR / f"{name}.json").read_text())


def test_scaling_follows_what_bounds_each_cost() -> None:
    base = load_profile(PROFILE_DIR / f"{scale_profile.BASE}.json")
    moe = load_profile(PROFILE_DIR / "h200-mixtral-8x7b.json")
    mla = load_profile(PROFILE_DIR / "h100-deepseek-v2-lite.json")
    # per-token compute follows active parameters (12.9B of 46.7B for Mixtral)
    assert moe.step.per_decode_token_s == pytest.approx(base.step.per_decode_token_s * 12.9 / 32.76, rel=1e-3)
    # the decode floor reads all weights: Mixtral's 46.7B at H200's 4.8 TB/s vs 32.76B at 3.35 TB/s
    assert moe.step.floor_s == pytest.approx(base.step.floor_s * 46.7 / 32.76 * 3.35 / 4.8, rel=1e-3)
    # same device, fewer weights: a lower floor; the latent makes KV per token 8.4x smaller
    assert mla.step.floor_s < base.step.floor_s and mla.model.kv_bytes_per_token * 8 < base.model.kv_bytes_per_token
    # MLA: one buffer per layer, so a page of one layer is a page of the whole latent
    assert mla.model.kv_buffers_per_layer == 1
    assert mla.model.page_segment_bytes(16) == 16 * 576 * 2
    assert moe.model.page_segment_bytes(16) == 16 * 8 * 128 * 2
    # the pool is what 88% of HBM leaves after the bf16 weights
    assert mla.server.kv_tokens == pytest.approx((0.88 * 80e9 - 31.4e9) / 31104, rel=1e-3)


@pytest.mark.parametrize("name", sorted(scale_profile.TARGETS))
def test_simulator_serves_the_scaled_profiles(name: str) -> None:
    for policy in ("sglang", "goodput"):
        res = run_job(Job(profile=name, policy=policy, rate=8.0, duration=10.0, seed=3))
        assert res["finished"] == res["requests"] > 0, res
        assert 0.0 <= res["both_attainment"] <= 1.0
