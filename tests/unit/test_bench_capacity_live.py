"""`ab_bench.py --capacity`: the live search (sim/capacity.py's find_capacity over live points,
here over a scripted server), its statistics and its report, without starting a server."""

from __future__ import annotations

import argparse
import json
import threading
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from superinfer_sgl.bench import capacity_live as cl
from superinfer_sgl.bench import capacity_stats as cs
from superinfer_sgl.bench.cli import parser
from superinfer_sgl.sim.capacity import CapacityGrid


def _requests(n: int, met: int) -> dict:
    """n requests of which `met` meet both SLOs (TTFT 1 s, every gap met), the rest miss TTFT."""
    ttft = [100.0] * met + [5000.0] * (n - met)
    return {"success": [True] * n, "ttft_ms": ttft, "ttft_slo_ms": [1000.0] * n,
            "gaps_met": [9] * n, "n_gaps": [9] * n, "output_len": [10] * n, "e2e_ms": [t + 9 * 50.0 for t in ttft],
            "tbt_slo_ms": [100.0] * n}


def _point(rate: float, repeat: int, n: int, met: int) -> dict:
    return {"rate": rate, "repeat": repeat, "summary": {"joint_attainment": met / n}, "requests": _requests(n, met)}


class FakeSweep:
    def __init__(self, attainment):  # attainment(system, rate) -> share met
        self.attainment = attainment
        self.servers = {"sglang": SimpleNamespace(pin=lambda c: None), "superinfer": SimpleNamespace(pin=lambda c: None)}
        self.doc = {"results": {"sglang": [], "superinfer": []}}
        self.bar = SimpleNamespace(update=lambda *a: None)
        self.inners = [None, None]
        self.failed = []
        self.plan = SimpleNamespace(out_dir="the run's folder")

    def fail(self, spec, exc):
        self.failed.append(spec.name)


def test_searches_run_side_by_side_and_find_each_first_crossing(tmp_path, monkeypatch):
    n = 40
    sweep = FakeSweep(lambda s, r: 1.0 if r <= (1.0 if s == "sglang" else 1.6) else 0.5)
    calls = []

    def fake_run_point(plan, spec, server, i, pt, bar, sync, partner):
        if sync is not None:
            sync.wait()  # both sides start each step together until one side's search ends
        calls.append((spec.name, pt.rate, i))
        met = round(n * sweep.attainment(spec.name, pt.rate))
        return {**_point(pt.rate, plan.repeat, n, met), "label": pt.label}

    monkeypatch.setattr(cl, "run_point", fake_run_point)
    saved = []
    monkeypatch.setattr(cl, "save", lambda plan, doc: saved.append(plan.out_dir))
    (tmp_path / "schedules").mkdir()
    plan = SimpleNamespace(repeat=0, seed=1, requests=[None] * n, out_dir=tmp_path,
                           profile=SimpleNamespace(ready_timeout_s=30), options=parser().parse_args(["--capacity"]))
    grid = CapacityGrid(lo=0.5, hi=4.0, growth=1.4, resolution=0.05)
    pair = (SimpleNamespace(name="sglang"), SimpleNamespace(name="superinfer"))
    found = cl.run_searches(sweep, plan, grid, 0, [pair], (frozenset({0}), frozenset({1})))
    caps = {f["system"]: f for f in found}
    assert 0.95 * 1.0 <= caps["sglang"]["capacity_req_s"] <= 1.0
    assert 0.95 * 1.6 <= caps["superinfer"]["capacity_req_s"] <= 1.6
    assert caps["sglang"]["cores"] == [0] and caps["superinfer"]["cores"] == [1]
    # the sides used disjoint schedule files, and the same arrivals at the same rate
    idx = {s: {i for name, _, i in calls if name == s} for s in ("sglang", "superinfer")}
    assert not idx["sglang"] & idx["superinfer"]
    a = json.loads((tmp_path / "schedules" / f"{min(idx['sglang']):03d}.json").read_text())
    b = json.loads((tmp_path / "schedules" / f"{min(idx['superinfer']):03d}.json").read_text())
    assert a["rate"] == b["rate"] == 0.5 and a["arrivals_s"] == b["arrivals_s"]
    assert len(sweep.doc["results"]["superinfer"]) > len(sweep.doc["results"]["sglang"])  # went on alone
    assert saved and set(saved) == {"the run's folder"}  # every point saved to the run's ab.json


