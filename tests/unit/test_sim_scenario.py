"""A small paper-like scenario end to end (a few seconds), the command line, and --validate on a
synthetic A/B result in the harness's format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superinfer_sgl.sim.__main__ import main
from superinfer_sgl.sim.engine import SimConfig
from superinfer_sgl.sim.profile import resolve_profile
from superinfer_sgl.sim.runner import simulate
from superinfer_sgl.sim.validate import markdown, validate
from superinfer_sgl.sim.workload import sharegpt_like

POLICIES = ("sglang", "vllm-swap-waiting-first", "lvf-naive", "lvf-duplex", "oracle")


@pytest.fixture(scope="module")
def gh200_high_load() -> dict[str, dict]:
    wl = sharegpt_like(rate=20, duration=10, seed=0)
    prof = resolve_profile("gh200-qwen2.5-32b").with_server(kv_tokens=12000)  # contended quickly
    # The paper's rule (no rotation quantum): in 10 s a 5 s quantum would leave little to rotate.
    return {p: simulate(wl, prof, p, SimConfig(drain_s=300, min_stint_s=0.0)) for p in POLICIES}


def test_scenario_runs_every_request_to_completion(gh200_high_load: dict[str, dict]) -> None:
    for pol, s in gh200_high_load.items():
        # Over per-page copies rotation thrashes the link (the paper's ablation): it may not
        # drain within 300 s of simulated time; everything else must.
        if pol != "lvf-naive":
            assert s["finished"] == s["requests"] > 150, pol
        assert 0 <= s["ttft_attainment"] <= 1 and 0 <= s["tbt_attainment"] <= 1, pol


def test_scenario_directions(gh200_high_load: dict[str, dict]) -> None:
    r = gh200_high_load
    # Rotation is used, and over per-page copies it costs far more link time than over DuplexKV.
    assert r["lvf-duplex"]["rotations_out"] > 0
    assert r["lvf-naive"]["transfer_share"] > 3 * r["lvf-duplex"]["transfer_share"]
    assert r["lvf-naive"]["tbt_p99_s"] > 2 * r["lvf-duplex"]["tbt_p99_s"]
    assert r["lvf-naive"]["finished"] <= r["lvf-duplex"]["finished"]
    # LVF admits late waiting requests by displacing running ones: better TTFT than stock FCFS.
    assert r["lvf-duplex"]["ttft_attainment"] > r["sglang"]["ttft_attainment"]
    # Free preemption with known lengths does at least as well on joint attainment as stock.
    assert r["oracle"]["both_attainment"] >= r["sglang"]["both_attainment"]


def test_cli_run_prints_a_summary(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    assert main(["run", "--profile", "h100-pcie5-qwen2.5-32b", "--rate", "4", "--duration", "5",
                 "--policy", "sglang", "--policy", "lvf-duplex", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ttft_attainment" in text and "lvf-duplex" in text
    assert [r["policy"] for r in json.loads(out.read_text())] == ["sglang", "lvf-duplex"]


def _fake_ab(tmp: Path, prof_name: str = "gh200-qwen2.5-32b") -> Path:
    """An A/B result in scripts/ab_bench.py's format whose 'measurements' are the simulator's own."""
    wl = sharegpt_like(rate=4, duration=10, seed=5)
    reqs = [{"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "slo_class": None,
             "ttft_slo_ms": 5000.0, "tbt_slo_ms": 100.0} for r in wl.requests]
    (tmp / "schedules").mkdir(parents=True)
    (tmp / "schedules" / "00.json").write_text(json.dumps({"arrivals_s": [r.arrival for r in wl.requests]}))
    prof = resolve_profile(prof_name).with_server(kv_tokens=30000, chunked_prefill_tokens=4096)
    results = {}
    for system, policy in (("sglang", "sglang"), ("superinfer", "lvf-batched")):
        s = simulate(wl, prof, policy)
        results[system] = [{"rate": 4.0, "label": "4 req/s", "summary": {
            "ttft_attainment": s["ttft_attainment"], "joint_attainment": s["both_attainment"],
            "tbt_gap_attainment": s["tbt_gap_attainment"], "p50_ttft_ms": 1000 * s["ttft_p50_s"]}}]
    doc = {"config": {"kv_tokens": 30000, "chunked_prefill": 4096, "workload": "sharegpt",
                      "requests": reqs, "points": [{"label": "4 req/s", "rate": 4.0}]},
           "results": results}
    path = tmp / "ab.json"
    path.write_text(json.dumps(doc))
    return path


def test_validate_replays_the_ab_workload(tmp_path: Path) -> None:
    ab = _fake_ab(tmp_path / "ab_fake")
    report = validate(ab.parent, resolve_profile("gh200-qwen2.5-32b"))
    assert {r["system"] for r in report["rows"]} == {"sglang", "superinfer"}
    assert report["all_pass"], report["rows"]
    assert report["kv_tokens"] == 30000 and report["chunked_prefill"] == 4096


def test_validate_flags_disagreement(tmp_path: Path) -> None:
    ab = _fake_ab(tmp_path / "ab_fake")
    doc = json.loads(ab.read_text())
    doc["results"]["sglang"][0]["summary"]["p50_ttft_ms"] *= 3
    ab.write_text(json.dumps(doc))
    report = validate(ab, resolve_profile("gh200-qwen2.5-32b"))
    bad = [r for r in report["rows"] if not r["delta"]["pass"]]
    assert [r["system"] for r in bad] == ["sglang"] and not report["all_pass"]


def test_rescale_follows_each_points_own_speed_probe(tmp_path: Path) -> None:
    """A point measured while the machine ran 1.6x slower, with a probe that saw it: --rescale
    replays it at that speed and agrees; the profile as measured does not (P50 TTFT)."""
    from superinfer_sgl.sim.validate import scaled, speed_scales

    slower, n, out = 1.6, 200, 16
    base = resolve_profile("gh200-qwen2.5-32b").with_server(kv_tokens=30000, chunked_prefill_tokens=4096)
    slow = scaled(base, {"decode": slower, "prefill": slower})
    ab = _fake_ab(tmp_path / "ab_fake")
    doc = json.loads(ab.read_text())
    wl = sharegpt_like(rate=4, duration=10, seed=5)
    s = simulate(wl, slow, "sglang")
    ctx = n + out // 2
    probe = {"steps_ms": [[b, 1000.0 * slower * base.step.seconds(decode_reqs=b, decode_context=b * ctx)] for b in (1, 4)],
             "prefill_ms_per_token": 1000.0 * slower * base.step.prefill_alone(n) / n,
             "prompt_tokens": n, "out_tokens": out}
    assert speed_scales(base, {"speed": probe, "mean_prompt_tokens": n, "probe_out_tokens": out}) == \
        pytest.approx({"decode": slower, "prefill": slower})
    doc["results"] = {"sglang": [{"rate": 4.0, "label": "4 req/s", "speed_probe": probe, "summary": {
        "ttft_attainment": s["ttft_attainment"], "joint_attainment": s["both_attainment"],
        "tbt_gap_attainment": s["tbt_gap_attainment"], "p50_ttft_ms": 1000 * s["ttft_p50_s"]}}]}
    ab.write_text(json.dumps(doc))
    plain = validate(ab, resolve_profile("gh200-qwen2.5-32b"))
    per_point = validate(ab, resolve_profile("gh200-qwen2.5-32b"), rescale=True)
    assert not plain["all_pass"] and plain["rows"][0]["speed_source"] == "profile as measured"
    row = per_point["rows"][0]
    assert row["speed_source"] == "point probe" and row["speed_scales"] == pytest.approx({"decode": slower, "prefill": slower})
    assert per_point["all_pass"], row


def test_validate_maps_the_stock_twin_and_the_servers_flags(tmp_path: Path) -> None:
    """The harness's second stock server ("sglang#2", the noise band) replays as sglang and is
    reported under its own name; the superinfer server's flags (mixed chunk added by our launcher,
    the runtime's default rotation budget) reach the simulator."""
    ab = _fake_ab(tmp_path / "ab_fake")
    doc = json.loads(ab.read_text())
    doc["results"]["sglang#2"] = json.loads(json.dumps(doc["results"]["sglang"]))
    doc["config"]["server_commands"] = {
        "sglang": ["-m", "sglang.launch_server", "--max-total-tokens", "30000"],
        "sglang#2": ["-m", "sglang.launch_server", "--max-total-tokens", "30000"],
        "superinfer": ["-m", "superinfer_sgl.launch_server", "--scheduler", "rotasched"],
    }
    doc["noise_band"] = {"ttft_attainment": 54.0, "joint_attainment": 55.0, "p50_ttft_ms": 1.0}
    ab.write_text(json.dumps(doc))
    report = validate(ab, resolve_profile("gh200-qwen2.5-32b"))
    rows = {r["system"]: r for r in report["rows"]}
    assert set(rows) == {"sglang", "sglang#2", "superinfer"}
    assert rows["sglang#2"]["policy"] == "sglang"
    assert rows["sglang#2"]["simulated"] == rows["sglang"]["simulated"]
    assert not rows["sglang"]["mixed_chunk"] and rows["superinfer"]["mixed_chunk"]
    assert rows["superinfer"]["budget_blocks"] == 30000 // 16 // 8
    text = markdown(report)
    assert "| sglang#2 (sglang) |" in text and "noise band" in text and "mixed chunk" in text
    assert report["twin_agreement"][4.0]["pass"] and "twins agree" in text
