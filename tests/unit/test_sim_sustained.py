"""scripts/sim_sustained.py: its points, its rows and table, end to end on a short run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "sim_sustained.py"
_spec = importlib.util.spec_from_file_location("sim_sustained", _PATH)
sst = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sst)


def test_point_parses_and_refuses() -> None:
    assert sst.point("gh200-qwen2.5-32b,azure:conv,4.5") == ("gh200-qwen2.5-32b", "azure:conv", 4.5)
    for bad in ("p,w", "p,w,x", "p,w,1,2"):
        with pytest.raises(argparse.ArgumentTypeError):
            sst.point(bad)


def test_short_run_writes_rows_for_every_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["sim_sustained.py", "--point", "h100-pcie5-qwen2.5-32b,sharegpt-like,2",
                                      "--duration", "10", "--out", str(tmp_path)])
    sst.main()
    doc = json.loads((tmp_path / "sustained.json").read_text())
    assert [r["policy"] for r in doc["rows"]] == ["sglang", "goodput"]
    for r in doc["rows"]:
        assert 0.0 <= r["both_attainment"] <= 1.0 and r["throughput_tok_s"] > 0 and r["retractions"] >= 0
    assert "--point h100-pcie5-qwen2.5-32b,sharegpt-like,2" in doc["command"]
    table = (tmp_path / "table.md").read_text().splitlines()
    assert len(table) == 4 and table[2].startswith("| h100-pcie5-qwen2.5-32b | sharegpt-like | 2 | sglang |")
