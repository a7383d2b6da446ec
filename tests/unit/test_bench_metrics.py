"""A/B metrics on hand-made per-request ttft / itl data (numbers checked by hand in comments)."""

from __future__ import annotations

import asyncio
import time

import pytest

from superinfer_sgl.bench.client import scheduled_get_request
from superinfer_sgl.bench.metrics import (
    RequestOutcome,
    counter_deltas,
    max_rate_meeting,
    outcomes_from_details,
    parse_prometheus,
    summarize,
)
from superinfer_sgl.bench.report import check_targets, markdown_table, noise_band

# TTFT SLO 1000 ms, TBT SLO 200 ms for all five requests.
DETAILS = {
    "ttfts": [0.5, 1.5, 0.2, 0.0, 0.9],
    "itls": [[0.1, 0.1, 0.3], [0.05] * 9, [0.1] * 8, [], [0.1] * 9 + [0.25]],
    "output_lens": [4, 10, 11, 0, 11],
    "errors": ["", "", "", "boom", ""],
}
SLOS = [(1000.0, 200.0, "a"), (1000.0, 200.0, "a"), (1000.0, 200.0, "b"), (1000.0, 200.0, "b"),
        (1000.0, 200.0, "b")]
EXPECTED = [4, 10, 11, 5, 11]


@pytest.fixture
def outcomes() -> list[RequestOutcome]:
    return outcomes_from_details(DETAILS, SLOS, EXPECTED)


def test_per_request_outcomes(outcomes: list[RequestOutcome]) -> None:
    a, b, c, d, e = outcomes
    # A: TTFT met; gaps 0.1, 0.1, 0.3 -> 2 of 3 met; 67% < 90% -> not joint.
    assert (a.ttft_met, a.n_gaps, a.gaps_met, a.tbt_all_met, a.joint_met) == (True, 3, 2, False, False)
    # B: TTFT 1.5 s missed, every gap met.
    assert (b.ttft_met, b.n_gaps, b.gaps_met, b.tbt_all_met, b.joint_met) == (False, 9, 9, True, False)
    # C: 11 tokens, 8 streamed gaps -> 2 zero-length gaps (tokens that arrived together).
    assert c.gaps_s() == [0.1] * 8 + [0.0, 0.0]
    assert (c.ttft_met, c.n_gaps, c.gaps_met, c.tbt_all_met, c.joint_met) == (True, 10, 10, True, True)
    # D failed: misses everything; its 4 expected gaps count as missed.
    assert (d.ttft_met, d.n_gaps, d.gaps_met, d.joint_met) == (False, 4, 0, False)
    # E: 9 of 10 gaps met = exactly 90% -> joint (>= 90%), but not "every gap".
    assert (e.ttft_met, e.gaps_met, e.tbt_share, e.tbt_all_met, e.joint_met) == (True, 9, 0.9, False, True)


def test_summary_numbers(outcomes: list[RequestOutcome]) -> None:
    s = summarize(outcomes, duration_s=10.0)
    assert (s.n, s.completed) == (5, 4)
    assert s.ttft_attainment == pytest.approx(3 / 5)
    assert s.tbt_gap_attainment == pytest.approx(30 / 36)  # (2+9+10+0+9) / (3+9+10+4+10)
    assert s.tbt_request_attainment == pytest.approx(2 / 5)  # B, C
    assert s.joint_attainment == pytest.approx(2 / 5)  # C, E
    assert s.goodput_rps == pytest.approx(0.2)
    assert s.output_throughput_tps == pytest.approx((4 + 10 + 11 + 11) / 10)
    assert s.p50_ttft_ms == pytest.approx(700.0)  # median of 0.2, 0.5, 0.9, 1.5 s
    assert s.p99_ttft_ms == pytest.approx(1482.0)  # 0.9 + 0.97 * 0.6 s (linear)
    assert s.p50_e2e_ms == pytest.approx(1475.0)  # e2e = ttft + sum(itl): 1.0, 1.95, 1.0, 2.05 s
    assert s.by_class["a"]["ttft_attainment"] == pytest.approx(0.5)
    assert s.by_class["b"]["joint_attainment"] == pytest.approx(2 / 3)
    assert s.by_class["b"]["tbt_gap_attainment"] == pytest.approx(19 / 24)


def test_details_must_cover_the_workload() -> None:
    with pytest.raises(ValueError, match="cover"):
        outcomes_from_details(DETAILS, SLOS[:3], EXPECTED[:3])


def test_max_rate_meeting() -> None:
    pts = [(1, 0.99), (2, 0.95), (3, 0.85), (4, 0.5)]
    assert max_rate_meeting(pts) == {"max_swept": 2, "interpolated": pytest.approx(2.5), "all_met": False}
    assert max_rate_meeting([(1, 0.95), (2, 0.93)]) == {"max_swept": 2, "interpolated": 2, "all_met": True}
    assert max_rate_meeting([(1, 0.5), (2, 0.99)])["max_swept"] is None  # must hold from the lowest rate up
    assert max_rate_meeting([(2, 0.95), (3, 0.97), (1, 0.99), (4, 0.8)])["interpolated"] == pytest.approx(3.4118, abs=1e-4)


