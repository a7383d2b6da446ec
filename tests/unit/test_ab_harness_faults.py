"""Faults a review of the A/B harness reproduced: each test fails on the code before its fix."""

from __future__ import annotations

import json
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from superinfer_sgl.bench.analysis import analyse, record_roles, rereport
from superinfer_sgl.bench.calibrate import ProbeError, probe
from superinfer_sgl.bench.cli import parser
from superinfer_sgl.bench.metrics import outcomes_from_details
from superinfer_sgl.bench.planning import check_trace_options


def _point(rate: float, att: float, k: int = 0, n: int = 20) -> dict:
    met = int(att * n)
    ttft = [100.0] * met + [5000.0] * (n - met)
    summary = {"ttft_attainment": att, "tbt_gap_attainment": 1.0, "tbt_request_attainment": 1.0,
               "joint_attainment": att, "goodput_rps": rate * att, "output_throughput_tps": 10.0,
               "completed": n, "n": n, **{key: 1.0 for key in ("p50_ttft_ms", "p99_ttft_ms", "p50_tbt_ms",
                                                                "p99_tbt_ms", "p50_e2e_ms", "p99_e2e_ms")}}
    return {"rate": rate, "repeat": k, "summary": summary, "counters": {},
            "requests": {"success": [True] * n, "ttft_ms": ttft, "e2e_ms": [t + 450 for t in ttft],
                         "output_len": [10] * n, "ttft_slo_ms": [1000.0] * n, "gaps_met": [9] * n,
                         "n_gaps": [9] * n, "slo_class": [None] * n}}


def _cfg(**extra: object) -> dict:
    return {"profile": "cpu", "workload": "sharegpt", "date_utc": "2026-12-03T00:00:00+00:00", "argv": ["ab"],
            "seed": 1, "slo_default": {"ttft_ms": 1000, "tbt_ms": 100}, "kv_tokens": 1536, "chunked_prefill": 512,
            "num_requests": 20, "requests": [{"slo_class": None}] * 20, "machine": {"cpu": "test"}, **extra}


def test_report_keeps_comparisons_of_unpaired_repeats_with_any_system_names(tmp_path: Path) -> None:
    """Unpaired repeats of stock beside `superinfer-paper`: the sweep's end compared them, and a
    re-report from ab.json lost the comparison (it guessed pairs from the names)."""
    results = {"sglang": [_point(2.0, 0.3, k) for k in range(2)],
               "superinfer-paper": [_point(2.0, 0.9, k) for k in range(2)]}
    cfg = _cfg(repeats=2, pairs=[], order="interleaved")
    record_roles(cfg, ["superinfer-paper"], [("sglang", "superinfer-paper")])
    (tmp_path / "ab.json").write_text(json.dumps({"config": cfg, "results": results, "errors": {}}))
    doc = rereport(tmp_path)
    assert [(c["a"], c["b"]) for c in doc["comparisons"]] == [("sglang", "superinfer-paper")]
    assert doc["comparisons"][0]["diffs"]["joint_attainment"]["estimate"] == pytest.approx(60.0)


def test_report_of_one_run_redoes_targets_and_plot(tmp_path: Path) -> None:
    results = {"sglang": [_point(1.0, 1.0), _point(2.0, 0.3)], "superinfer": [_point(1.0, 1.0), _point(2.0, 0.95)]}
    stale = {"stale": True}
    cfg = _cfg(repeats=1, pairs=[])
    (tmp_path / "ab.json").write_text(json.dumps({"config": cfg, "results": results, "errors": {},
                                                  "targets": stale, "targets_by_system": {"superinfer": stale}}))
    doc = rereport(tmp_path)
    assert "stale" not in doc["targets"] and doc["targets"]["ours"] == "superinfer"
    assert doc["targets"]["overloaded"]["joint_gain_points"] == pytest.approx(65.0)
    assert (tmp_path / "attainment.png").stat().st_size > 10_000