def test_summary_intervals_and_ratio():
    runs, results = [], {"sglang": [], "superinfer": []}
    for k, (ca, cb) in enumerate([(1.0, 1.5), (1.2, 1.5)]):
        for system, cap in (("sglang", ca), ("superinfer", cb)):
            runs.append({"system": system, "repeat": k, "capacity_req_s": cap, "censored": None,
                         "bracket": (cap, cap * 1.1)})
            results[system] += [_point(cap * f, k, 40, 40 if f <= 1 else 20) for f in (0.5, 1.0, 1.1)]
    s = cs.summarize(runs, [("sglang", "superinfer")], results)
    a, b = s["systems"]["sglang"], s["systems"]["superinfer"]
    assert a["per_repeat"] == [1.0, 1.2] and a["mean_req_s"] == pytest.approx(1.1)
    lo, hi = a["repeat_ci"]
    assert lo < 1.1 < hi
    assert b["repeat_ci"] is None  # two equal repeats say nothing about the spread
    pair = s["pairs"][0]
    assert pair["per_repeat"] == pytest.approx([1.5, 1.25]) and pair["ratio"] == pytest.approx(1.375)
    # every request of the points up to the capacity met its SLOs (40 of 40: rarely drawn under 90%)
    # and the point above met half (never drawn over 90%): the request-level interval is the capacity
    assert a["request_ci"] == pytest.approx((1.1, 1.1))
    assert pair["request_ci"] == pytest.approx((1.5 / 1.1, 1.5 / 1.1))
    # re-read from the measured rates: every gap of 50 ms, so both rules agree with the search
    assert s["rule"] == "gaps"
    rr = s["by_rule"]
    assert rr["systems"]["sglang"] == {"repeats": [0, 1], "gaps": [1.0, 1.2], "tpot": [1.0, 1.2]}
    assert rr["pairs"][0]["tpot"]["ratio"] == pytest.approx(1.375) == rr["pairs"][0]["gaps"]["ratio"]


def test_the_two_tbt_rules_disagree_where_they_should():
    """One long pause among fast gaps: 90% of gaps met, the mean over the SLO; gaps alternating just
    over and just under the SLO: the mean met, half the gaps missed."""
    from superinfer_sgl.bench import stats

    pause = [10.0] * 18 + [2000.0]  # 19 gaps, SLO 100 ms: 18 / 19 = 94.7% met, mean 114.7 ms
    wobble = [95.0, 105.0] * 10  # 20 gaps: 50% met, mean 100 ms
    req = {"success": [True, True], "ttft_ms": [100.0, 100.0], "ttft_slo_ms": [1000.0, 1000.0],
           "tbt_slo_ms": [100.0, 100.0], "output_len": [20, 21], "n_gaps": [19, 20],
           "gaps_met": [sum(g <= 100 for g in pause), sum(g <= 100 for g in wobble)],
           "e2e_ms": [100.0 + sum(pause), 100.0 + sum(wobble)]}
    assert stats.joint_met(req).tolist() == [True, False]
    assert stats.joint_met(req, "tpot").tolist() == [False, True]
    failed = dict(req, success=[False, False])
    assert not stats.joint_met(failed, "tpot").any()


def test_a_reread_capacity_is_the_highest_rate_below_the_first_miss():
    ok, half = np.ones(10, bool), np.array([True] * 5 + [False] * 5)
    assert cs.reread_capacity([(1.0, ok), (2.0, ok), (3.0, half), (4.0, ok)]) == 2.0  # 4.0 passes again: not counted
    assert cs.reread_capacity([(1.0, half), (2.0, ok)]) == 0.0
    assert cs.reread_capacity([(1.0, ok), (2.0, ok)]) == 2.0


