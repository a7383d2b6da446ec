"""What scripts/gpu_ab.sh needs of the harness (issue 34): a superinfer-paper system, --ready-timeout,
explicit SLOs kept under --calibrate, rate multipliers, the same KV pool for every server, and the
script's own helpers (timeline, CUDA-graph fallback decision)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from superinfer_sgl.bench import gpu_ab, kv_pool
from superinfer_sgl.bench.calibrate import CalibrationKnobs, Speed, derive
from superinfer_sgl.bench.cli import parser
from superinfer_sgl.bench.paired import pairs_for
from superinfer_sgl.bench.planning import build_plan, recalibrated

REPO = Path(__file__).resolve().parents[2]
SPEED = Speed(prefill_ms_per_token=2.0, steps_ms=((1, 50.0), (4, 80.0)))
CLASSES = '{"standard": {"ttft_ms": 5000, "tbt_ms": 100}, "tight": {"ttft_ms": 1000, "tbt_ms": 50}}'


def _plan(tmp_path: Path, *extra: str):  # type: ignore[no-untyped-def]
    argv = ["--profile", "smoke", "--out", str(tmp_path), *extra]
    return build_plan(parser().parse_args(argv), argv)


def test_superinfer_paper_is_our_server_with_the_paper_policy_last(tmp_path: Path, model_dir: Path) -> None:
    plan, _ = _plan(tmp_path, "--systems", "sglang,superinfer,superinfer-paper")
    by = {s.name: s for s in plan.systems}
    assert by["superinfer-paper"].ours and by["superinfer-paper"].module == by["superinfer"].module
    flags = list(by["superinfer-paper"].flags)
    assert flags[-2:] == ["--policy", "paper"]  # after the spelled-out default: argparse keeps the last
    assert flags[:-2] == list(by["superinfer"].flags) and "goodput" in by["superinfer"].flags
    # paired mode: stock against each of ours, never one of ours as the other's baseline
    assert [(a.name, b.name) for a, b in pairs_for(plan.systems)] == [("sglang", "superinfer"),
                                                                      ("sglang", "superinfer-paper")]


def test_superinfer_retract_pairs_against_our_default_server(tmp_path: Path, model_dir: Path) -> None:
    """The recompute-tax A/B: ours with --decode-shortage retract (A) beside ours as shipped (B)."""
    plan, _ = _plan(tmp_path, "--systems", "superinfer-retract,superinfer")
    by = {s.name: s for s in plan.systems}
    assert list(by["superinfer-retract"].flags) == [*by["superinfer"].flags, "--decode-shortage", "retract"]
    assert [(a.name, b.name) for a, b in pairs_for(plan.systems)] == [("superinfer-retract", "superinfer")]


def test_superinfer_needed_pairs_against_our_default_server(tmp_path: Path, model_dir: Path) -> None:
    """The --mix-prefill A/B: ours as shipped (A) beside ours with --mix-prefill needed (B)."""
    plan, _ = _plan(tmp_path, "--systems", "superinfer,superinfer-needed")
    by = {s.name: s for s in plan.systems}
    assert list(by["superinfer-needed"].flags) == [*by["superinfer"].flags, "--mix-prefill", "needed"]
    assert [(a.name, b.name) for a, b in pairs_for(plan.systems)] == [("superinfer", "superinfer-needed")]


def test_ready_timeout_and_rate_multipliers_reach_the_profile(tmp_path: Path, model_dir: Path) -> None:
    plan, _ = _plan(tmp_path, "--ready-timeout", "200", "--rate-multipliers", "1,1.5", "--budget-min", "3")
    assert plan.profile.ready_timeout_s == 200.0
    assert plan.profile.knobs.rate_multipliers == (1.0, 1.5) and plan.profile.knobs.budget_s == 180.0
    default, _ = _plan(tmp_path / "d")
    assert default.profile.ready_timeout_s == 600.0 and default.profile.knobs.rate_multipliers == (0.6, 1.0, 1.4, 2.0)


def test_explicit_slos_survive_calibration_and_rates_follow_the_probe(tmp_path: Path, model_dir: Path) -> None:
    plan, tok = _plan(tmp_path, "--workload", "mixed", "--class-mix", "standard:3,tight:1", "--ttft-slo-ms", "5000",
                      "--tbt-slo-ms", "100", "--slo-classes", CLASSES, "--calibrate", "--rate-multipliers", "1,1.5")
    assert plan.calibrate
    cal = derive(SPEED, plan.profile.kv_tokens, 100, 12, plan.profile.knobs, 3, 10, 60, 5)
    assert (cal.ttft_slo_ms, cal.tbt_slo_ms) != (5000, 100)  # the probe would have chosen others
    new = recalibrated(plan, cal, tok)
    assert (new.profile.slo.ttft_ms, new.profile.slo.tbt_ms) == (5000, 100)
    assert json.loads(new.profile.slo_classes) == json.loads(CLASSES)
    assert [pt.rate for pt in new.points] == list(cal.rates) and len(cal.rates) == 2
    assert cal.rates[1] == pytest.approx(1.5 * cal.rates[0], rel=0.05)
    assert {r.slo_class for r in new.requests} <= {"standard", "tight"}
    assert all((r.slo.ttft_ms, r.slo.tbt_ms) in ((5000, 100), (1000, 50)) for r in new.requests)
    ours = next(s for s in new.systems if s.name == "superinfer")
    assert "5000" in ours.flags and new.profile.slo_classes in ours.flags


def test_calibration_without_explicit_slos_still_scales_them(tmp_path: Path, model_dir: Path) -> None:
    plan, tok = _plan(tmp_path, "--calibrate")
    cal = derive(SPEED, plan.profile.kv_tokens, 100, 12, CalibrationKnobs(min_requests=4), 2, 10, 60, 5)
    new = recalibrated(plan, cal, tok)
    assert (new.profile.slo.ttft_ms, new.profile.slo.tbt_ms) == (cal.ttft_slo_ms, cal.tbt_slo_ms)


# ---- the KV pool check ------------------------------------------------------------------------
def test_pool_size_is_read_from_server_info_or_the_log(tmp_path: Path) -> None:
    assert kv_pool.from_server_info({"max_total_tokens": 99, "internal_states": [{"max_total_num_tokens": 16000}]}) == 16000
    assert kv_pool.from_server_info({"max_total_num_tokens": 512}) == 512
    assert kv_pool.from_server_info({"max_total_tokens": 1024}) is None  # the request, not the pool
    log = "x\n[2026] max_total_num_tokens=1000, chunked_prefill_size=256\n...\nmax_total_num_tokens=960, y\n"
    assert kv_pool.from_log(log) == 960
    path = tmp_path / "server.log"
    path.write_text(log)
    assert kv_pool.pool_tokens("http://127.0.0.1:9", path) == (960, "server log")  # nothing listens on 9
    assert kv_pool.pool_tokens("http://127.0.0.1:9") == (None, "unknown")


def test_differing_pools_fail_loudly_and_equal_ones_pass() -> None:
    kv_pool.check_same({"sglang": 16384, "superinfer": 16384, "vllm": None}, 16384)
    with pytest.raises(kv_pool.KvPoolMismatch, match="sglang: 16384, superinfer: 15000.*requested 16384"):
        kv_pool.check_same({"sglang": 16384, "superinfer": 15000}, 16384)


def test_the_sweep_fails_a_server_whose_pool_differs(tmp_path: Path, model_dir: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from superinfer_sgl.bench import runner

    plan, _ = _plan(tmp_path, "--systems", "sglang,superinfer")
    doc = {"config": {}, "results": {"sglang": [], "superinfer": []}, "errors": {}, "processes_left": {}}
    sizes = iter([1024, 960])
    stopped = []
    server = SimpleNamespace(url="http://x", log_path=tmp_path / "log", port=1, pids=set(),
                             stop=lambda: stopped.append(1) or [])
    monkeypatch.setattr(runner, "launch", lambda *a, **k: server)
    monkeypatch.setattr(kv_pool, "pool_tokens", lambda url, log: (next(sizes), "/server_info"))
    sweep = runner.Sweep(plan, doc)
    try:
        assert sweep.start(plan.systems[0]) is server
        assert sweep.start(plan.systems[1]) is None  # 960 != 1024: refused
    finally:
        sweep.close()
    assert doc["kv_pool_tokens"] == {"sglang": 1024, "superinfer": 960}
    assert "KV pools differ" in doc["errors"]["kv_pool"] and "superinfer" in doc["errors"] and stopped


# ---- scripts/gpu_ab.sh's helpers ----------------------------------------------------------------
def test_timeline_from_stage_lines(tmp_path: Path) -> None:
    tsv = tmp_path / "t.tsv"
    tsv.write_text("setup\t0\t12\t0\t150\tbundle\nab\t12\t300\t124\t288\tCUDA graphs\ntransfer\t300\t330\t0\t80\tq\n")
    doc = gpu_ab.timeline(tsv, 420, "gpu")
    assert [s["stage"] for s in doc["stages"]] == ["setup", "ab", "transfer"]
    assert doc["stages"][1]["timed_out"] and doc["stages"][1]["seconds"] == 288.0
    assert doc["total_s"] == 330 and doc["within_limit"] and not doc["ok"]


def test_fallback_when_the_first_server_did_not_start(tmp_path: Path) -> None:
    """Not up in time, or exited (a crash in graph capture loses the A/B otherwise); not once a
    point has run."""
    slow = {"results": {"sglang": [], "superinfer": []},
            "errors": {"sglang": "sglang not ready after 200s:\n...", "sweep": "stopped: the first system (sglang) did not start"}}
    crashed = {"results": {"sglang": []}, "errors": {"sglang": "sglang exited with 1:\nTraceback",
                                                     "sweep": "stopped: the first system (sglang) did not start"}}
    ran = {"results": {"sglang": [{}]}, "errors": {}}
    assert gpu_ab.needs_fallback(slow) and gpu_ab.needs_fallback(crashed) and not gpu_ab.needs_fallback(ran)
    path = tmp_path / "ab.json"
    path.write_text(json.dumps(crashed))
    cmd = [sys.executable, "-m", "superinfer_sgl.bench.gpu_ab", "needs-fallback", str(path)]
    assert subprocess.run(cmd, cwd=tmp_path).returncode == 0
    path.write_text(json.dumps(ran))
    assert subprocess.run(cmd, cwd=tmp_path).returncode == 1


def test_the_script_parses_and_names_what_the_issue_asks() -> None:
    script = (REPO / "scripts" / "gpu_ab.sh").read_text()
    assert subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_ab.sh")]).returncode == 0
    for needle in ("LIMIT=${LIMIT:-480}", "--systems sglang,superinfer \\", "--kv-tokens 16384",
                   "--num-requests 150", "--cuda-graph-max-bs-decode 64 --cuda-graph-backend-prefill disabled",
                   "--calibrate", "--ready-timeout",
                   "needs-fallback", "superinfer_sgl.bench.kv_transfer", "gpu_stack.sh"):
        assert needle in script, needle
    assert "PYTHONDONTWRITEBYTECODE=1" not in (REPO / "scripts" / "gpu_stack.sh").read_text()


def test_the_load_generator_imports_without_hugging_face_datasets() -> None:
    """The GPU machine has no `datasets`; bench_serving imports it through its MMMU loader, and every
    point of every system failed there (ClientError) while the CPU smoke, which has it, passed."""
    code = ("import sys; sys.modules['datasets'] = None\n"  # as if not installed: importing it raises
            "from superinfer_sgl.bench.client import _without_datasets\n"
            "_without_datasets()\n"
            "from sglang.benchmark import serving\n"
            "import datasets\n"
            "try:\n    datasets.load_dataset('MMMU/MMMU')\nexcept RuntimeError as e:\n    print('says:', e)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "says: Hugging Face `datasets` is not installed" in proc.stdout


def test_dummy_models_speak_their_tokenizers_vocabulary(tmp_path: Path) -> None:
    """Llama 3's 128,256 ids over SmolLM2's 49,152-token tokenizer: ids past it decode to nothing and
    the load generator counts no token."""
    from superinfer_sgl.bench.profiles import DUMMY_SHAPES, make_dummy_model

    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "config.json").write_text(json.dumps({"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2}))
    for shape in ("llama3-8b", "mixtral-8x7b"):
        cfg = json.loads((make_dummy_model(shape, tok, tmp_path) / "config.json").read_text())
        assert cfg["vocab_size"] == 49152 and cfg["hidden_size"] == DUMMY_SHAPES[shape]["hidden_size"]
