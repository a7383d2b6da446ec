"""Simulator cost model: step time, link bandwidth, transfer engines (hand-checked numbers)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from superinfer_sgl.sim.profile import PROFILE_DIR, LinkModel, ModelShape, StepModel, load_profile
from superinfer_sgl.sim.transfer import make_engine

GH200_LINK = LinkModel("c2c", (32768.0, 4194304.0), (10.8, 80.0), (9.9, 134.0), 239.0, 270.0, 181.0, 179.0)
QWEN = ModelShape("qwen32b", 64, 262144)


def test_step_decode_is_roofline_plus_context() -> None:
    m = StepModel(base_s=0.003, floor_s=0.02, per_decode_token_s=1e-4, per_context_token_s=1e-7)
    # 100 requests: 100 * 1e-4 = 0.01 < floor 0.02 -> memory bound.
    assert m.seconds(decode_reqs=100, decode_context=50_000) == pytest.approx(0.003 + 0.02 + 0.005)
    # 300 requests: 0.03 > floor -> compute bound.
    assert m.seconds(decode_reqs=300, decode_context=0) == pytest.approx(0.003 + 0.03)


def test_step_prefill_terms_and_empty_batch() -> None:
    m = StepModel(base_s=0.01, prefill_base_s=0.002, per_prefill_token_s=0.001, per_prefill_pair_s=1e-6,
                  per_prefill_req_s=0.0005)
    assert m.seconds() == 0.0
    # 100 tokens alone: pairs 100*100/2 = 5000.
    assert m.prefill_alone(100) == pytest.approx(0.01 + 0.002 + 0.1 + 0.005 + 0.0005)
    # prefill + decode in one (mixed) batch: linear terms add up under the max.
    assert m.seconds(10, 0.0, 1, decode_reqs=5) == pytest.approx(0.01 + 0.002 + 0.0005 + 0.010)


def test_step_rejects_negative_coefficients() -> None:
    with pytest.raises(AssertionError):
        StepModel(base_s=-1.0)


def test_link_interpolation_is_log_log_and_latency_bound_below() -> None:
    link = LinkModel("pcie", (65536.0, 1048576.0, 8388608.0), (5.0, 30.0, 60.0), (5.0, 30.0, 60.0), 50.0, 50.0)
    assert link.per_copy_gbps(65536, True) == pytest.approx(5.0)
    assert link.per_copy_gbps(1048576, False) == pytest.approx(30.0)
    # 256 KiB is halfway between 64 KiB and 1 MiB in log space: geometric mean of 5 and 30.
    assert link.per_copy_gbps(262144, True) == pytest.approx(math.sqrt(5.0 * 30.0))
    # Below the smallest size a copy costs what a 64 KiB copy costs: 32 KiB -> 2.5 GB/s.
    assert link.per_copy_gbps(32768, True) == pytest.approx(2.5)
    assert link.per_copy_gbps(64 * 2**20, True) == pytest.approx(60.0)


def test_batched_one_way_serial_and_duplex() -> None:
    gb = 1e9
    assert GH200_LINK.batched_seconds(239 * gb, 0) == pytest.approx(1.0)
    assert GH200_LINK.batched_seconds(0, 270 * gb) == pytest.approx(1.0)
    # Both ways at once, 181 GB each: out finishes after 1 s at 181 GB/s; in has moved 179 GB by then
    # and moves the last 2 GB alone at 270 GB/s.
    assert GH200_LINK.batched_seconds(181 * gb, 181 * gb) == pytest.approx(1.0 + 2 / 270)
    # duplex=False: one direction after the other at one-way rates.
    assert GH200_LINK.batched_seconds(239 * gb, 270 * gb, duplex=False) == pytest.approx(2.0)


def test_naive_engine_uses_per_page_per_layer_segments() -> None:
    assert QWEN.page_segment_bytes(16) == 16 * 262144 // 128 == 32768
    naive = make_engine("naive", GH200_LINK, QWEN, 16)
    assert naive.seconds(10.8e9, 0) == pytest.approx(1.0)
    assert naive.seconds(10.8e9, 9.9e9) == pytest.approx(2.0)  # directions serialise
    duplex = make_engine("duplex", GH200_LINK, QWEN, 16)
    assert duplex.eager_sync and not naive.eager_sync
    assert duplex.seconds(8e9, 8e9) < 0.05 < naive.seconds(8e9, 8e9)  # paper: 46.8 ms vs 1556 ms
    assert make_engine("free", GH200_LINK, QWEN, 16).seconds(1e12, 1e12) == 0.0
    with pytest.raises(ValueError):
        make_engine("warp", GH200_LINK, QWEN, 16)


def test_paper_end_to_end_8gb_each_way() -> None:
    """The paper's 8 GB each way: naive 1556 ms, DuplexKV 46.8 ms. The link model built from the
    paper's own bandwidth figures gives 1549 ms and 44.5 ms (it has no launch or sync overheads)."""
    gb = 8e9
    naive = make_engine("naive", GH200_LINK, QWEN, 16).seconds(gb, gb)
    duplex = make_engine("duplex", GH200_LINK, QWEN, 16).seconds(gb, gb)
    assert naive == pytest.approx(8 / 10.8 + 8 / 9.9) == pytest.approx(1.556, rel=0.01)
    assert duplex == pytest.approx(8 / 181 + (8 - 8 / 181 * 179) / 270)
    assert duplex == pytest.approx(0.0468, rel=0.06)


@pytest.mark.parametrize("path", sorted(PROFILE_DIR.glob("*.json")), ids=lambda p: p.stem)
def test_shipped_profiles_load_and_state_sources(path: Path) -> None:
    prof = load_profile(path)
    assert prof.sources and prof.assumptions, f"{path.name} must say where its numbers come from"
    assert prof.step.seconds(decode_reqs=1) > 0
    assert prof.model.kv_bytes_per_token > 0 and prof.server.kv_tokens > 0


def test_profile_rejects_unknown_keys(tmp_path: Path) -> None:
    raw = json.loads((PROFILE_DIR / "gh200-qwen2.5-32b.json").read_text())
    raw["step"]["per_token_typo_s"] = 1.0
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="per_token_typo_s"):
        load_profile(bad)
