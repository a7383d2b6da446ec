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


def test_the_ring_is_a_path_option_of_the_engines_own_triton_dma(monkeypatch: pytest.MonkeyPatch) -> None:
    """--ring-slots / --ring-slot-mb reach the engine's _TritonRingPath through make_path (building a
    path launches nothing, so no Triton is needed); its serial form and the hybrid are methods too."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = config_from_args(parse_args(["--cpu-smoke", "--ring-slots", "2", "--ring-slot-mb", "0.001"]))
    assert {"triton-dma", "triton-dma-serial", "triton-hybrid", "triton-direct"} <= set(cfg.methods)
    assert cfg.ring == {"ring_slots": 2, "ring_slot_bytes": 1048}
    rig = transfer_rig.build_rig(cfg, cfg.block_sizes[0])
    path = rig.path("triton-dma")
    assert isinstance(path, transfer._TritonRingPath) and path.rings["out"].slots == 2
    assert path.rings["in"].slot_blocks == max(1, 1048 // rig.host.bytes_per_block)
    assert isinstance(rig.path("triton-dma-serial"), transfer._TritonDmaSerialPath)
    assert set(rig.path("triton-hybrid").rings) == {"in"}
    rig.ring = {"ring_slots": 3}
    assert rig.path("triton-dma") is not path and rig.path("triton-dma").rings["out"].slots == 3


def test_quick_gpu_run_measures_the_ring_its_serial_form_and_the_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    """What scripts/gpu_ab.sh's transfer stage runs (--quick --gib 0.25) on a GPU, without one."""
    from superinfer_sgl.bench.kv_transfer import QUICK_SECTIONS, sections

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = parse_args(["--quick", "--gib", "0.25"])
    cfg = config_from_args(args)
    assert sections(args) == list(QUICK_SECTIONS) == ["rotation", "sweep"]
    assert {"memcpy-ceiling", "triton-dma", "triton-dma-serial", "triton-hybrid"} <= set(cfg.methods)
    assert cfg.block_sizes == [4 * 2**20] and cfg.max_copy_ops == 4096 and cfg.ring == {}
    # the GPU check of the ring alone (docs/duplexkv.md): the per-page methods left out
    only = config_from_args(parse_args(["--quick", "--methods", "memcpy-ceiling,triton-dma,triton-dma-serial"]))
    assert only.methods == ["memcpy-ceiling", "triton-dma", "triton-dma-serial"]
    with pytest.raises(SystemExit):
        config_from_args(parse_args(["--quick", "--methods", "triton-ring"]))


def test_ceiling_ratios_name_each_dma_paths_share_of_the_pinned_copy() -> None:
    from superinfer_sgl.bench.kv_transfer import ceiling_ratios

    rows = [dict(method="memcpy-ceiling", block_bytes=4, direction="out", gbps_per_direction=50.0),
            dict(method="triton-dma", block_bytes=4, direction="out", gbps_per_direction=46.0, ring_slots=3,
                 slot_blocks=2),
            dict(method="triton-dma-serial", block_bytes=4, direction="out", gbps_per_direction=38.0),
            dict(method="triton-dma", block_bytes=4, direction="in", gbps_per_direction=40.0)]  # no ceiling row
    lines = ceiling_ratios(rows)
    assert len(lines) == 2 and "92.0%" in lines[0] and "ring 3x2" in lines[0] and "76.0%" in lines[1]
