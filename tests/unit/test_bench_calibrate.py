"""Calibration of the cpu profile: SLOs, rates and request count from a speed probe (hand-checked)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from superinfer_sgl.bench.calibrate import CalibrationKnobs, Speed, derive
from superinfer_sgl.bench.cli import parser
from superinfer_sgl.bench.planning import build_plan, recalibrated

SPEED = Speed(prefill_ms_per_token=2.0, steps_ms=((1, 50.0), (4, 80.0)))  # step(b) = 50 + 10 (b - 1)


def test_step_interpolation() -> None:
    assert SPEED.step_at(1) == 50.0 and SPEED.step_at(10) == pytest.approx(140.0)
    assert Speed(1.0, ((2, 70.0),)).step_at(9) == 70.0
    assert Speed(1.0, ((1, 90.0), (4, 60.0))).step_at(8) == 90.0  # never faster with a bigger batch


def test_derive_numbers() -> None:
    cal = derive(SPEED, kv_tokens=2000, mean_in=150, mean_out=50, knobs=CalibrationKnobs(), n_systems=2,
                 elapsed_s=100, startup_s=120, max_requests=200)
    assert cal.batch == 10 and cal.step_ms == pytest.approx(140)
    # TBT: max(2 x 140, 140 + 150 x 2) = 440 ms; TTFT: 150 x 2 + 50 x 140 = 7300 ms
    assert (cal.tbt_slo_ms, cal.ttft_slo_ms) == (440, 7300)
    assert cal.capacity_rps == pytest.approx(1.0)  # 1 / (150 x 2 ms + 50 x 140 ms / 10)
    assert cal.rates == (0.6, 1.0, 1.4, 2.0)
    # per request: (1.667 + 1.0 + (0.714 + 0.286) + (0.5 + 0.5)) s x 2 systems = 9.33 s;
    # fixed (7.3 + 1.6 + 3) s x 8 runs = 95.2 s; left = 1200 - 100 - 120 - 30 = 950 s
    # -> (950 - 95.2) / 9.33 = 91.6
    assert cal.num_requests == 91
    small = derive(SPEED, 2000, 150, 50, CalibrationKnobs(budget_s=300), 2, 100, 120, 200)
    assert small.num_requests == 16  # the floor
    assert derive(SPEED, 2000, 150, 50, CalibrationKnobs(), 2, 100, 120, 10).num_requests == 10  # the cap


def test_recalibrated_plan_scales_slos_and_classes(tmp_path: Path, model_dir: Path) -> None:
    argv = ["--profile", "smoke", "--workload", "mixed", "--out", str(tmp_path)]
    plan, tok = build_plan(parser().parse_args(argv), argv)
    cal = derive(SPEED, plan.profile.kv_tokens, 100, 12, CalibrationKnobs(min_requests=4), 3, 10, 60, 5)
    new = recalibrated(plan, cal, tok)
    f_tbt = cal.tbt_slo_ms / plan.profile.slo.tbt_ms
    f_ttft = cal.ttft_slo_ms / plan.profile.slo.ttft_ms
    old_classes, new_classes = json.loads(plan.profile.slo_classes), json.loads(new.profile.slo_classes)
    for name, slo in old_classes.items():
        assert new_classes[name]["tbt_ms"] == pytest.approx(slo["tbt_ms"] * f_tbt, abs=0.1)
        assert new_classes[name]["ttft_ms"] == pytest.approx(slo["ttft_ms"] * f_ttft, abs=0.1)
    assert [pt.rate for pt in new.points] == list(cal.rates) and len(new.requests) == cal.num_requests
    for r in new.requests:
        assert r.slo.tbt_ms == pytest.approx(new_classes[r.slo_class]["tbt_ms"])
    ours = next(s for s in new.systems if s.name == "superinfer")
    assert f"{cal.ttft_slo_ms:g}" in ours.flags and new.profile.slo_classes in ours.flags


def test_probe_keeps_the_fastest_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe slowed by another job (the first repeat here) must not scale the SLOs."""
    from superinfer_sgl.bench import calibrate

    calls: list[int] = []

    def fake(url: str, texts: list[str], out_tokens: int) -> list[list[float]]:
        calls.append(len(texts))
        slow = len(calls) in (2, 4)  # first repeat of batch 1 and of batch 4
        gap = (0.3 if slow else 0.05) + 0.01 * len(texts)
        first = 2.0 if slow else 0.5  # TTFT
        return [[0.0, first, *(first + gap * (i + 1) for i in range(out_tokens - 1))] for _ in texts]

    monkeypatch.setattr(calibrate, "_concurrent", fake)
    texts = [f"t{i}" for i in range(calibrate.probe_prompts((1, 4), 2))]
    speed = calibrate.probe("http://x", texts, prompt_tokens=100, out_tokens=6, batches=(1, 4), repeats=2)
    assert calls == [1, 1, 1, 4, 4]  # warmup, then two repeats per batch size
    assert [b for b, _ in speed.steps_ms] == [1, 4]
    assert [ms for _, ms in speed.steps_ms] == pytest.approx([60.0, 90.0])
    assert speed.prefill_ms_per_token == pytest.approx(5.0)  # 0.5 s / 100 tokens, the fast repeat