def test_bootstrap_reads_the_first_crossing_of_resampled_points():
    rng = np.random.default_rng(0)
    measured = [(1.0, np.ones(40, bool)), (2.0, np.array([True] * 36 + [False] * 4)), (3.0, np.zeros(40, bool))]
    draws = cs._boot_capacity(measured, rng)
    assert set(np.unique(draws)) <= {0.0, 1.0, 2.0}  # 3.0 (0 of 40) never passes
    assert 0.3 < (draws == 2.0).mean() < 0.7  # 2.0 sits at exactly 90%: about half of the draws fail it
    assert (draws == 0.0).mean() < 0.02  # 40 of 40 at 1.0: seldom drawn under 90%, but it can be
    few = cs._boot_capacity([(1.0, np.ones(5, bool)), (2.0, np.zeros(5, bool))], rng)
    assert (few == 0.0).mean() > 0.2  # 5 of 5 says much less than 40 of 40
    assert cs._boot_capacity([(1.0, np.zeros(10, bool))], rng).max() == 0.0  # nothing passes: 0


def test_grid_comes_from_calibration_or_the_options():
    opts = argparse.Namespace(capacity_grid=None, capacity_growth=1.4, capacity_resolution=0.1)
    plan = SimpleNamespace(options=opts, profile=SimpleNamespace(rates=(0.5, 2.0)))
    g = cl.grid_for(plan, 2.0)
    assert (g.lo, g.hi, g.growth, g.resolution, g.target) == (1.0, 8.0, 1.4, 0.1, 0.9)
    assert (cl.grid_for(plan, None).lo, cl.grid_for(plan, None).hi) == (0.5, 4.0)
    opts.capacity_grid = (0.3, 3.0)
    assert (cl.grid_for(plan, 2.0).lo, cl.grid_for(plan, 2.0).hi) == (0.3, 3.0)


def test_a_search_under_the_tpot_rule_measures_each_point_by_it():
    """--capacity-slo-rule: the search's attainment of a point under either rule."""
    plan = SimpleNamespace(options=parser().parse_args(["--capacity"]))
    assert cl.slo_rule(plan) == "gaps"
    plan = SimpleNamespace(options=parser().parse_args(["--capacity", "--capacity-slo-rule", "tpot"]))
    assert cl.slo_rule(plan) == "tpot"
    point = _point(1.0, 0, 10, 8)
    slow = point["requests"]
    slow["e2e_ms"] = [t + 9 * (150.0 if i < 3 else 50.0) for i, t in enumerate(slow["ttft_ms"])]  # 3 means over 100 ms
    assert cl.attainment(point, "gaps") == 0.8  # the summary's own figure
    assert cl.attainment(point, "tpot") == pytest.approx(0.5)  # 8 TTFTs met, 3 of those over the mean


def test_cli_flags_and_report_render(tmp_path):
    a = parser().parse_args(["--capacity", "--paired", "--capacity-grid", "0.4,2"])
    assert a.capacity and a.capacity_grid == (0.4, 2.0) and a.capacity_resolution == 0.1
    assert a.capacity_slo_rule == "gaps"
    runs = [{"system": s, "repeat": 0, "capacity_req_s": c, "censored": None, "bracket": (c, c)}
            for s, c in (("sglang", 1.0), ("superinfer", 1.4))]
    results = {s: [{**_point(c, 0, 40, 40), "recompute": {"recomputed_tokens": 0.0, "prefill_tokens": 900.0}}]
               for s, c in (("sglang", 1.0), ("superinfer", 1.4))}
    doc = {"config": {"profile": "cpu", "workload": "sharegpt", "argv": ["x"], "pairs": [["sglang", "superinfer"]],
                      "capacity_grid": {"target": 0.9, "lo": 0.5, "hi": 4, "growth": 1.4, "resolution": 0.1},
                      "slo_default": {"ttft_ms": 1000, "tbt_ms": 100}, "num_requests": 40, "repeats": 1,
                      "machine": {"cpu": "AMD EPYC", "isa": ["avx2"], "cores": 2}},
           "results": results, "capacity_runs": runs, "errors": {}}
    doc["capacity"] = cs.summarize(runs, [("sglang", "superinfer")], results)
    text = cl.render_capacity(doc)
    assert "machine: cpu AMD EPYC, isa avx2, cores 2" in text  # which CPU: its speed moves several-fold
    assert "superinfer / sglang: 1.40x" in text and "| sglang | 1.000 |" in text and "0.00% (0 / 900)" in text
    assert "(TBT: 90% of a request's gaps within it)" in text and "mean TPOT: 1.40x" in text
    cl.plot_capacity(doc, tmp_path / "c.png")
    assert (tmp_path / "c.png").stat().st_size > 1000


