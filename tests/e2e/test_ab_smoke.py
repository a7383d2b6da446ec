"""The A/B harness end to end, CI-sized: `python scripts/ab_bench.py --profile smoke`.

Stock SGLang and our server in turn, two Poisson rates, a few short requests each, through
sglang.benchmark.serving. Checks that the run is real: every request of both systems completed
with the requested number of tokens, the JSON carries every field, attainment figures lie in
[0, 1] and follow from the per-request data, and no server process is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from superinfer_sgl.rotasched.clock import TBT_MET_SHARE

# ~4 min on a quiet 2-core VM (two server starts dominate); much longer when the VM is shared
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(2700),
]

REPO = Path(__file__).resolve().parents[2]
SUMMARY_KEYS = {"n", "completed", "duration_s", "ttft_attainment", "tbt_gap_attainment", "tbt_request_attainment",
                "joint_attainment", "goodput_rps", "request_throughput_rps", "output_throughput_tps",
                "p50_ttft_ms", "p99_ttft_ms", "p50_tbt_ms", "p99_tbt_ms", "p50_e2e_ms", "p99_e2e_ms", "by_class"}
ATTAINMENT = ("ttft_attainment", "tbt_gap_attainment", "tbt_request_attainment", "joint_attainment")


@pytest.fixture(scope="module")
def smoke(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    # AB_SMOKE_OUT keeps the run's output (e.g. results/ab_smoke_sharegpt; default: a temp folder);
    # with AB_SMOKE_REUSE=1 the checks run on an existing ab.json there instead of a new run
    out = Path(os.environ["AB_SMOKE_OUT"]).resolve() if os.environ.get("AB_SMOKE_OUT") else \
        tmp_path_factory.mktemp("ab_smoke")
    if os.environ.get("AB_SMOKE_REUSE") == "1" and (out / "ab.json").is_file():  # check a finished run
        return json.loads((out / "ab.json").read_text()), out
    return run_harness(out)


def run_harness(out: Path, *extra: str) -> tuple[dict, Path]:
    """`scripts/ab_bench.py --profile smoke [extra]` into `out`; its ab.json once it exits 0."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "ab_bench.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "ab_bench.py"), "--profile", "smoke",
                                 *extra, "--out", str(out)], stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            rc = proc.wait(timeout=2400)
        finally:
            if proc.poll() is None:  # a timeout: let the harness stop its servers (SIGINT), then go
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
    assert rc == 0, log.read_text()[-4000:]
    return json.loads((out / "ab.json").read_text()), out


def test_both_systems_completed_every_request(smoke: tuple[dict, Path]) -> None:
    doc, _ = smoke
    cfg = doc["config"]
    expected = [r["output_tokens"] for r in cfg["requests"]]
    assert set(doc["results"]) == {"sglang", "superinfer"} and not doc["errors"]
    for system, points in doc["results"].items():
        assert [p["rate"] for p in points] == [pt["rate"] for pt in cfg["points"]], system
        for p in points:
            reqs = p["requests"]
            assert p["summary"]["completed"] == p["summary"]["n"] == len(expected), (system, p["rate"])
            assert all(reqs["success"]) and not any(reqs["errors"])
            assert reqs["output_len"] == expected, (system, p["rate"])  # ignore_eos: the same work


def test_json_fields_and_ranges(smoke: tuple[dict, Path]) -> None:
    doc, out = smoke
    cfg = doc["config"]
    for key in ("profile", "argv", "date_utc", "machine", "model", "shared_server_flags", "server_commands",
                "bench_serving_args", "slo_default", "requests", "points"):
        assert key in cfg, key
    assert cfg["server_commands"]["sglang"][:2] == ["-m", "sglang.launch_server"]
    assert cfg["server_commands"]["superinfer"][:2] == ["-m", "superinfer_sgl.launch_server"]
    for system, points in doc["results"].items():
        for p in points:
            s = p["summary"]
            assert SUMMARY_KEYS <= set(s), SUMMARY_KEYS - set(s)
            for key in ATTAINMENT:
                assert 0.0 <= s[key] <= 1.0, (system, key, s[key])
            assert s["p50_ttft_ms"] <= s["p99_ttft_ms"] and s["output_throughput_tps"] > 0
            assert {"rotations", "resumes", "recompute_fallbacks", "retractions"} <= set(p["counters"])
            assert p["counters"]["retractions"] is not None  # SGLang's own counter, both systems
            probe = p["speed_probe"]  # the server's speed right before the point (the replay's input)
            assert probe["prompt_tokens"] > 0 and probe["prefill_ms_per_token"] > 0, probe
            assert [b for b, _ in probe["steps_ms"]] == [1, 4] and all(ms > 0 for _, ms in probe["steps_ms"])
        if system == "superinfer":
            assert all(p["counters"]["rotations"] is not None for p in points)  # superinfer_ series exported
    assert "targets" in doc and {"rate", "capacity", "capacity_ratio"} <= set(doc["targets"])
    assert (out / "table.md").read_text().count("| superinfer |") == len(cfg["points"])
    assert (out / "attainment.png").stat().st_size > 10_000


def test_step_logs_cover_every_point(smoke: tuple[dict, Path]) -> None:
    """Every server logged its iterations (patches/step_log.py) and each point's window holds its
    work: the decode rows in the window account for the points' output tokens (each request's
    first token comes from its prefill, the rest from decode rows; bench_serving's warm-up request
    runs inside the window too)."""
    from superinfer_sgl.sim.steplog import in_window, read_steps

    doc, out = smoke
    expected = sum(r["output_tokens"] - 1 for r in doc["config"]["requests"])
    warmup = max(r["output_tokens"] for r in doc["config"]["requests"])  # bench_serving's one warm-up request
    for system, points in doc["results"].items():
        steps = read_steps(out / "logs" / f"{system}.steps.jsonl")
        for p in points:
            window = in_window(steps, p["window_unix"])
            rows = sum(s.decode_rows for s in window)
            assert sum(s.prefill_tokens for s in window) > 0, (system, p["rate"])
            assert expected <= rows <= expected + warmup, (system, p["rate"], rows, expected)
            assert all(s.dur_s > 0 for s in window) and any(s.period_s for s in window)


