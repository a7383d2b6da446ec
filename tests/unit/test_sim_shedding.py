"""scripts/sim_shedding.py: its cells, samples, rows and table, end to end on a short run."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "sim_shedding.py"
_spec = importlib.util.spec_from_file_location("sim_shedding", _PATH)
ssh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ssh)


def test_cell_parses_and_refuses() -> None:
    assert ssh.cell("gh200-qwen2.5-32b,azure:conv,1,0.05,3.2:3.5") == (
        "gh200-qwen2.5-32b", "azure:conv", 1.0, 0.05, (3.2, 3.5))
    for bad in ("p,w,1,0.1", "p,w,1,0.1,x", "p,w,1,0.1,2,3"):
        with pytest.raises(argparse.ArgumentTypeError):
            ssh.cell(bad)


def test_samples_are_seeds_or_trace_windows() -> None:
    assert [s for _, s in ssh.samples("sharegpt-like")] == list(ssh.SEEDS)
    assert [w for w, _ in ssh.samples("azure:conv")] == ["azure:conv", "azure:conv@600", "azure:conv@1200",
                                                         "azure:conv@1800"]


def test_short_run_pools_both_variants(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["sim_shedding.py", "--cell", "h100-pcie5-qwen2.5-32b,sharegpt-like,1,0.05,6",
                                      "--duration", "8", "--out", str(tmp_path)])
    ssh.main()
    doc = json.loads((tmp_path / "shedding.json").read_text())
    assert [r["lever"] for r in doc["rows"]] == [True, False]
    assert [r["variant"] for r in doc["rows"]] == ["goodput", "without shedding"]
    for r in doc["rows"]:
        assert len(r["samples"]) == len(ssh.SEEDS) and r["both_attainment"] == pytest.approx(sum(r["samples"]) / 4)
    assert "--cell h100-pcie5-qwen2.5-32b,sharegpt-like,1,0.05,6" in doc["command"]
    table = (tmp_path / "table.md").read_text().splitlines()
    assert len(table) == 3 and table[2].startswith("| h100-pcie5-qwen2.5-32b | sharegpt-like | 1 s / 50 ms | 6 |")


def test_against_reserve_runs_the_variant_with_sglangs_whole_reserve(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Requests that may stop at EOS under a loose bound: the variant keeps SGLang's whole decaying
    estimate (--running-reserve 1); past capacity the default's smaller reserve admits more, so the
    two runs differ."""
    monkeypatch.setattr(sys, "argv", ["sim_shedding.py", "--cell", "h100-pcie5-qwen2.5-32b,sharegpt-like,5,0.1,10",
                                      "--duration", "20", "--no-ignore-eos", "--max-new-tokens", "1024",
                                      "--against", "reserve", "--out", str(tmp_path)])
    ssh.main()
    doc = json.loads((tmp_path / "shedding.json").read_text())
    on, off = doc["rows"]
    assert (on["variant"], off["variant"], doc["against"]) == ("goodput", "without reserve", "reserve")
    assert on["throughput_tok_s"] != off["throughput_tok_s"]
    assert "without reserve" in (tmp_path / "table.md").read_text()


def test_max_new_tokens_needs_no_ignore_eos(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["sim_shedding.py", "--max-new-tokens", "64"])
    with pytest.raises(SystemExit):
        ssh.main()


def test_against_reserve_takes_another_share(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--reserve S`: the variant runs with --running-reserve S instead of SGLang's whole reserve."""
    monkeypatch.setattr(sys, "argv", ["sim_shedding.py", "--cell", "h100-pcie5-qwen2.5-32b,sharegpt-like,5,0.1,10",
                                      "--duration", "20", "--against", "reserve", "--reserve", "0.15",
                                      "--out", str(tmp_path)])
    ssh.main()
    doc = json.loads((tmp_path / "shedding.json").read_text())
    on, off = doc["rows"]
    assert (on["variant"], off["variant"], doc["against"]) == ("goodput", "without reserve 0.15", "reserve 0.15")
    assert on["throughput_tok_s"] != off["throughput_tok_s"]  # memory binds on this cell past capacity
    monkeypatch.setattr(sys, "argv", ["sim_shedding.py", "--reserve", "0.15"])  # no variant to give it to
    with pytest.raises(SystemExit):
        ssh.main()