def test_analyse_compares_what_the_config_names(tmp_path: Path) -> None:
    results = {"superinfer": [_point(2.0, 0.5, k) for k in range(2)],
               "superinfer-reserve15": [_point(2.0, 0.7, k) for k in range(2)]}
    doc = {"config": _cfg(repeats=2, pairs=[]), "results": results, "errors": {}}
    record_roles(doc["config"], ["superinfer", "superinfer-reserve15"], [("superinfer", "superinfer-reserve15")])
    analyse(doc, tmp_path)
    assert doc["comparisons"] and doc["comparisons"][0]["b"] == "superinfer-reserve15"


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_probe_of_a_server_that_stopped_answering_says_so() -> None:
    """The probe's threads swallowed the connection error and the probe died on median([])."""
    seen: list[BaseException] = []
    hook, threading.excepthook = threading.excepthook, lambda a: seen.append(a.exc_value)
    try:
        with pytest.raises(ProbeError, match="streamed no token; ConnectionError"):
            probe(f"http://127.0.0.1:{_closed_port()}", ["a"] * 9, 8, batches=(1, 4), repeats=1)
    finally:
        threading.excepthook = hook
    assert not seen  # handed back, not raised in the threads


def test_point_probe_failure_fails_the_system_not_the_sweep(tmp_path: Path, monkeypatch) -> None:
    from superinfer_sgl.bench import runner
    from superinfer_sgl.bench.planning import SweepPoint
    from superinfer_sgl.bench.servers import systems

    class Tok:
        def apply_chat_template(self, msgs, tokenize=False, **_):  # type: ignore[no-untyped-def]
            return msgs[0]["content"]

        def encode(self, text, **_):  # type: ignore[no-untyped-def]
            return text.split()

        def decode(self, ids, **_):  # type: ignore[no-untyped-def]
            return " ".join(ids)

    monkeypatch.setattr(runner, "_tokenizer", lambda path: Tok())
    monkeypatch.setattr(runner, "mean_lengths", lambda p, seed: (8.0, 4.0))
    monkeypatch.setattr(runner, "PromptBuilder", lambda tok: SimpleNamespace(build=lambda i, n: (f"p{i} x", n)))
    stock = systems(())["sglang"]
    port = _closed_port()
    server = SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, pin=lambda c: None, stop=lambda: [],
                             alive=lambda: True, pids=set())
    pt = SweepPoint(1.0, (0.0, 1.0), "1 req/s")
    plan = SimpleNamespace(options=SimpleNamespace(point_probes=True), systems=[stock], tokenizer="t", seed=1,
                           profile=SimpleNamespace(ready_timeout_s=5, run_timeout_s=10), points=[pt],
                           out_dir=tmp_path, repeats=1, paired=False, repeat=0, requests=[], ignore_eos=True)
    doc = {"results": {"sglang": []}, "errors": {}, "processes_left": {}}
    sweep = runner.Sweep(plan, doc)
    sweep.servers = {"sglang": server}
    hook, threading.excepthook = threading.excepthook, lambda a: None
    try:
        sweep.run(plan, stock, 0, pt)  # raised StatisticsError before
    finally:
        threading.excepthook = hook
        sweep.bar.close()
    assert "sglang" in sweep.failed and "speed probe" in doc["errors"]["sglang"]


@pytest.mark.parametrize("argv, flags", [
    (["--workload", "mixed", "--trace", "t.csv"], "--trace"),
    (["--workload", "sharegpt", "--trace", "t.csv", "--trace-start", "5"], "--trace, --trace-start"),
    (["--mixed"], "--mixed"),
    (["--workload", "mixed", "--trace-length-scale", "2"], "--trace-length-scale"),
    (["--trace-arrivals", "recorded", "--time-scales", "1,2"], "--trace-arrivals, --time-scales"),
])
def test_trace_options_without_the_trace_workload_are_refused(argv: list[str], flags: str) -> None:
    a = parser().parse_args(argv)
    a.workload = a.workload or ("trace" if a.trace else "sharegpt")
    with pytest.raises(ValueError, match=f"^{flags}: for --workload trace only"):
        check_trace_options(a)


def test_trace_options_with_the_trace_workload_pass() -> None:
    a = parser().parse_args(["--trace", "t.csv", "--mixed", "--trace-start", "3", "--trace-arrivals", "recorded"])
    a.workload = "trace"
    check_trace_options(a)


def test_a_success_that_streamed_nothing_is_a_miss() -> None:
    """bench_serving reports an aborted stream (or an immediate EOS) as a success with ttft 0 and no
    gaps; it counted as TTFT met and every gap met."""
    details = {"ttfts": [0.0, 0.2], "itls": [[], [0.05] * 3], "errors": ["", ""], "output_lens": [4, 4]}
    empty, real = outcomes_from_details(details, [(1000.0, 100.0, None)] * 2, [4, 4])
    assert not empty.success and not empty.ttft_met and not empty.joint_met and empty.tbt_share == 0.0
    assert real.success and real.joint_met
