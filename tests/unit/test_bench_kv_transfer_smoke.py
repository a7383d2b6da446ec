"""The KV transfer benchmark (python -m superinfer_sgl.bench.kv_transfer, scripts/bench_kv_transfer.py)
must keep running (it is what the GPU machine executes) and must measure the engine's own paths."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from superinfer_sgl.bench import transfer_rig
from superinfer_sgl.bench.kv_transfer import config_from_args, parse_args
from superinfer_sgl.duplexkv import transfer

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_smoke_runs_and_round_trips_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_kv_transfer.py"), "--cpu-smoke",
                    "--out", str(out)], check=True, cwd=tmp_path, timeout=300, capture_output=True)
    data = json.loads(out.read_text())
    assert data["meta"]["mode"] == "cpu-smoke"
    methods = {row["method"] for row in data["sweep"]}
    assert {"memcpy-ceiling", "naive", "hicache-like (torch re-creation)"} <= methods
    assert all(row["gbps_per_direction"] > 0 for row in data["sweep"] if "gbps_per_direction" in row)
    assert data["rotation"] and all(r["bit_exact"] for r in data["rotation"])
    # both directions in one engine.rotate call, timed by the engine's own copy timer
    assert all(r["duplex_ms"] > 0 and r["engine_copy_ms"]["out"] > 0 and r["engine_copy_ms"]["in"] > 0
               for r in data["rotation"])


def test_quick_module_run_keeps_to_its_sections(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    subprocess.run([sys.executable, "-m", "superinfer_sgl.bench.kv_transfer", "--cpu-smoke", "--quick",
                    "--sections", "rotation", "--out", str(out)], check=True, cwd=tmp_path, timeout=300,
                   capture_output=True)
    data = json.loads(out.read_text())
    assert data["meta"]["sections"] == ["rotation"] and "sweep" not in data and data["rotation"]


def test_the_benchmark_calls_the_engines_path_objects(monkeypatch: pytest.MonkeyPatch) -> None:
    """The naive method is the engine's _NaivePath, not a copy of it: a call through the rig lands there."""
    calls = []
    real = transfer._NaivePath.to_host

    def spy(self, slots, blocks):  # type: ignore[no-untyped-def]
        calls.append((slots.numel(), list(blocks)))
        real(self, slots, blocks)

    monkeypatch.setattr(transfer._NaivePath, "to_host", spy)
    cfg = config_from_args(parse_args(["--cpu-smoke"]))
    rig = transfer_rig.build_rig(cfg, cfg.block_sizes[0])
    streams = transfer_rig.Streams(cfg.device)
    transfer_rig.measure(cfg, streams, rig, "naive", ("out",), rig.block_tokens * 2)
    assert calls and calls[0] == (rig.block_tokens * 2, [0, 1])
    # and it moved the right bytes into the engine's host layout
    bt = rig.block_tokens
    k0 = rig.pool.k_buffers[0][:bt]
    assert torch.equal(rig.host.data[0, 0, 0].view(torch.uint8), k0.view(torch.uint8))
