"""Capacity planner (sim/plan.py): class parsing, the mix's draw, replica arithmetic, one real plan."""

from __future__ import annotations

import math

import pytest

from superinfer_sgl.sim.capacity import CapacityGrid
from superinfer_sgl.sim.plan import MixClass, PlanSpec, mix_workload, plan, plan_table, replicas


def test_class_parse_and_its_errors() -> None:
    c = MixClass.parse("chat:rate=20,ttft_ms=1000,tbt_ms=50,weight=2")
    assert c == MixClass("chat", 20.0, 1.0, 0.05, 2.0)
    for bad in ("chat:rate=20,ttft_ms=1000", "chat:rate=1,ttft_ms=1,tbt_ms=1,slo=3", ":rate=1,ttft_ms=1,tbt_ms=1"):
        with pytest.raises(ValueError, match="expected NAME"):
            MixClass.parse(bad)


def test_mix_draws_classes_by_rate_share_with_priority_by_ttft() -> None:
    chat, batch = MixClass("chat", 3.0, 1.0, 0.05), MixClass("batch", 1.0, 30.0, 0.5, weight=0.5)
    wl, names = mix_workload((chat, batch), 20.0, 100.0, seed=4)
    share = sum(n == "chat" for n in names.values()) / len(names)
    assert len(names) == len(wl.requests) > 1500 and abs(share - 0.75) < 0.04
    for r in wl.requests:
        tight = names[r.rid] == "chat"
        assert (r.ttft_slo, r.priority, r.weight) == ((1.0, 10, 1.0) if tight else (30.0, 0, 0.5))


def test_replicas_round_up_and_say_when_one_replica_cannot_serve() -> None:
    assert replicas(10.0, 2.5) == 4 and replicas(10.0, 3.0) == 4 and replicas(9.0, 3.0) == 3
    assert replicas(10.0, None) is None


def test_a_real_plan_on_the_cpu_profile() -> None:
    """A loose class alone serves at least the mix's rate; the shared answer follows its capacity."""
    spec = PlanSpec("cpu-smollm2-135m", (MixClass("chat", 1.0, 2.0, 0.2), MixClass("batch", 1.0, 60.0, 1.0)),
                    duration=30.0, seed=1)
    grid = CapacityGrid(lo=0.2, hi=8.0, growth=1.6, resolution=0.1)
    rows = plan(spec, ["sglang"], grid)
    (row,) = rows
    cap, alone = row["capacity_per_replica_req_s"], row["capacity_alone_req_s"]
    assert cap and alone["batch"] and alone["chat"]
    assert alone["batch"] >= alone["chat"]  # the looser SLOs cannot serve fewer requests per second
    assert row["replicas_shared"] == math.ceil(2.0 / cap - 1e-9)
    assert row["replicas_separate"] == math.ceil(1.0 / alone["chat"] - 1e-9) + math.ceil(1.0 / alone["batch"] - 1e-9)
    assert "| sglang |" in plan_table(rows)


def test_stock_is_planned_both_ways_of_mixed_chunk() -> None:
    """Stock SGLang ships mixed chunk off; planned only with it, stock's replicas were those of a
    setting it does not ship with (and on long prompts, not its better one)."""
    from superinfer_sgl.sim.plan import NO_MIX, base_policy

    spec = PlanSpec("cpu-smollm2-135m", (MixClass("chat", 1.0, 2.0, 0.2),), duration=20.0, seed=1)
    assert spec.config("sglang").mixed_chunk and not spec.config("sglang" + NO_MIX).mixed_chunk
    assert base_policy("sglang:no-mix") == "sglang" and base_policy("goodput") == "goodput"
    grid = CapacityGrid(lo=0.2, hi=4.0, growth=1.6, resolution=0.1)
    (row,) = plan(spec, ["sglang:no-mix"], grid)
    assert row["policy"] == "sglang:no-mix" and row["capacity_per_replica_req_s"]


def test_plan_cli_takes_no_mix_and_refuses_unknown_policies() -> None:
    import subprocess
    import sys

    base = [sys.executable, "-m", "superinfer_sgl.sim", "plan", "--class", "chat:rate=1,ttft_ms=2000,tbt_ms=200"]
    bad = subprocess.run([*base, "--policy", "sglang:fast"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown policy 'sglang:fast'" in bad.stderr
