"""Simulator workloads: the seeded generator and the trace loaders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superinfer_sgl.sim.runner import build_workload
from superinfer_sgl.sim.workload import (
    AZURE_ATTRIBUTION, AZURE_DIR, load_azure, load_sharegpt_json, load_table, sharegpt_like, stats,
)


def test_sharegpt_like_is_seeded_filtered_and_poisson() -> None:
    a, b = sharegpt_like(10, 60, seed=3), sharegpt_like(10, 60, seed=3)
    assert a == b and a != sharegpt_like(10, 60, seed=4)
    s = stats(a.requests)
    assert 450 < s["requests"] < 750 and 8 < s["rate"] < 12
    assert all(4 <= r.prompt_tokens <= 1024 and r.output_tokens >= 4 for r in a.requests)
    assert all(r.prompt_tokens + r.output_tokens <= 2048 for r in a.requests)
    assert all(0 <= r.arrival < 60 for r in a.requests)
    big = stats(sharegpt_like(20, 300, seed=0).requests)
    assert 200 < big["mean_prompt"] < 300 and 170 < big["mean_output"] < 230


def test_csv_and_jsonl_traces(tmp_path: Path) -> None:
    csv = tmp_path / "t.csv"
    csv.write_text("timestamp,prompt_tokens,output_tokens,ttft_slo_ms\n12.5,100,20,1000\n10.0,50,5,\n")
    w = load_table(csv)
    assert [r.arrival for r in w.requests] == [0.0, 2.5]
    assert [r.prompt_tokens for r in w.requests] == [50, 100]
    assert w.requests[1].ttft_slo == 1.0 and w.requests[0].ttft_slo == 5.0
    jl = tmp_path / "t.jsonl"
    jl.write_text("\n".join(json.dumps(x) for x in [
        {"arrival": 1.0, "input_tokens": 7, "max_new_tokens": 3, "custom_params": {"tbt_slo_ms": 50}},
        {"arrival": 3.0, "input_tokens": 9, "max_new_tokens": 4}]))
    w = load_table(jl)
    assert [r.arrival for r in w.requests] == [0.0, 2.0] and w.requests[0].tbt_slo == 0.05
    bad = tmp_path / "bad.csv"
    bad.write_text("foo,bar\n1,2\n")
    with pytest.raises(ValueError, match="arrival"):
        load_table(bad)


def test_sharegpt_json(tmp_path: Path) -> None:
    data = [{"conversations": [{"from": "human", "value": "x" * 400}, {"from": "gpt", "value": "y" * 80}]},
            {"conversations": [{"from": "human", "value": "hi"}]}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    w = load_sharegpt_json(path, rate=5, duration=10, seed=1)
    assert w.requests and all((r.prompt_tokens, r.output_tokens) == (100, 20) for r in w.requests)


@pytest.mark.skipif(not (AZURE_DIR / "AzureLLMInferenceTrace_conv.csv").exists(), reason="no Azure trace")
def test_azure_trace_window_and_rate_scaling() -> None:
    w = load_azure("conv", duration=60)
    assert w.requests[0].arrival == 0.0 and w.duration < 60
    assert AZURE_ATTRIBUTION in w.source and "CC-BY 4.0" in w.source
    fast = load_azure("conv", duration=60, rate=20)
    assert len(fast.requests) == len(w.requests)
    assert stats(fast.requests)["rate"] == pytest.approx(20, rel=0.05)
    assert [r.prompt_tokens for r in fast.requests] == [r.prompt_tokens for r in w.requests]


@pytest.mark.skipif(not (AZURE_DIR / "AzureLLMInferenceTrace_conv.csv").exists(), reason="no Azure trace")
def test_azure_window_start_is_another_stretch_of_the_trace() -> None:
    """The seed does not move an Azure window; `azure:KIND@START` does."""
    first, again = build_workload("azure:conv", 2.0, 60, seed=1), build_workload("azure:conv", 2.0, 60, seed=2)
    later = build_workload("azure:conv@1200", 2.0, 60, seed=1)
    assert first.requests == again.requests
    assert later.requests[0].arrival == 0.0 and "from 1200 s into the trace" in later.source
    assert [r.prompt_tokens for r in later.requests] != [r.prompt_tokens for r in first.requests]
    assert stats(later.requests)["rate"] == pytest.approx(2.0, rel=0.05)


@pytest.mark.parametrize("spec", ["azure:conv@x", "azure:conv@-5"])
def test_azure_window_start_must_be_seconds(spec: str) -> None:
    with pytest.raises(ValueError, match="START must be"):
        build_workload(spec, 2.0, 60)