def _run_dir(path: Path, caps: list[tuple[float, float]], grid_lo: float = 0.5, rule: str | None = None,
             probes: int | None = None, ignore_eos: bool | None = None, bound: int | None = None) -> Path:
    """A finished capacity run folder: one repeat per (stock, ours) capacity pair."""
    runs, results = [], {"sglang": [], "superinfer": []}
    for k, pair in enumerate(caps):
        for system, c in zip(("sglang", "superinfer"), pair):
            runs.append({"system": system, "repeat": k, "capacity_req_s": c, "censored": None, "bracket": (c, c * 1.1)})
            results[system] += [{**_point(c * f, k, 40, 40 if f <= 1 else 20),
                                 "recompute": {"recomputed_tokens": 0.0, "prefill_tokens": 900.0}} for f in (1.0, 1.1)]
    cfg = {"profile": "cpu", "workload": "sharegpt", "argv": [str(path)], "pairs": [["sglang", "superinfer"]],
           "mode": "capacity", "order": "paired", "class_mix": None,
           "capacity_grid": {"target": 0.9, "lo": grid_lo, "hi": 4, "growth": 1.4, "resolution": 0.1},
           "slo_default": {"ttft_ms": 1000, "tbt_ms": 100}, "num_requests": 40, "repeats": len(caps)}
    if rule is not None:  # (runs before --capacity-slo-rule do not say: gaps)
        cfg["slo_rule"] = rule
    if probes is not None:  # (runs before the grid's probes do not say: one per round)
        cfg["capacity_grid"]["probes"] = probes
    if ignore_eos is not None:  # (runs before --no-ignore-eos do not say: fixed-length)
        cfg |= {"ignore_eos": ignore_eos, "max_new_tokens": bound,
                "requests": [{"prompt_tokens": 50, "output_tokens": bound or 10}] * 40}
    path.mkdir()
    (path / "ab.json").write_text(json.dumps({"config": cfg, "results": results, "capacity_runs": runs, "errors": {}}))
    return path


def test_merge_pools_the_repeats_of_runs_that_measured_the_same_capacity(tmp_path, capsys):
    from superinfer_sgl.bench.cli import main

    a = _run_dir(tmp_path / "a", [(1.0, 1.5), (1.2, 1.5)])
    b = _run_dir(tmp_path / "b", [(1.0, 1.2)])
    stopped = json.loads((b / "ab.json").read_text())  # stopped during its second search
    stopped["results"]["sglang"].append(_point(9.0, 1, 40, 40))
    (b / "ab.json").write_text(json.dumps(stopped))
    assert main(["--report", str(tmp_path / "both"), "--merge", str(a), str(b)]) == 0
    doc = json.loads((tmp_path / "both" / "ab.json").read_text())
    assert sorted({r["repeat"] for r in doc["capacity_runs"]}) == [0, 1, 2]
    assert sorted({p["repeat"] for p in doc["results"]["sglang"]}) == [0, 1, 2]  # each search keeps its points
    assert all(p["rate"] != 9.0 for p in doc["results"]["sglang"])  # the unfinished search's point is not
    pair = doc["capacity"]["pairs"][0]
    assert pair["per_repeat"] == pytest.approx([1.5, 1.25, 1.2])
    assert doc["config"]["repeats"] == 3 and len(doc["config"]["merged_from"]) == 2
    assert "pooled:" in (tmp_path / "both" / "table.md").read_text()
    # a run on another grid measured another capacity: refused, with the reason
    c = _run_dir(tmp_path / "c", [(1.0, 1.2)], grid_lo=0.7)
    assert main(["--report", str(tmp_path / "bad"), "--merge", str(a), str(c)]) == 2
    assert "capacity_grid" in capsys.readouterr().err
    # searched under another TBT rule: another capacity too; a run that does not say searched on gaps
    assert main(["--report", str(tmp_path / "same"), "--merge", str(a), str(_run_dir(tmp_path / "g", [(1.0, 1.2)],
                                                                                       rule="gaps"))]) == 0
    assert main(["--report", str(tmp_path / "bad2"), "--merge", str(a), str(_run_dir(tmp_path / "t", [(1.0, 1.2)],
                                                                                       rule="tpot"))]) == 2
    assert "slo_rule" in capsys.readouterr().err
    assert main(["--merge", str(a)]) == 2
    # a run that records its probes per bisection round merges with one before they were recorded
    # (one per round then), not with one that probed two
    assert main(["--report", str(tmp_path / "p1"), "--merge", str(a), str(_run_dir(tmp_path / "p", [(1.0, 1.2)],
                                                                                     probes=1))]) == 0
    assert main(["--report", str(tmp_path / "bad3"), "--merge", str(a), str(_run_dir(tmp_path / "q", [(1.0, 1.2)],
                                                                                       probes=2))]) == 2
    assert "capacity_grid" in capsys.readouterr().err


