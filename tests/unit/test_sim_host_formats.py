"""scripts/sim_host_formats.py: each format's host capacity from the server's own block sizing,
and a tiny run whose narrower formats hold more tokens in the same bytes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
_PATH = Path(__file__).resolve().parents[2] / "scripts" / "sim_host_formats.py"
_spec = importlib.util.spec_from_file_location("sim_host_formats", _PATH)
shf = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(shf)


def test_bytes_per_token_follow_the_host_pool_formats() -> None:
    dense, fp8, int4 = (shf.format_bytes(f, 64, 8, 128) for f in shf.FORMATS)
    assert dense == 64 * 2 * 8 * 128 * 2  # bf16 K and V rows
    assert dense / 2 < fp8 < dense / 2 * 1.01  # fp8: half, plus per-block scales
    assert int4 == pytest.approx(dense * 68 / 256)  # packed codes + one scale byte per group of 32


def test_a_tiny_run_writes_one_row_per_cell(tmp_path: Path) -> None:
    shf.main(["--rates", "12", "--host-gb", "0.25", "--seeds", "1", "--duration", "8",
              "--policies", "goodput", "--out", str(tmp_path)])
    doc = json.loads((tmp_path / "formats.json").read_text())
    rows = {r["format"]: r for r in doc["rows"]}
    assert set(rows) == set(shf.FORMATS)
    assert rows["auto"]["host_tokens"] < rows["fp8_e4m3"]["host_tokens"] < rows["int4"]["host_tokens"]
    assert all(0.0 <= r["joint_attainment"] <= 1.0 and r["requests"] > 0 for r in rows.values())
    assert "| goodput | 0.25 GiB | 12 | int4 |" in (tmp_path / "table.md").read_text()