def test_prometheus_parsing_and_deltas() -> None:
    before = parse_prometheus("# HELP x\nsuperinfer_rotations_out_total 3.0\n"
                              'sglang:num_retracted_requests_total{model_name="m",tp="0"} 1.0\n')
    after = parse_prometheus('superinfer_rotations_out_total 10.0\nsglang:num_retracted_requests_total{model_name="m"} 4\n'
                             'sglang:num_retracted_requests_total{model_name="n"} 1\nsuperinfer_resumes_total 6\n')
    assert after["sglang:num_retracted_requests_total"] == 5.0
    d = counter_deltas(before, after)
    assert d == {"rotations": 7.0, "resumes": 6.0, "recompute_fallbacks": 0.0, "retractions": 4.0,
                 "shortage_rotations": 0.0, "copy_out_s": 0.0, "copy_in_s": 0.0, "copy_overlap_s": 0.0}
    # copy time per direction (integration/copy_metrics.py) is differenced like the counts
    later = parse_prometheus('superinfer_rotations_out_total 12.0\nsuperinfer_kv_copy_out_seconds_total 0.5\n'
                             'superinfer_kv_copy_in_seconds_total 0.25\nsuperinfer_kv_copy_overlap_seconds_total 0.125\n')
    d2 = counter_deltas(after, later)
    assert (d2["copy_out_s"], d2["copy_in_s"], d2["copy_overlap_s"], d2["rotations"]) == (0.5, 0.25, 0.125, 2.0)
    # stock SGLang before its first retraction: no superinfer_ family, no retraction series yet
    stock = parse_prometheus('sglang:num_running_reqs{model_name="m"} 0\n')
    assert counter_deltas(stock, stock) == {"rotations": None, "resumes": None, "recompute_fallbacks": None,
                                            "retractions": 0.0, "shortage_rotations": None, "copy_out_s": None,
                                            "copy_in_s": None, "copy_overlap_s": None}
    assert counter_deltas({}, {})["retractions"] is None  # /metrics unreachable


def _point(rate: float, ttft: float, tbt: float, joint: float, tput: float) -> dict:
    keys = ("p50_ttft_ms", "p99_ttft_ms", "p50_tbt_ms", "p99_tbt_ms", "p50_e2e_ms", "p99_e2e_ms")
    summary = {"ttft_attainment": ttft, "tbt_gap_attainment": tbt, "tbt_request_attainment": tbt,
               "joint_attainment": joint, "goodput_rps": joint * rate, "output_throughput_tps": tput,
               "completed": 10, "n": 10, **{k: 1.0 for k in keys}}
    return {"rate": rate, "summary": summary, "counters": {"rotations": 2.0, "retractions": 1.0}}


def test_targets_and_noise() -> None:
    results = {
        "sglang": [_point(1, 0.95, 0.99, 0.95, 100), _point(2, 0.40, 0.98, 0.40, 150)],
        "superinfer": [_point(1, 1.0, 0.99, 0.98, 100), _point(2, 0.85, 0.97, 0.85, 147)],
    }
    t = check_targets(results, "sglang", "superinfer")
    assert t["rate"] == 2
    assert t["ttft_gain_points"] == pytest.approx(45.0) and t["ttft_target_met"]
    assert t["tbt_delta_points"] == pytest.approx(-1.0) and t["tbt_target_met"]
    assert t["throughput_ratio"] == pytest.approx(0.98) and t["throughput_target_met"]
    # stock crosses 90% at 1 + 0.05/0.55 = 1.0909; ours at 1 + 0.08/0.13 = 1.6154 -> 1.48x
    assert t["capacity_ratio"] == pytest.approx(1.6154 / 1.0909, abs=1e-3) and not t["capacity_target_met"]
    assert noise_band(results, "sglang", "superinfer")["ttft_attainment"] == pytest.approx(45.0)
    table = markdown_table(results)
    # rotations, recomputes; no copy-time series exported: dashes
    assert "| 2 | superinfer | 85.0% | 97.0% |" in table and "| 2 | 1 | - | - | - | 10/10 |" in table
    # the GPU goal at the highest rate: +45 points joint, 98% throughput
    over = t["overloaded"]
    assert over["rate"] == 2 and over["joint_gain_points"] == pytest.approx(45.0) and over["joint_target_met"]
    assert over["throughput_ratio"] == pytest.approx(0.98) and over["throughput_target_met"]


def test_table_shows_copy_time_and_the_cost_of_one_rotation() -> None:
    p = _point(2, 0.85, 0.97, 0.85, 147)
    p["counters"] |= {"resumes": 4.0, "copy_out_s": 0.05, "copy_in_s": 0.02, "copy_overlap_s": 0.01}
    table = markdown_table({"superinfer": [p]})
    # 50 ms over 2 rotations out, 20 ms over 4 resumes
    assert "| 0.050 / 0.020 | 0.010 | 25.00 / 5.00 | 10/10 |" in table


def test_scheduled_arrivals_follow_the_schedule() -> None:
    arrivals = [0.0, 0.05, 0.15]
    gen = scheduled_get_request(arrivals)

    async def collect() -> list[tuple[str, float]]:
        t0 = time.perf_counter()
        return [(r, time.perf_counter() - t0) async for r in gen(["a", "b", "c"], float("inf"))]

    got = asyncio.run(collect())
    assert [r for r, _ in got] == ["a", "b", "c"]
    for (_, t), want in zip(got, arrivals):
        assert want - 0.005 <= t <= want + 0.05
