"""Paired A/B mode and its statistics: pairs, core pinning, matched runs, intervals, verdicts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer_sgl.bench.cli import parser
from superinfer_sgl.bench.paired import core_halves, pairs_for
from superinfer_sgl.bench.servers import pin
from superinfer_sgl.bench.planning import build_plan, for_repeat
from superinfer_sgl.bench.report import comparisons, comparisons_markdown, pooled_markdown
from superinfer_sgl.bench.servers import noise_twin, systems
from superinfer_sgl.bench.stats import compare_runs, indicator_diff, pooled, ratio


def _names(pairs):  # type: ignore[no-untyped-def]
    return [(a.name, b.name) for a, b in pairs]


def test_pairs_put_ours_beside_every_baseline_and_stock_beside_its_twin() -> None:
    t = systems(())
    chosen = [t["sglang"], t["sglang-priority"], t["superinfer"], noise_twin(t["sglang"])]
    assert _names(pairs_for(chosen)) == [("sglang", "superinfer"), ("sglang-priority", "superinfer"),
                                         ("sglang", "sglang#2")]
    assert _names(pairs_for([t["sglang"], noise_twin(t["sglang"])])) == [("sglang", "sglang#2")]
    with pytest.raises(ValueError, match="two systems"):
        pairs_for([t["superinfer"]])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_pin_moves_every_thread_of_a_process() -> None:
    a, b = core_halves()
    assert a and b and not (a & b)
    code = ("import threading, time\n[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() "
            "for _ in range(3)]\nprint('ready', flush=True)\ntime.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"  # its threads exist
        assert pin([proc.pid], b) >= 4  # the main thread and its three threads
        tids = os.listdir(f"/proc/{proc.pid}/task")
        assert all(os.sched_getaffinity(int(t)) == set(b) for t in tids)
    finally:
        proc.kill()
        proc.wait()
    assert pin([proc.pid], a) == 0  # a process that is gone: nothing to pin, no error


def _run(joint: list[bool], ttft_ms: float = 100.0, classes: list[str] | None = None, tput: float = 10.0,
         tpot_ms: float = 50.0) -> dict:
    n = len(joint)
    ttft = [ttft_ms if j else 5000.0 for j in joint]
    return {"summary": {"output_throughput_tps": tput},
            "requests": {"success": [True] * n, "ttft_ms": ttft, "e2e_ms": [t + 9 * tpot_ms for t in ttft],
                         "output_len": [10] * n, "ttft_slo_ms": [1000.0] * n, "gaps_met": [9] * n,
                         "n_gaps": [9] * n, "slo_class": classes or [None] * n}}


def test_a_clear_gain_excludes_zero_and_equal_runs_do_not() -> None:
    rng = np.random.default_rng(0)
    a = [_run(list(rng.random(80) < 0.3)) for _ in range(3)]
    b = [_run(list(rng.random(80) < 0.8)) for _ in range(3)]
    d = compare_runs(a, b)["joint_attainment"]
    assert 35 < d.estimate < 65 and d.excludes_null and d.request_ci[0] > 0 and d.repeat_ci[0] > 0
    same = compare_runs(a, a)["joint_attainment"]
    assert same.estimate == 0 and same.request_ci == (0.0, 0.0) and not same.excludes_null
    assert same.repeat_ci is None  # repeats that agree exactly say nothing about the spread


def test_repeat_interval_keeps_run_to_run_noise() -> None:
    """Request-level CI alone would call a gain that flips sign between repeats real; the repeat
    interval does not."""
    a = [_run([True] * 40 + [False] * 40), _run([True] * 40 + [False] * 40), _run([True] * 40 + [False] * 40)]
    b = [_run([True] * 70 + [False] * 10), _run([True] * 70 + [False] * 10), _run([True] * 10 + [False] * 70)]
    d = compare_runs(a, b)["joint_attainment"]
    assert d.request_ci[0] > 0  # pooled over requests it looks like a gain
    assert d.repeat_ci[0] < 0 < d.repeat_ci[1] and not d.excludes_null


def test_unmatched_runs_are_refused() -> None:
    with pytest.raises(ValueError, match="not matched"):
        compare_runs([_run([True] * 5)], [_run([True] * 6)])


def test_per_class_and_throughput_ratio() -> None:
    cls = ["interactive", "batch"] * 20
    a = [_run([c == "batch" for c in cls], classes=cls, tput=10.0)] * 2
    b = [_run([True] * 40, classes=cls, tput=9.0)] * 2
    d = compare_runs(a, b)
    assert d["joint_attainment[interactive]"].estimate == pytest.approx(100.0)
    assert d["joint_attainment[batch]"].estimate == pytest.approx(0.0)
    assert d["output_throughput"].estimate == pytest.approx(0.9) and d["output_throughput"].null == 1.0
    assert ratio("x", [10.0], [9.0]).repeat_ci is None  # one repeat: no run-level interval
    p = pooled(b)
    assert p["runs"] == 2 and p["n"] == 80 and p["joint_attainment"] == 1.0 and p["joint_by_class"]["batch"] == 1.0


def test_median_ratios_of_matched_requests_and_the_parity_line() -> None:
    """Median TTFT and TPOT of B over A's, over the requests both completed: a uniformly 5% slower
    B reads 1.05 with an interval around it, and the parity line calls it a tax (over 2% worse)."""
    rng = np.random.default_rng(1)
    a, b = [], []
    for _ in range(3):
        ttft = rng.uniform(100, 900, 60)
        ra, rb = _run([True] * 60, tpot_ms=40.0), _run([True] * 60, tpot_ms=40.0 * 1.01)
        ra["requests"]["ttft_ms"], rb["requests"]["ttft_ms"] = list(ttft), list(1.05 * ttft)
        for r in (ra, rb):
            r["requests"]["e2e_ms"] = [t + 9 * (40.0 if r is ra else 40.4) for t in r["requests"]["ttft_ms"]]
        rb["requests"]["success"][0] = False  # a failure on one side drops that pair from both medians
        a.append(ra)
        b.append(rb)
    d = compare_runs(a, b)
    assert d["ttft_p50"].estimate == pytest.approx(1.05) and d["ttft_p50"].null == 1.0
    assert d["ttft_p50"].request_ci[0] <= 1.05 <= d["ttft_p50"].request_ci[1]
    assert d["tpot_p50"].estimate == pytest.approx(1.01)
    rows = [{"a": "sglang", "b": "superinfer", "rate": 0.5, "repeats": [0, 1, 2], "n_per_system": 180, "diffs": {k: v.to_dict() for k, v in d.items()}}]
    line = comparisons_markdown(rows)
    assert "median TTFT +5.0% (TAX)" in line and "median TPOT +1.0% (ok)" in line
    assert "throughput +0.0% (ok)" in line
    for r in b:  # B's first tokens 10% sooner than before (its later tokens as before): not a tax
        q = r["requests"]
        q["e2e_ms"] = [e - 0.1 * t for t, e in zip(q["ttft_ms"], q["e2e_ms"])]
        q["ttft_ms"] = [0.9 * t for t in q["ttft_ms"]]
    d = compare_runs(a, b)
    rows = [{**rows[0], "diffs": {k: v.to_dict() for k, v in d.items()}}]
    assert "median TTFT -5.5% (better)" in comparisons_markdown(rows)  # 1.05 x 0.9


@settings(max_examples=25, deadline=None)
@given(st.lists(st.booleans(), min_size=2, max_size=60), st.lists(st.booleans(), min_size=2, max_size=60))
def test_interval_contains_the_estimate(xa: list[bool], xb: list[bool]) -> None:
    n = min(len(xa), len(xb))
    d = indicator_diff("j", [np.array(xa[:n])], [np.array(xb[:n])])
    lo, hi = d.request_ci
    assert lo - 1e-9 <= d.estimate <= hi + 1e-9 and -100 <= lo <= hi <= 100


def test_reports_match_runs_by_repeat_and_partner() -> None:
    results: dict[str, list[dict]] = {"sglang": [], "sglang-priority": [], "superinfer": []}
    for k in range(2):  # the same gain in both repeats: no repeat interval, the request one decides
        for base in ("sglang", "sglang-priority"):
            results[base].append({**_run([True] * 10 + [False] * 40), "rate": 1.0, "repeat": k, "paired_with": "superinfer"})
            results["superinfer"].append({**_run([True] * 45 + [False] * 5), "rate": 1.0, "repeat": k, "paired_with": base})
    comps = comparisons(results, [("sglang", "superinfer"), ("sglang-priority", "superinfer")])
    assert [(c["a"], c["b"], c["repeats"], c["n_per_system"]) for c in comps] == [
        ("sglang", "superinfer", [0, 1], 100), ("sglang-priority", "superinfer", [0, 1], 100)]
    md = comparisons_markdown(comps)
    assert "Verdict (superinfer - sglang, joint attainment): every interval excludes zero: superinfer ahead at 1 req/s," in md
    assert "the verdict rests on requests alone" in md
    assert "| 1 | superinfer | 4 | 200 |" in pooled_markdown(results)


def test_paired_plan_and_repeats(tmp_path: Path, model_dir: Path) -> None:
    argv = ["--profile", "smoke", "--paired", "--repeats", "3", "--noise", "--out", str(tmp_path / "p")]
    plan, tok = build_plan(parser().parse_args(argv), argv)
    assert plan.paired and plan.repeats == 3 and plan.repeat == 0
    r2 = for_repeat(plan, 2, tok)
    assert r2.seed == plan.seed + 2 and r2.repeat == 2 and r2.out_dir == plan.out_dir / "repeat2"
    assert [pt.rate for pt in r2.points] == [pt.rate for pt in plan.points]
    assert r2.points[0].arrivals != plan.points[0].arrivals
    assert for_repeat(plan, 0, tok) is plan
    argv = ["--profile", "smoke", "--trace", "t.csv", "--out", str(tmp_path / "t")]
    assert parser().parse_args(argv).workload is None  # --trace alone means the trace workload


def test_report_is_rebuilt_from_ab_json_alone(tmp_path: Path) -> None:
    """`ab_bench.py --report DIR`: statistics, table and plot again from a finished run's ab.json."""
    import json

    from superinfer_sgl.bench.analysis import rereport

    results = {"sglang": [], "superinfer": []}
    for k in range(2):
        results["sglang"].append({**_run([True] * 10 + [False] * 30), "rate": 2.0, "repeat": k, "paired_with": "superinfer"})
        results["superinfer"].append({**_run([True] * 35 + [False] * 5), "rate": 2.0, "repeat": k, "paired_with": "sglang"})
    cfg = {"profile": "cpu", "workload": "sharegpt", "date_utc": "2026-11-24T00:00:00+00:00", "argv": ["ab"],
           "slo_default": {"ttft_ms": 1000, "tbt_ms": 100}, "kv_tokens": 1536, "chunked_prefill": 512,
           "num_requests": 40, "requests": [{"slo_class": None}] * 40, "order": "paired", "seed": 1, "repeats": 2,
           "pairs": [["sglang", "superinfer"]], "machine": {"cpu": "test"}}
    (tmp_path / "ab.json").write_text(json.dumps({"config": cfg, "results": results, "errors": {}}))
    doc = rereport(tmp_path)
    assert [c["rate"] for c in doc["comparisons"]] == [2.0]
    assert doc["comparisons"][0]["diffs"]["joint_attainment"]["estimate"] == pytest.approx(62.5)
    table = (tmp_path / "table.md").read_text()
    assert "| 2 | superinfer | 2 | 80 | 87.5% |" in table and "superinfer ahead at 2 req/s" in table
    assert (tmp_path / "attainment.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "ab.json").read_text())["comparisons"]  # written back
    assert "EOS" not in table
    # requests that could stop at EOS (--no-ignore-eos): the table says the bound and what was decoded
    eos = {**cfg, "ignore_eos": False, "max_new_tokens": 64, "requests": [{"slo_class": None, "output_tokens": 64}] * 40}
    (tmp_path / "ab.json").write_text(json.dumps({"config": eos, "results": results, "errors": {}}))
    rereport(tmp_path)
    assert ("Requests may stop at EOS (the server sees only the bound: 64 tokens); output lengths measured: sglang "
            "mean 10.0 tokens (median 10, 80 requests)") in (tmp_path / "table.md").read_text()
