"""The per-iteration step log (patches/step_log.py) and the speed factors read from it
(superinfer_sgl.sim.steplog), on hand-built batches and logs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from superinfer_patches.step_log import batch_shape
from superinfer_sgl.sim import steplog
from superinfer_sgl.sim.profile import resolve_profile
from superinfer_sgl.sim.steplog import MIN_STEPS, Step, in_window, predicted_s, read_steps, speed_scales


class Mode(SimpleNamespace):
    def is_decode(self) -> bool:
        return self.name == "DECODE"

    def is_mixed(self) -> bool:
        return self.name == "MIXED"


def _batch(mode: str, **kw: object) -> SimpleNamespace:
    fields = {"prefix_lens": None, "extend_lens": None, "decoding_reqs": None, "seq_lens_sum": None, **kw}
    b = SimpleNamespace(forward_mode=Mode(name=mode), **fields)
    b.batch_size = lambda: kw.get("bs", 0)
    return b


def test_batch_shape_decode_extend_and_mixed() -> None:
    assert batch_shape(_batch("DECODE", bs=3, seq_lens_sum=300)) == \
        {"mode": "DECODE", "pt": 0, "pr": 0, "pq": 0.0, "dr": 3, "dc": 300}
    # two prefill rows: 10 new tokens after 4 cached, 6 new after none
    ext = batch_shape(_batch("EXTEND", prefix_lens=[4, 0], extend_lens=[10, 6]))
    assert ext == {"mode": "EXTEND", "pt": 16, "pr": 2, "pq": 10 * (4 + 5) + 6 * 3, "dr": 0, "dc": 0}
    # a mixed batch: the prefill row first, then two decode rows (prefix = context - 1, extend 1)
    mixed = batch_shape(_batch("MIXED", prefix_lens=[8, 99, 49], extend_lens=[32, 1, 1], decoding_reqs=[1, 2]))
    assert mixed == {"mode": "MIXED", "pt": 32, "pr": 1, "pq": 32 * (8 + 16), "dr": 2, "dc": 150}


def _write_log(path: Path, recs: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"t": 99, "dur"')  # torn last line


def test_read_steps_periods_skip_idle_gaps_and_torn_lines(tmp_path: Path) -> None:
    rec = lambda t, idle=False: {"t": t, "dur": 0.01, "idle": idle, "mode": "DECODE", "pt": 0, "pr": 0,  # noqa: E731
                                 "pq": 0.0, "dr": 1, "dc": 10}
    _write_log(tmp_path / "s.jsonl", [rec(1.0), rec(1.05), rec(3.0, idle=True), rec(3.02)])
    steps = read_steps(tmp_path / "s.jsonl")
    assert steps[0].period_s == pytest.approx(0.05) and steps[1].period_s is None
    assert steps[2].period_s == pytest.approx(0.02) and steps[3].period_s is None
    assert [s.t for s in in_window(steps, (1.01, 3.0))] == [1.05, 3.0]


def _synthetic_steps(model: object, decode: float, prefill: float, n: int = 3 * MIN_STEPS) -> list[Step]:
    """Steps whose periods are the profile's prediction at the given speed factors."""
    out, t = [], 0.0
    for i in range(n):
        for s in (Step(t, 0, "DECODE", 0, 0, 0.0, 1 + i % 8, 200 * (1 + i % 8)),
                  Step(t, 0, "EXTEND", 20 + 8 * i, 1, (20 + 8 * i) ** 2 / 2, 0, 0),
                  Step(t, 0, "MIXED", 64, 1, 64 * 40.0, 3, 600)):
            side = steplog.decode_side_s(model, s)
            period = decode * side + prefill * (predicted_s(model, s) - side)
            out.append(Step(t, 0, s.mode, s.prefill_tokens, s.prefill_reqs, s.prefill_pairs, s.decode_rows,
                            s.decode_context, period))
            t += period
    return out


def test_speed_scales_recover_the_factors_the_steps_ran_at() -> None:
    model = resolve_profile("cpu-smollm2-135m").step
    found = speed_scales(model, _synthetic_steps(model, decode=1.3, prefill=0.8))
    assert found["decode"] == pytest.approx(1.3) and found["prefill"] == pytest.approx(0.8)
    assert found["prefill_measured"] and found["steps"] == {"decode": 60, "prefill": 60, "mixed": 60, "other": 0}
    # too few decode steps to say anything: no factors at all
    assert speed_scales(model, _synthetic_steps(model, 1.3, 0.8, n=MIN_STEPS - 1)) is None


def test_refit_recovers_a_step_model_of_another_shape() -> None:
    """Steps from a model whose per-row and per-token costs moved unlike its base (what this VM
    does): two factors cannot match them, the refit does, exactly."""
    from dataclasses import replace

    from superinfer_sgl.sim.steplog import refit

    model = resolve_profile("cpu-smollm2-135m").step
    true = replace(model, base_s=model.base_s * 1.2, per_decode_token_s=model.per_decode_token_s * 2.0,
                   per_context_token_s=model.per_context_token_s * 1.2, per_prefill_token_s=model.per_prefill_token_s * 1.1,
                   prefill_base_s=0.01, per_prefill_pair_s=model.per_prefill_pair_s * 1.1)
    steps = [replace(s, period_s=predicted_s(true, s)) for s in _synthetic_steps(model, 1.0, 1.0)]
    fitted, info = refit(model, steps)
    assert info["refit"] == ["decode base and per-row cost", "prefill intercept and per-token cost"]
    for s in steps:
        assert predicted_s(fitted, s) == pytest.approx(s.period_s, rel=0.02), s
    assert fitted.per_decode_token_s == pytest.approx(true.per_decode_token_s, rel=0.05)
    assert fitted.per_prefill_token_s == pytest.approx(true.per_prefill_token_s, rel=0.05)
    # one batch size only: nothing to fit a slope on, the decode side stays scaled
    one = [replace(s, decode_rows=1, decode_context=200) for s in steps if s.kind == "decode"]
    one = [replace(s, period_s=predicted_s(true, s)) for s in one]
    assert refit(model, one)[1]["refit"] == []