def test_compact_ab_json_keeps_request_figures_to_a_tenth_of_a_millisecond() -> None:
    # a pooled capacity run is tracked: its per-request times are written at 0.1 ms, whole numbers
    # without ".0"; flags, counts, other floats, missing values and the summary's floats are left as they are
    point = {"rate": 1.0669, "requests": {"success": [True, False], "ttft_ms": [899.666, 2100.04],
                                          "ttft_slo_ms": [2100.0, 2100.0], "n_gaps": [22, 0], "share": [0.12345, 1.0],
                                          "e2e_ms": [float("nan"), 12.25], "slo_class": [None, "a"]}}
    doc_in = {"results": {"sglang": [point]}, "capacity": {"mean": 1.23456789}}
    doc = json.loads(cl._compact(doc_in))
    assert doc_in["results"]["sglang"][0]["requests"]["ttft_ms"] == [899.666, 2100.04]  # the caller's doc: as it was
    assert doc["results"]["sglang"][0]["requests"]["share"] == [0.12345, 1.0]
    (got,) = doc["results"]["sglang"]
    assert got["rate"] == 1.0669 and doc["capacity"]["mean"] == 1.23456789
    req = got["requests"]
    assert req["success"] == [True, False] and req["n_gaps"] == [22, 0] and req["slo_class"] == [None, "a"]
    assert req["ttft_ms"] == [899.7, 2100] and req["ttft_slo_ms"] == [2100, 2100]
    assert req["e2e_ms"][1] == 12.2 and req["e2e_ms"][0] != req["e2e_ms"][0]  # NaN stays NaN


def test_a_pooled_report_merges_again_listing_the_runs_it_pooled(tmp_path, capsys):
    # new repeats are added to a tracked pooled report by merging it with the new runs
    from superinfer_sgl.bench.cli import main

    a = _run_dir(tmp_path / "a", [(1.0, 1.5), (1.2, 1.5)])
    b = _run_dir(tmp_path / "b", [(1.0, 1.2)])
    c = _run_dir(tmp_path / "c", [(0.8, 1.2), (1.0, 1.1)])
    assert main(["--report", str(tmp_path / "ab"), "--merge", str(a), str(b)]) == 0
    assert main(["--report", str(tmp_path / "abc"), "--merge", str(tmp_path / "ab"), str(c)]) == 0
    doc = json.loads((tmp_path / "abc" / "ab.json").read_text())
    assert [m["dir"] for m in doc["config"]["merged_from"]] == [str(a), str(b), str(c)]
    assert doc["capacity"]["pairs"][0]["per_repeat"] == pytest.approx([1.5, 1.25, 1.2, 1.5, 1.1])
    assert doc["config"]["repeats"] == 5


