"""scripts/bench_kv_transfer.py must keep running (it is what the GPU machine executes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_runs_and_round_trips_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kv_transfer.py"), "--cpu-smoke",
                    "--out", str(out)], check=True, cwd=ROOT, timeout=300, capture_output=True)
    data = json.loads(out.read_text())
    assert data["meta"]["mode"] == "cpu-smoke"
    methods = {row["method"] for row in data["sweep"]}
    assert {"memcpy-ceiling", "naive", "hicache-like (torch re-creation)"} <= methods
    assert all(row["gbps_per_direction"] > 0 for row in data["sweep"] if "gbps_per_direction" in row)
    assert data["rotation"] and all(r["bit_exact"] for r in data["rotation"])
