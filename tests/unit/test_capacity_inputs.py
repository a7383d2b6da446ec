"""The capacity tools on inputs and outcomes a review of 2026-12-03 found mishandled (each test
fails on the code before its fix): `sim capacity`, `sim plan`, `ab_bench.py --capacity` and the
live search's statistics."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from superinfer_sgl.bench import capacity_stats, cli
from superinfer_sgl.sim import __main__ as sim_cli
from superinfer_sgl.sim.capacity import CapacityGrid, capacity_table, find_capacity, policy_capacity
from superinfer_sgl.sim.plan import MixClass, PlanSpec, plan_table
from superinfer_sgl.sim.runner import Job

sys.path.insert(0, str(Path(__file__).parent))
from test_bench_capacity_live import _point  # noqa: E402


@pytest.mark.parametrize("kwargs", [{"target": 1.5}, {"target": math.nan}, {"lo": 0.0}, {"lo": 5.0, "hi": 2.0},
                                    {"growth": 1.0}, {"resolution": 0.0}, {"resolution": 1e-8}, {"probes": 0}])
def test_a_grid_no_search_can_run_on_is_a_value_error(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        CapacityGrid(**kwargs)


def test_the_search_ends_where_rounded_rates_cannot_narrow_the_bracket() -> None:
    grid = CapacityGrid(lo=0.001, hi=0.01, resolution=1e-4)  # a bracket of 1e-7: under the 6-decimal rounding
    cap = find_capacity(lambda rates: [1.0 if r <= 0.0015 else 0.0 for r in rates], grid)
    assert cap.capacity_req_s is not None and cap.capacity_req_s <= 0.0015 < cap.bracket[1]


def test_an_attainment_that_is_not_a_number_fails_the_rate() -> None:
    cap = find_capacity(lambda rates: [math.nan] * len(rates), CapacityGrid(lo=1.0, hi=4.0))
    assert cap.capacity_req_s is None and cap.censored == "below"


def test_a_rate_with_no_request_is_an_error_not_a_pass() -> None:
    with pytest.raises(ValueError, match="no request arrived"):
        policy_capacity(Job("cpu-smollm2-135m", "sglang", duration=1.0), CapacityGrid(lo=0.01, hi=0.02))


def test_the_table_keeps_the_targets_digits() -> None:
    rows = [{"policy": "sglang", "capacity_req_s": 1.0, "target": 0.995, "censored": None, "bracket": (1.0, 1.1)}]
    assert "capacity at 99.5%" in capacity_table(rows)


def test_capacity_refuses_a_recorded_table_it_cannot_retime(tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.0,10,5\n0.5,12,6\n")
    with pytest.raises(SystemExit) as ex:
        sim_cli.main(["capacity", "--workload", str(trace), "--policy", "sglang"])
    assert ex.value.code == 2


@pytest.mark.parametrize("argv", [["capacity", "--seeds", "0"], ["capacity", "--duration", "-5"],
                                  ["capacity", "--target", "1.5"],
                                  ["plan", "--jobs", "0", "--class", "c:rate=1,ttft_ms=1,tbt_ms=1"],
                                  ["plan", "--class", "c:rate=nan,ttft_ms=1,tbt_ms=1"],
                                  ["plan", "--class", "c:rate=1,ttft_ms=1,tbt_ms=1", "--class", "c:rate=2,ttft_ms=2,tbt_ms=2"]])
def test_bad_capacity_and_plan_inputs_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ex:
        sim_cli.main(argv)
    assert ex.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_a_class_with_no_request_at_a_rate_is_not_counted_as_met() -> None:
    spec = PlanSpec("cpu-smollm2-135m", (MixClass("rare", 0.001, 0.001, 0.05), MixClass("bulk", 1.0, 60.0, 1.0)),
                    duration=5.0)
    with pytest.raises(ValueError, match="class rare: no request"):
        spec.worst_class_attainment("sglang", spec.classes, 2.0)


def test_a_plan_at_the_grids_top_says_at_least_and_writes_plain_json() -> None:
    rows = [{"policy": "sglang", "rate_req_s": 200.0, "target": 0.9, "capacity_per_replica_req_s": 64.0,
             "censored": "above", "replicas_shared": 4, "capacity_alone_req_s": {"a": None, "b": 64.0},
             "censored_alone": {"b": "above"}, "replicas_separate": None}]
    table = plan_table(rows)
    assert ">= 64.00 (grid max)" in table and "<= 4" in table and "below grid" in table
    json.dumps(rows, allow_nan=False)


def _runs(caps: dict[str, list[float]], errored: set[tuple[str, int]]) -> tuple[list[dict], dict[str, list]]:
    runs: list[dict] = []
    results: dict[str, list] = {name: [] for name in caps}
    for name, values in caps.items():
        for k, cap in enumerate(values):
            err = (name, k) in errored
            runs.append({"system": name, "repeat": k, "capacity_req_s": None if err else cap, "censored": None,
                         "bracket": (cap, 1.1 * cap), **({"error": "server died"} if err else {})})
            if not err:
                results[name] += [_point(cap * f, k, 40, 40 if f <= 1 else 20) for f in (0.5, 1.0, 1.1)]
    return runs, results


def test_live_ratios_pair_repeats_by_number_when_a_search_failed() -> None:
    runs, results = _runs({"sglang": [1.0, 2.0, 4.0], "superinfer": [2.0, 4.0, 8.0]}, {("sglang", 0)})
    out = capacity_stats.summarize(runs, [("sglang", "superinfer")], results)
    assert out["pairs"][0]["per_repeat"] == [2.0, 2.0] and out["pairs"][0]["ratio"] == pytest.approx(2.0)
    assert out["by_rule"]["pairs"][0]["gaps"]["ratio"] == pytest.approx(2.0)


def test_live_statistics_survive_a_system_whose_every_search_failed() -> None:
    runs, results = _runs({"sglang": [1.0], "superinfer": [2.0]}, {("sglang", 0)})
    out = capacity_stats.summarize(runs, [("sglang", "superinfer")], results)
    assert out["systems"]["sglang"]["per_repeat"] == [] and out["pairs"][0]["ratio"] is None


@pytest.mark.parametrize("grid", [["--capacity-grid", "8,2"], ["--capacity-grid", "1,2,3"],
                                  ["--capacity-resolution", "0"], ["--capacity-growth", "1"]])
def test_a_live_grid_is_checked_before_any_server_starts(grid: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--profile", "smoke", "--capacity", *grid, "--dry-run"]) == 2
    assert "--capacity" in capsys.readouterr().err
