"""SLO capacity search (sim/capacity.py): the first crossing of the target, to the stated
resolution, on monotone and non-monotone attainment curves; and one real simulator search."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer_sgl.sim.capacity import CapacityGrid, capacity_table, find_capacity, policy_capacity
from superinfer_sgl.sim.runner import Job


def _curve(knee: float):
    """Attainment 1 up to the knee, then falling: 0.9 is crossed exactly at the knee."""
    calls: list[float] = []

    def measure(rates):
        calls.extend(rates)
        return [1.0 if r <= knee else max(0.0, 0.9 - (r - knee)) - 1e-9 for r in rates]

    return measure, calls


@settings(max_examples=60, deadline=None)
@given(knee=st.floats(0.6, 60.0), batch=st.integers(1, 4), probes=st.integers(1, 3),
       resolution=st.sampled_from([0.01, 0.02, 0.1]))
def test_monotone_curve_capacity_is_the_crossing_within_resolution(knee: float, batch: int, probes: int,
                                                                   resolution: float) -> None:
    grid = CapacityGrid(lo=0.5, hi=64.0, resolution=resolution, probes=probes)
    measure, _ = _curve(knee)
    cap = find_capacity(measure, grid, batch=batch)
    assert cap.censored is None
    lo, hi = cap.bracket
    assert cap.capacity_req_s == lo <= knee < hi
    assert hi - lo <= resolution * lo + 1e-9
    assert not cap.passes_above


def test_non_monotone_curve_counts_only_the_first_crossing() -> None:
    # stock SGLang's simulated curve past its knee: 13 req/s 51%, 14 req/s 92%, 15 req/s 54%
    table = {10: 1.0, 11: 0.97, 12: 0.93, 13: 0.51, 14: 0.92, 15: 0.54, 16: 0.3, 17: 0.2}

    def measure(rates):
        return [table[int(r)] for r in rates]

    # grid 10, 11, 12.1, 13.31, 14.641, 16.105, 17
    cap = find_capacity(measure, CapacityGrid(lo=10, hi=17, growth=1.1, resolution=0.01, stop_after=3))
    assert cap.capacity_req_s is not None and 12.87 <= cap.capacity_req_s < 13.0
    assert cap.bracket[1] is not None and 13.0 <= cap.bracket[1] <= 13.31
    # a grid rate above the first failure that passes again is reported, not counted
    assert cap.passes_above == [14.641]


@settings(max_examples=80, deadline=None)
@given(seed=st.integers(0, 10**6), probes=st.integers(1, 3), extend_below=st.integers(0, 3),
       lo=st.sampled_from([0.5, 2.0, 6.0]))
def test_the_answer_does_not_depend_on_the_batch(seed: int, probes: int, extend_below: int, lo: float) -> None:
    """A curve that wavers around the target (as simulated ones do near their knee): every batch
    size finds the same capacity, bracket and points, so `--jobs` cannot move a published figure."""
    import random

    def measure(rates):  # a pseudo-random but fixed attainment per rate, falling with the rate
        out = []
        for r in rates:
            rng = random.Random(f"{seed}:{r}")
            out.append(min(1.0, max(0.0, 1.05 - r / 40 + rng.uniform(-0.06, 0.06))))
        return out

    grid = CapacityGrid(lo=lo, hi=64.0, probes=probes, extend_below=extend_below)
    answers = [find_capacity(measure, grid, batch=b).as_dict() for b in (1, 2, 3, 5)]
    assert all(a == answers[0] for a in answers[1:]), answers


def test_more_probes_per_round_can_find_another_crossing() -> None:
    """Why `probes` is part of the grid: at 2 probes per round the search sees a dip that
    bisection steps over."""
    def measure(rates):
        return [0.85 if 5.2 <= r <= 5.4 else (0.95 if r < 6.0 else 0.5) for r in rates]

    grid = CapacityGrid(lo=4.0, hi=8.0, growth=1.5, resolution=0.02)
    assert find_capacity(measure, grid).capacity_req_s != find_capacity(measure, replace(grid, probes=2)).capacity_req_s


def test_censored_both_ways() -> None:
    grid = CapacityGrid(lo=1, hi=8)
    high = find_capacity(lambda rs: [1.0] * len(rs), grid)
    assert high.censored == "above" and high.capacity_req_s == 8
    low = find_capacity(lambda rs: [0.5] * len(rs), grid)
    assert low.censored == "below" and low.capacity_req_s is None


def test_scan_stops_after_consecutive_failures() -> None:
    measure, calls = _curve(2.0)
    find_capacity(measure, CapacityGrid(lo=0.5, hi=64.0, stop_after=2))
    grid_calls = [r for r in calls if r in CapacityGrid(lo=0.5, hi=64.0).rates()]
    assert max(grid_calls) < 4.0  # nothing near 64 req/s was simulated


def test_simulator_capacity_orders_a_small_and_a_large_kv_pool() -> None:
    """A real search on the CPU profile: a device KV pool a third the size has a lower capacity."""
    grid = CapacityGrid(lo=0.25, hi=8.0, growth=1.6, resolution=0.1)
    big = policy_capacity(Job("cpu-smollm2-135m", "sglang", duration=30.0, seed=3), grid)
    small = policy_capacity(Job("cpu-smollm2-135m", "sglang", duration=30.0, seed=3, kv_tokens=3000), grid)
    assert big["capacity_req_s"] and small["capacity_req_s"], (big, small)
    assert small["capacity_req_s"] < big["capacity_req_s"]
    for r in (big, small):  # the bracket straddles the target at the stated resolution
        lo, hi = r["bracket"]
        att = dict(r["points"])
        assert att[lo] >= 0.9 > att[hi] and hi - lo <= 0.1 * lo + 1e-9
    text = capacity_table([big, dict(small, policy="small")])
    assert "| sglang |" in text and "1.00x" in text


def test_cli_writes_one_row_per_policy(tmp_path, capsys) -> None:
    import json

    from superinfer_sgl.sim.__main__ import main

    out = tmp_path / "cap.json"
    assert main(["capacity", "--profile", "cpu-smollm2-135m", "--policy", "sglang", "--policy", "goodput",
                 "--duration", "20", "--lo", "0.25", "--hi", "4", "--growth", "1.6", "--resolution", "0.1",
                 "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["policy"] for r in rows] == ["sglang", "goodput"]
    assert all("capacity_req_s" in r and r["points"] for r in rows)
    assert "| goodput |" in capsys.readouterr().out
    assert {r["slo_rule"] for r in rows} == {"gaps"}


def test_the_tpot_rule_is_the_summary_s_distserve_joint_attainment() -> None:
    """`--slo-rule tpot` searches on TTFT met and mean TPOT within the TBT SLO (sim/metrics)."""
    from superinfer_sgl.sim.runner import run_job

    job = Job("cpu-smollm2-135m", "sglang", duration=20.0, seed=3, rate=2.0)
    r = run_job(job)
    assert 0 <= r["joint_tpot_attainment"] <= min(r["ttft_attainment"], r["tpot_attainment"])
    grid = CapacityGrid(lo=0.25, hi=4.0, growth=1.6, resolution=0.1)
    tpot = policy_capacity(job, grid, slo_rule="tpot")
    assert tpot["slo_rule"] == "tpot" and tpot["capacity_req_s"]
    with pytest.raises(ValueError, match="slo_rule"):
        policy_capacity(job, grid, slo_rule="p99")


@settings(max_examples=40, deadline=None)
@given(knee=st.floats(0.1, 0.99), batch=st.integers(1, 3))
def test_a_capacity_under_the_grid_is_found_below_it(knee: float, batch: int) -> None:
    """The lowest grid rate fails: rates below it are scanned down (`extend_below`) and the
    crossing bisected as above; without the extension, or past its reach, it stays "below"."""
    grid = CapacityGrid(lo=1.0, hi=8.0, growth=1.4, resolution=0.05, extend_below=8)
    measure, calls = _curve(knee)
    cap = find_capacity(measure, grid, batch=batch)
    reach = 1.0 / 1.4 ** 8
    if knee >= reach:
        assert cap.censored is None
        lo, hi = cap.bracket
        assert cap.capacity_req_s == lo <= knee < hi and hi - lo <= 0.05 * lo + 1e-9
        assert min(calls) >= knee / 1.4 ** batch - 1e-9  # the downward scan stopped at its first pass (batch)
    else:
        assert cap.censored == "below"
    assert find_capacity(_curve(knee)[0], CapacityGrid(lo=1.0, hi=8.0, growth=1.4)).censored == "below"


@pytest.mark.parametrize("args, says", [
    (["run", "--profile", "no-such-profile", "--jobs", "2"], "no profile 'no-such-profile'"),
    (["capacity", "--profile", "no-such-profile"], "no profile 'no-such-profile'"),
    (["plan", "--profile", "no-such-profile", "--class", "chat:rate=1,ttft_ms=1000,tbt_ms=50"], "no profile"),
    (["run", "--workload", "azure:chat"], "the Azure traces are azure:conv and azure:code"),
    (["capacity", "--workload", "azure:conv@soon"], "START must be seconds"),
    (["run", "--workload", "/no/such/trace.csv"], "No such file"),
])
def test_cli_refuses_a_misspelt_profile_or_workload_before_running(args, says, capsys) -> None:
    from superinfer_sgl.sim.__main__ import main

    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
