"""A/B harness workloads: seeded, deterministic, and distributed as asked."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from superinfer_sgl.bench.prompts import PromptBuilder, openai_line, priority_by_ttft, write_dataset
from superinfer_sgl.bench.workloads import (
    BenchRequest,
    LengthDist,
    assign_classes,
    offered_rate,
    parse_mix,
    poisson_arrivals,
    recorded_arrivals,
    sharegpt_like,
)
from superinfer_sgl.rotasched.slo import DEFAULT_CLASSES, Slo, SloClasses

SLO = Slo(5000, 100)
CLASSES = SloClasses.parse(DEFAULT_CLASSES, SLO)


def test_sharegpt_like_is_deterministic_per_seed() -> None:
    a, b, c = (sharegpt_like(200, s, SLO) for s in (3, 3, 4))
    assert a == b
    assert [(r.prompt_tokens, r.output_tokens) for r in a] != [(r.prompt_tokens, r.output_tokens) for r in c]
    assert [r.idx for r in a] == list(range(200))


def test_lengths_follow_the_requested_lognormal() -> None:
    dist = LengthDist(median=200, sigma=0.5, lo=1, hi=100_000)  # clipping never binds here
    reqs = sharegpt_like(20_000, 11, SLO, inputs=dist, outputs=dist.scaled(0.25))
    ins = np.array([r.prompt_tokens for r in reqs], dtype=float)
    outs = np.array([r.output_tokens for r in reqs], dtype=float)
    assert abs(np.median(ins) / 200 - 1) < 0.03
    assert abs(np.std(np.log(ins)) - 0.5) < 0.02
    assert abs(np.median(outs) / 50 - 1) < 0.04
    assert abs(np.mean(ins) / (200 * math.exp(0.5 ** 2 / 2)) - 1) < 0.03  # log-normal mean


def test_lengths_are_clipped() -> None:
    dist = LengthDist(median=100, sigma=2.0, lo=20, hi=300)
    reqs = sharegpt_like(2000, 5, SLO, inputs=dist, outputs=dist)
    ins = [r.prompt_tokens for r in reqs]
    assert min(ins) == 20 and max(ins) == 300


def test_poisson_arrivals() -> None:
    a = poisson_arrivals(20_000, 4.0, 9)
    assert a == poisson_arrivals(20_000, 4.0, 9)
    assert a != poisson_arrivals(20_000, 4.0, 10)
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:]))
    gaps = np.diff(a)
    assert abs(gaps.mean() - 0.25) < 0.01
    assert abs(gaps.std() / gaps.mean() - 1) < 0.03  # exponential: coefficient of variation 1
    assert abs(offered_rate(a) / 4.0 - 1) < 0.03


def test_class_mix_is_seeded_and_weighted() -> None:
    reqs = sharegpt_like(6000, 1, SLO)
    mixed = assign_classes(reqs, parse_mix("interactive:3,batch:1"), CLASSES, seed=2)
    assert mixed == assign_classes(reqs, {"interactive": 3, "batch": 1}, CLASSES, seed=2)
    share = sum(r.slo_class == "interactive" for r in mixed) / len(mixed)
    assert abs(share - 0.75) < 0.02
    for r in mixed:
        assert r.slo == CLASSES[r.slo_class]
        assert (r.prompt_tokens, r.output_tokens) == (reqs[r.idx].prompt_tokens, reqs[r.idx].output_tokens)
    with pytest.raises(ValueError, match="not defined"):
        assign_classes(reqs, {"gold": 1}, CLASSES, seed=2)


def test_recorded_arrivals_scale_time() -> None:
    reqs = [BenchRequest(i, 10, 10, SLO, arrival_s=100.0 + t) for i, t in enumerate((0.0, 1.0, 3.0))]
    assert recorded_arrivals(reqs) == [0.0, 1.0, 3.0]
    assert recorded_arrivals(reqs, 2.0) == [0.0, 2.0, 6.0]
    with pytest.raises(ValueError, match="no recorded timestamps"):
        recorded_arrivals([BenchRequest(0, 1, 1, SLO)])


def test_priority_ranks_tighter_ttft_higher() -> None:
    reqs = assign_classes(sharegpt_like(50, 1, SLO), {"interactive": 1, "standard": 1, "batch": 1}, CLASSES, 1)
    prio = priority_by_ttft(reqs)
    by_class = {r.slo_class: prio(r) for r in reqs}
    assert by_class["interactive"] > by_class["standard"] > by_class["batch"]


def test_openai_line_carries_slo_in_custom_params() -> None:
    r = BenchRequest(3, 50, 17, Slo(1000, 50), slo_class="interactive")
    line = openai_line(r, "hi", priority=2)
    assert line["max_tokens"] == 17 and line["priority"] == 2
    assert line["custom_params"] == {"ttft_slo_ms": 1000.0, "tbt_slo_ms": 50.0, "slo_class": "interactive"}
    assert line["messages"] == [{"role": "user", "content": "hi"}]


def test_prompts_have_the_requested_templated_length(model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    builder = PromptBuilder(tok)
    reqs = [BenchRequest(i, n, 8, SLO) for i, n in enumerate((48, 64, 100, 257, 480))]
    lens = write_dataset(tmp_path / "d.jsonl", reqs, builder)
    for r, n in zip(reqs, lens):
        assert r.prompt_tokens - 3 <= n <= r.prompt_tokens  # word granularity: at most a few short
    # Counted as bench_serving's openai loader counts them (chat template, generation prompt).
    import json

    for line, n in zip((tmp_path / "d.jsonl").read_text().splitlines(), lens):
        msgs = json.loads(line)["messages"]
        assert len(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True,
                                           return_dict=False)) == n
    contents = [json.loads(l)["messages"][0]["content"] for l in (tmp_path / "d.jsonl").read_text().splitlines()]
    assert len({c.split("]")[0] for c in contents}) == len(contents)  # unique tags: no shared prefix
    assert builder.build(3, 100) == builder.build(3, 100)


def test_prompts_that_may_stop_at_eos_end_with_the_question_inside_their_counted_length(model_dir: Path,
                                                                                        tmp_path: Path) -> None:
    import json

    from transformers import AutoTokenizer

    from superinfer_sgl.bench.prompts import QUESTION

    tok = AutoTokenizer.from_pretrained(model_dir)
    plain, asked = PromptBuilder(tok), PromptBuilder(tok, QUESTION)
    reqs = [BenchRequest(i, n, 128, SLO) for i, n in enumerate((64, 100, 257))]
    lens = write_dataset(tmp_path / "q.jsonl", reqs, asked)
    for r, n, line in zip(reqs, lens, (tmp_path / "q.jsonl").read_text().splitlines()):
        msgs = json.loads(line)["messages"]
        assert msgs[0]["content"].endswith("\n\n" + QUESTION)
        assert r.prompt_tokens - 3 <= n <= r.prompt_tokens  # the question counts toward the prompt's length
        assert len(tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)) == n
        assert json.loads(line)["max_tokens"] == 128  # the bound the server sees
    assert asked.min_tokens > plain.min_tokens
    assert not plain.build(1, 100)[0].endswith(QUESTION)  # fixed-length prompts as before
