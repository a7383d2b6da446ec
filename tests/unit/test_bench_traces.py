"""Trace loaders: Azure CSV (time scaling, re-timing to Poisson), Mooncake JSONL, ShareGPT JSON.

The Azure rows below follow AzureLLMInferenceTrace_conv.csv (Azure Public Dataset, CC-BY 4.0;
Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superinfer_sgl.bench.cli import parser
from superinfer_sgl.bench.planning import build_points
from superinfer_sgl.bench.profiles import PROFILES
from superinfer_sgl.bench.traces import LengthFit, TraceError, load_trace, parse_timestamp, to_requests
from superinfer_sgl.bench.workloads import offered_rate, poisson_arrivals, recorded_arrivals
from superinfer_sgl.rotasched.slo import Slo

SLO = Slo(5000, 100)
AZURE_ROWS = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:51.2224670,879,55
2023-11-16 18:15:51.3910170,91,16
"""
AZURE_FILE = Path("/work/shared/data/AzureLLMInferenceTrace_conv.csv")


@pytest.fixture
def azure(tmp_path: Path) -> Path:
    p = tmp_path / "AzureLLMInferenceTrace_conv.csv"
    p.write_text(AZURE_ROWS)
    return p


def test_azure_csv_timestamps_and_counts(azure: Path) -> None:
    recs = load_trace(azure)
    assert [(r.input_tokens, r.output_tokens) for r in recs] == [(374, 44), (396, 109), (879, 55), (91, 16)]
    t = [r.timestamp_s for r in recs]
    assert t[1] - t[0] == pytest.approx(4.314579, abs=1e-6)  # 7 fractional digits kept
    assert t[3] - t[2] == pytest.approx(0.16855, abs=1e-6)


def test_parse_timestamp_forms() -> None:
    assert parse_timestamp(12.5) == 12.5
    assert parse_timestamp("3") == 3.0
    a = parse_timestamp("2023-11-16 18:15:46.6805900")
    assert parse_timestamp("2023-11-16T18:15:47") - a == pytest.approx(0.31941, abs=1e-6)
    with pytest.raises(TraceError):
        parse_timestamp("yesterday")


def test_time_scaling_of_recorded_arrivals(azure: Path) -> None:
    reqs = to_requests(load_trace(azure), SLO)
    base = recorded_arrivals(reqs)
    assert base[0] == 0.0 and base[1] == pytest.approx(4.314579, abs=1e-6)
    slow = recorded_arrivals(reqs, 2.0)
    assert slow == pytest.approx([2 * x for x in base])
    assert offered_rate(slow) == pytest.approx(offered_rate(base) / 2)


def test_length_fit_and_window(azure: Path) -> None:
    recs = load_trace(azure)
    reqs = to_requests(recs, SLO, LengthFit(scale=0.5, max_input=300, max_output=40), start=1, limit=2)
    assert [(r.prompt_tokens, r.output_tokens) for r in reqs] == [(198, 40), (300, 28)]
    assert [r.idx for r in reqs] == [0, 1] and reqs[0].arrival_s == recs[1].timestamp_s
    with pytest.raises(TraceError, match="empty"):
        to_requests(recs, SLO, start=10)


def _plan_args(tmp_path: Path, trace: Path, *extra: str) -> list[str]:
    return ["--profile", "smoke", "--workload", "trace", "--trace", str(trace), "--out", str(tmp_path / "o"),
            *extra]


def test_retime_to_poisson_and_replay(azure: Path, tmp_path: Path) -> None:
    p = PROFILES["smoke"]
    a = parser().parse_args(_plan_args(tmp_path, azure, "--rates", "0.5,2", "--seed", "7"))
    reqs = to_requests(load_trace(azure), SLO)
    pts, mode = build_points(a, p, reqs)
    assert mode == "poisson" and [pt.rate for pt in pts] == [0.5, 2.0]
    assert list(pts[1].arrivals) == poisson_arrivals(4, 2.0, 7 * 1000 + 1)  # from the seed, not the trace
    a = parser().parse_args(_plan_args(tmp_path, azure, "--trace-arrivals", "recorded", "--time-scales", "1,4"))
    pts, mode = build_points(a, p, reqs)
    assert mode == "recorded" and [pt.time_scale for pt in pts] == [4.0, 1.0]  # sorted by offered rate
    assert list(pts[1].arrivals) == pytest.approx(recorded_arrivals(reqs))
    assert pts[0].rate == pytest.approx(offered_rate(recorded_arrivals(reqs)) / 4, rel=1e-3)


@pytest.mark.skipif(not AZURE_FILE.is_file(), reason="shared Azure trace not present")
def test_real_azure_conv_trace_loads() -> None:
    recs = load_trace(AZURE_FILE)
    assert len(recs) > 10_000
    stamps = [r.timestamp_s for r in recs[:1000]]
    assert all(b >= a for a, b in zip(stamps, stamps[1:]))
    assert 0.5 < offered_rate([s - stamps[0] for s in stamps]) < 50  # a few req/s, as recorded


def test_mooncake_jsonl_milliseconds(tmp_path: Path) -> None:
    p = tmp_path / "mooncake_trace.jsonl"
    p.write_text("\n".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": [1]})
                           for t, i, o in ((0, 6955, 52), (1500, 100, 7))) + "\n")
    recs = load_trace(p)
    assert [(r.timestamp_s, r.input_tokens, r.output_tokens) for r in recs] == [(0.0, 6955, 52), (1.5, 100, 7)]


class _WordTokenizer:
    def encode(self, text: str) -> list[int]:
        return list(range(len(text.split())))


def test_sharegpt_json_lengths(tmp_path: Path) -> None:
    p = tmp_path / "sg.json"
    p.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "a b c"}, {"from": "gpt", "value": "d e"}]},
        {"conversations": [{"from": "human", "value": "lonely"}]},
    ]))
    recs = load_trace(p, _WordTokenizer())
    assert [(r.timestamp_s, r.input_tokens, r.output_tokens) for r in recs] == [(None, 3, 2)]
    with pytest.raises(TraceError, match="tokenizer"):
        load_trace(p)


def test_missing_columns_are_named(tmp_path: Path) -> None:
    p = tmp_path / "t.csv"
    p.write_text("when,prompt\n1,2\n")
    with pytest.raises(TraceError, match="input token count"):
        load_trace(p)