def test_validate_prefers_the_step_log_over_the_point_probe(tmp_path: Path) -> None:
    """A point measured while the machine ran 1.6x slower: its step log shows it, its probe
    (wrongly) saw the profile's speed. --rescale takes the step log's factors and then agrees."""
    from superinfer_sgl.sim.runner import simulate
    from superinfer_sgl.sim.validate import scaled, validate
    from superinfer_sgl.sim.workload import sharegpt_like

    prof, slower = resolve_profile("gh200-qwen2.5-32b"), 1.6
    wl = sharegpt_like(rate=4, duration=10, seed=5)
    s = simulate(wl, scaled(prof, {"decode": slower, "prefill": slower}).with_server(
        kv_tokens=30000, chunked_prefill_tokens=4096), "sglang")
    steps = _synthetic_steps(prof.step, decode=slower, prefill=slower)
    ab = tmp_path / "ab_fake"
    (ab / "schedules").mkdir(parents=True)
    (ab / "logs").mkdir()
    (ab / "schedules" / "00.json").write_text(json.dumps({"arrivals_s": [r.arrival for r in wl.requests]}))
    (ab / "logs" / "sglang.steps.jsonl").write_text("".join(json.dumps(
        {"t": x.t, "dur": 0.0, "idle": False, "mode": x.mode, "pt": x.prefill_tokens, "pr": x.prefill_reqs,
         "pq": x.prefill_pairs, "dr": x.decode_rows, "dc": x.decode_context}) + "\n" for x in steps))
    probe = {"steps_ms": [[1, 1000 * prof.step.seconds(decode_reqs=1, decode_context=208)]],
             "prefill_ms_per_token": 1000 * prof.step.prefill_alone(200) / 200, "prompt_tokens": 200, "out_tokens": 16}
    reqs = [{"prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens, "slo_class": None,
             "ttft_slo_ms": 5000.0, "tbt_slo_ms": 100.0} for r in wl.requests]
    point = {"rate": 4.0, "label": "4 req/s", "speed_probe": probe, "window_unix": [0.0, steps[-1].t],
             "summary": {"ttft_attainment": s["ttft_attainment"], "joint_attainment": s["both_attainment"],
                         "tbt_gap_attainment": s["tbt_gap_attainment"], "p50_ttft_ms": 1000 * s["ttft_p50_s"]}}
    (ab / "ab.json").write_text(json.dumps({
        "config": {"kv_tokens": 30000, "chunked_prefill": 4096, "workload": "sharegpt", "requests": reqs,
                   "points": [{"label": "4 req/s", "rate": 4.0}]}, "results": {"sglang": [point]}}))
    (row,) = validate(ab, prof, rescale=True)["rows"]
    assert row["speed_source"] == "step log"
    assert row["speed_scales"]["decode"] == pytest.approx(slower) and row["speed_scales"]["prefill"] == pytest.approx(slower)
    assert row["delta"]["pass"], row
    # without the log the misleading probe is what it has, and the replay then disagrees
    (ab / "logs" / "sglang.steps.jsonl").unlink()
    (row,) = validate(ab, prof, rescale=True)["rows"]
    assert row["speed_source"] == "point probe" and not row["delta"]["pass"]


def test_bench_start_and_speed_trace() -> None:
    """t = 0 of the replay is the first scheduled request's arrival: the second prefill after an
    idle scheduler turn (the first is bench_serving's warm-up). The trace is measured / predicted
    per bucket from there on."""
    from dataclasses import replace

    from superinfer_sgl.sim.steplog import bench_start, speed_trace

    model = resolve_profile("cpu-smollm2-135m").step
    pre = Step(0.0, 0, "EXTEND", 100, 1, 5000.0, 0, 0)
    dec = Step(0.0, 0, "DECODE", 0, 0, 0.0, 2, 300)
    p, d = predicted_s(model, pre), predicted_s(model, dec)
    steps, t = [], 100.0
    steps.append(replace(pre, t=t, period_s=p)); t += p
    steps.append(replace(dec, t=t, period_s=None)); t += 1.0  # warm-up done, idle
    start = t
    for k in range(150):  # 1x for 2 s, then 1.5x
        f = 1.0 if t - start < 2.0 else 1.5
        s = pre if k == 0 else dec
        steps.append(replace(s, t=t, period_s=f * predicted_s(model, s)))
        t += f * predicted_s(model, s)
    assert bench_start(steps, first_arrival_s=0.25, overhead_s=0.01) == pytest.approx(start - 0.26)
    assert bench_start(steps[:2], 0.0, 0.0) is None  # only the warm-up
    trace = speed_trace(model, steps, start, bucket_s=2.0)
    assert trace[0] == pytest.approx((0.0, 1.0)) and trace[1][0] == 2.0 and trace[1][1] > 1.3
    assert all(f == pytest.approx(1.5) for _, f in trace[2:-1])