def test_attainment_follows_from_per_request_data(smoke: tuple[dict, Path]) -> None:
    doc, _ = smoke
    for points in doc["results"].values():
        for p in points:
            r, s = p["requests"], p["summary"]
            n = len(r["ttft_ms"])
            ttft_met = [ok and t <= slo for ok, t, slo in zip(r["success"], r["ttft_ms"], r["ttft_slo_ms"])]
            share = [m / g if g else 1.0 for m, g in zip(r["gaps_met"], r["n_gaps"])]
            assert s["ttft_attainment"] == pytest.approx(sum(ttft_met) / n)
            assert s["tbt_gap_attainment"] == pytest.approx(sum(r["gaps_met"]) / sum(r["n_gaps"]))
            assert s["tbt_request_attainment"] == pytest.approx(
                sum(m == g for m, g in zip(r["gaps_met"], r["n_gaps"])) / n)
            assert s["joint_attainment"] == pytest.approx(
                sum(t and sh >= TBT_MET_SHARE for t, sh in zip(ttft_met, share)) / n)
            assert s["goodput_rps"] == pytest.approx(s["joint_attainment"] * n / s["duration_s"])
            assert all(g == o - 1 for g, o in zip(r["n_gaps"], r["output_len"]))


def test_no_process_left(smoke: tuple[dict, Path]) -> None:
    doc, out = smoke
    assert all(not left for left in doc["processes_left"].values()), doc["processes_left"]
    assert set(doc["processes_left"]) == {"sglang", "superinfer"}
    pids = {pid for s in doc["servers"].values() for pid in s["pids"]}
    ports = {f"--port {s['port']}" for s in doc["servers"].values()}
    assert len(pids) >= 6  # launcher, scheduler, detokenizer of each server were tracked
    mine = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        cmd = " ".join(p.info["cmdline"] or [])
        # the load generator had the output folder in its argv, the servers their port
        if p.pid in pids or str(out) in cmd or any(port in cmd for port in ports):
            mine.append((p.pid, cmd[:120]))
    assert not mine, mine


# ---- paired mode: both systems at once, one core each, two repeats -----------------------------
@pytest.fixture(scope="module")
def paired(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("paired mode needs 2 cores (one per server); this machine gives fewer")
    return run_harness(tmp_path_factory.mktemp("ab_paired"), "--paired", "--repeats", "2")


def test_paired_runs_side_by_side_on_separate_cores(paired: tuple[dict, Path]) -> None:
    doc, out = paired
    assert doc["config"]["order"] == "paired" and doc["config"]["pairs"] == [["sglang", "superinfer"]]
    a, b = doc["results"]["sglang"], doc["results"]["superinfer"]
    assert len(a) == len(b) == 2 * len(doc["config"]["points"]) and not doc["errors"]
    for pa, pb in zip(a, b):
        assert (pa["repeat"], pa["rate"], pa["paired_with"]) == (pb["repeat"], pb["rate"], "superinfer")
        assert pb["paired_with"] == "sglang" and set(pa["cores"]).isdisjoint(pb["cores"])
        assert all(pa["requests"]["success"]) and all(pb["requests"]["success"])
        assert pa["requests"]["output_len"] == pb["requests"]["output_len"]  # the same requests
        # run side by side: both load generators were released by one barrier and their runs overlap
        (a0, a1), (b0, b1) = pa["window_unix"], pb["window_unix"]
        assert abs(a0 - b0) < 2.0 and min(a1, b1) - max(a0, b0) > 0.5 * min(a1 - a0, b1 - b0)
    # repeat 1 drew new requests and arrivals from seed + 1, under the same rates
    assert [p["seed"] for p in a] == [1, 1, 2, 2]
    assert (out / "repeat1" / "dataset.jsonl").read_text() != (out / "dataset.jsonl").read_text()
    # the sides swapped cores from point to point
    assert a[0]["cores"] != a[1]["cores"]


def test_paired_report_has_intervals_and_a_verdict(paired: tuple[dict, Path]) -> None:
    doc, out = paired
    comps = doc["comparisons"]
    assert [(c["a"], c["b"], c["repeats"]) for c in comps] == [("sglang", "superinfer", [0, 1])] * len(comps)
    for c in comps:
        j = c["diffs"]["joint_attainment"]
        assert j["request_ci"][0] <= j["request_ci"][1] and len(j["per_repeat"]) == 2
        assert j["estimate"] == pytest.approx(sum(j["per_repeat"]) / 2)  # equal n per repeat
    table = (out / "table.md").read_text()
    assert "Verdict (superinfer - sglang" in table and "request CI" in table


def test_paired_no_process_left_and_step_logs(paired: tuple[dict, Path]) -> None:
    doc, out = paired
    assert set(doc["processes_left"]) == {"sglang", "superinfer"}
    assert all(not left for left in doc["processes_left"].values()), doc["processes_left"]
    alive = [p for p in (doc["servers"][s]["pids"] for s in doc["servers"]) for p in p if psutil.pid_exists(p)
             and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, alive
    for system in ("sglang", "superinfer"):
        assert (out / "logs" / f"{system}.steps.jsonl").stat().st_size > 0  # each server's own log