def test_a_report_past_the_tracked_file_limit_is_written_gzipped_and_read_back(tmp_path, monkeypatch, capsys):
    from superinfer_sgl.bench import abfile
    from superinfer_sgl.bench.cli import main

    a = _run_dir(tmp_path / "a", [(1.0, 1.5), (1.2, 1.5)])
    b = _run_dir(tmp_path / "b", [(1.0, 1.2)])
    monkeypatch.setattr(abfile, "MAX_PLAIN_BYTES", 1000)  # these documents are a few kB
    out = tmp_path / "both"
    assert main(["--report", str(out), "--merge", str(a), str(b)]) == 0
    assert not (out / "ab.json").exists() and (out / "ab.json.gz").is_file()
    gz = (out / "ab.json.gz").read_bytes()
    assert abfile.load(out)["config"]["repeats"] == 3
    # --report redoes it from the gzipped file, byte for byte (a fixed gzip header time)
    assert main(["--report", str(out)]) == 0 and (out / "ab.json.gz").read_bytes() == gz
    # and a small document goes back to plain JSON, leaving no stale gzipped copy beside it
    monkeypatch.setattr(abfile, "MAX_PLAIN_BYTES", 2**20)
    assert main(["--report", str(out)]) == 0
    assert (out / "ab.json").is_file() and not (out / "ab.json.gz").exists()
    with pytest.raises(FileNotFoundError, match="no ab.json or ab.json.gz"):
        abfile.load(tmp_path / "nothing-here")


def test_validate_capacity_refuses_a_run_searched_under_the_tpot_rule(tmp_path):
    """The planner and the replay answer under the server's rule only: said, not compared wrongly."""
    from superinfer_sgl.sim import capacity_validate

    with pytest.raises(ValueError, match="'tpot' TBT rule"):
        capacity_validate.check(_run_dir(tmp_path / "t", [(1.0, 1.2)], rule="tpot"))


def test_requests_that_may_stop_at_eos_reach_the_load_generator_and_the_report(tmp_path, capsys):
    from superinfer_sgl.bench.cli import main
    from superinfer_sgl.bench.client import bench_args
    from superinfer_sgl.bench.planning import build_requests, resolve_profile

    args = bench_args("http://h", Path("d.jsonl"), 4, 1, Path("o.jsonl"), "tok")
    assert "--disable-ignore-eos" not in args  # fixed-length: bench_serving's default, ignore_eos
    assert "--disable-ignore-eos" in bench_args("http://h", Path("d.jsonl"), 4, 1, Path("o.jsonl"), "tok",
                                                 ignore_eos=False)
    # the bound: each request's drawn length, or --max-new-tokens for all; only for EOS requests
    a = parser().parse_args(["--no-ignore-eos", "--max-new-tokens", "128", "--num-requests", "20"])
    p = resolve_profile(a)
    a.workload = "sharegpt"
    reqs, notes = build_requests(a, p, None)
    assert {r.output_tokens for r in reqs} == {128} and "may stop at EOS" in notes[-1]
    b = parser().parse_args(["--no-ignore-eos", "--num-requests", "20"])
    b.workload = "sharegpt"
    fixed = parser().parse_args(["--num-requests", "20"])
    fixed.workload = "sharegpt"
    assert build_requests(b, p, None)[0] == build_requests(fixed, p, None)[0]  # the same draws, as bounds
    gpu = parser().parse_args(["--profile", "gpu", "--no-ignore-eos"])
    gpu.workload = "sharegpt"
    with pytest.raises(ValueError, match="random weights"):
        build_requests(gpu, resolve_profile(gpu), None)
    for bad in (["--max-new-tokens", "128"], ["--no-ignore-eos", "--max-new-tokens", "0"]):
        c = parser().parse_args(bad)
        c.workload = "sharegpt"
        with pytest.raises(ValueError, match="max-new-tokens"):
            build_requests(c, p, None)
    # the report says what lengths the model chose; runs with another bound do not pool
    eos = _run_dir(tmp_path / "eos", [(1.0, 1.2)], ignore_eos=False, bound=128)
    assert main(["--report", str(eos)]) == 0
    table = (eos / "table.md").read_text()
    assert "may stop at EOS (the server sees only the bound: 128 tokens)" in table
    assert "sglang mean 10.0 tokens" in table
    fixed_run = _run_dir(tmp_path / "fixed", [(1.0, 1.2)])
    assert "EOS" not in cl.render_capacity(json.loads((fixed_run / "ab.json").read_text()))
    assert main(["--report", str(tmp_path / "m"), "--merge", str(fixed_run), str(eos)]) == 2
    assert "ignore_eos" in capsys.readouterr().err
    other = _run_dir(tmp_path / "eos256", [(1.0, 1.2)], ignore_eos=False, bound=256)
    assert main(["--report", str(tmp_path / "m2"), "--merge", str(eos), str(other)]) == 2
    assert "max_new_tokens" in capsys.readouterr().err
