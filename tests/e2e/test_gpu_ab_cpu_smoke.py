"""`bash scripts/gpu_ab.sh --cpu-smoke`: the GPU A/B script's stages on this CPU (issue 34, item 3).

The script's logic is proven here before a GPU minute is spent: setup, the calibrated A/B with
explicit SLO classes kept, servers in turn with their KV pools compared, the engine's copy paths
benchmarked with the time left, and a timeline of stage times, all inside LIMIT and as at most 8
files in $OUT. It runs the GPU call's two systems, stock and ours (its flags are checked in
tests/unit/test_bench_gpu_ab.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The GPU call's own LIMIT (480 s). The run takes ~2.5-7 min on a 2-core VM (two CPU server starts
# dominate; 408 s on a loaded one), so a tighter limit tests the machine's load rather than the
# script; GPU_AB_SMOKE_LIMIT overrides it.
LIMIT = int(os.environ.get("GPU_AB_SMOKE_LIMIT", "480"))
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(LIMIT + 300)]
SYSTEMS = ["sglang", "superinfer"]  # the GPU call's


@pytest.fixture(scope="module")
def run(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("gpu_ab_smoke")
    env = {**os.environ, "OUT": str(out), "LIMIT": str(LIMIT)}
    proc = subprocess.run(["bash", "scripts/gpu_ab.sh", "--cpu-smoke"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=LIMIT + 120)
    return out, proc


def test_the_same_files_come_back_at_most_8(run: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, proc = run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    timeline = (out / "summary.txt").read_text().split("\n\n")[0]
    assert "rc=124" not in timeline, f"a stage ran out of its time (LIMIT {LIMIT} s):\n{timeline}"
    files = sorted(p.name for p in out.iterdir())
    assert len(files) <= 8 and all(p.is_file() for p in out.iterdir()), files
    assert {"timeline.json", "device.txt", "ab.json", "table.md", "kv_transfer.json", "summary.txt",
            "logs.tgz"} <= set(files), files
    with tarfile.open(out / "logs.tgz") as tar:
        names = tar.getnames()
    assert any(n.endswith("sglang.server.log") for n in names) and not any("/raw/" in n for n in names)


def test_the_timeline_covers_every_stage_inside_the_limit(run: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, _ = run
    tl = json.loads((out / "timeline.json").read_text())
    assert tl["mode"] == "cpu-smoke" and tl["limit_s"] == LIMIT
    stages = {s["stage"]: s for s in tl["stages"]}
    assert list(stages) == ["setup", "ab", "transfer"], tl  # no CUDA graphs on a CPU: no fallback stage
    assert all(s["rc"] == 0 for s in stages.values()), tl
    assert stages["setup"]["end_s"] <= stages["ab"]["start_s"] <= stages["ab"]["end_s"] <= stages["transfer"]["start_s"]
    assert all(s["seconds"] <= s["limit_s"] + 1 for s in stages.values())
    assert tl["total_s"] <= LIMIT and tl["within_limit"] and tl["ok"]


def test_the_ab_ran_calibrated_with_the_slos_as_given(run: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, _ = run
    doc = json.loads((out / "ab.json").read_text())
    assert not doc["errors"], doc["errors"]
    assert list(doc["results"]) == SYSTEMS and doc["config"]["order"] == "sequential"
    cal = doc["calibration"]
    assert cal["kept_as_given"] == ["slos"] and len(cal["rates"]) == 2
    assert cal["rates"][1] == pytest.approx(1.5 * cal["rates"][0], rel=0.1)
    assert doc["config"]["slo_classes"] == {"standard": {"ttft_ms": 4000, "tbt_ms": 500},
                                           "tight": {"ttft_ms": 2000, "tbt_ms": 250}}
    assert [p["rate"] for p in doc["config"]["points"]] == cal["rates"]
    for system, points in doc["results"].items():
        assert len(points) == 2 and all(p["summary"]["completed"] == p["summary"]["n"] for p in points), system
    # every server's KV pool was read and found equal (1024 tokens: the smoke profile's budget)
    assert doc["kv_pool_tokens"] == {s: 1024 for s in SYSTEMS}
    ours = doc["config"]["server_commands"]["superinfer"]
    assert ours[ours.index("--policy") + 1] == "goodput"
    table = (out / "table.md").read_text()
    assert "KV pool per server" in table and "| superinfer |" in table and "copy s out / in" in table


def test_the_engines_copy_paths_were_benchmarked(run: tuple[Path, subprocess.CompletedProcess]) -> None:
    out, _ = run
    kv = json.loads((out / "kv_transfer.json").read_text())
    assert kv["meta"]["mode"] == "cpu-smoke" and kv["meta"]["sections"] == ["rotation", "sweep"]
    rotation = [r for r in kv.get("rotation", []) if "error" not in r]
    assert rotation and all(r["bit_exact"] for r in rotation)
    assert "sweep" in kv or "sweep" in kv["skipped"]
