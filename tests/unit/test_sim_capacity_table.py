"""scripts/sim_capacity_table.py's argument parsing and table (the searches are sim.capacity's,
tested in test_sim_capacity.py)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "scripts" / "sim_capacity_table.py"
_spec = importlib.util.spec_from_file_location("sim_capacity_table", _PATH)
sct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sct)


def test_slo_pair_parses_seconds() -> None:
    assert sct.slo_pair("2,0.075") == (2.0, 0.075)


@pytest.mark.parametrize("bad", ["2", "2,0.075,1", "a,b", "0,0.05", "1,-0.05"])
def test_slo_pair_refuses_bad_pairs(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        sct.slo_pair(bad)


def test_table_ratios_against_stock() -> None:
    rows = [{"profile": "p", "workload": "w", "slo": [2.0, 0.075], "policy": "sglang", "capacity_req_s": 4.0},
            {"profile": "p", "workload": "w", "slo": [2.0, 0.075], "policy": "goodput", "capacity_req_s": 6.0}]
    lines = sct.table(rows, ["sglang", "goodput"]).splitlines()
    assert lines[-1] == "| p | w | 2 s / 75 ms | 4.00 | 6.00 | 1.50x |"


def test_table_marks_cells_not_run_apart_from_capacities_below_the_grid() -> None:
    rows = [{"profile": "p", "workload": "w", "slo": [5.0, 0.1], "policy": "sglang", "capacity_req_s": None}]
    assert sct.table(rows, ["sglang", "oracle"]).splitlines()[-1] == "| p | w | 5 s / 100 ms | <0.05 | - | - |"


def test_table_compares_with_stocks_better_way_when_both_ran() -> None:
    """Stock SGLang ships without mixed chunk; simulated with it, it lost capacity on long prompts
    (GH200 Azure conv): with both ways run, every ratio is against the better one."""
    cell = {"profile": "p", "workload": "w", "slo": [1.0, 0.05]}
    rows = [{**cell, "policy": "sglang", "capacity_req_s": 2.0},
            {**cell, "policy": "sglang:no-mix", "capacity_req_s": 2.5},
            {**cell, "policy": "goodput", "capacity_req_s": 3.5}]
    lines = sct.table(rows, ["sglang", "sglang:no-mix", "goodput"]).splitlines()
    assert lines[0].endswith("| goodput / best stock |")
    assert lines[-1] == "| p | w | 1 s / 50 ms | 2.00 | 2.50 | 3.50 | 1.40x |"
