"""The simulator's step jitter (SimConfig.step_jitter) and the spread it is measured as
(sim.steplog.step_spread): what lets the simulator see what a real CPU server's uneven steps do
to the goodput policy's prefill cap."""

from __future__ import annotations

import statistics

from superinfer_sgl.sim.engine import _jitter
from superinfer_sgl.sim.metrics import summarize
from superinfer_sgl.sim.profile import StepModel
from superinfer_sgl.sim.steplog import Step, step_spread
from test_sim_engine import run, workload


def test_jitter_factors_have_mean_one_and_the_asked_spread() -> None:
    assert _jitter(0.0, 1) is None
    draw = _jitter(0.15, 7)
    xs = [draw() for _ in range(40_000)]
    assert abs(statistics.fmean(xs) - 1.0) < 0.005
    assert abs(statistics.pstdev(xs) - 0.15) < 0.005
    assert min(xs) > 0
    again = _jitter(0.15, 7)
    assert [again() for _ in range(5)] == xs[:5]  # seeded: a run replays exactly


def test_a_jittered_run_is_reproducible_and_differs_from_a_steady_one() -> None:
    wl = workload(*[(0.05 * i, 200, 40) for i in range(30)])
    steady = summarize(run(wl, "goodput", mixed_chunk=True))
    a = summarize(run(wl, "goodput", mixed_chunk=True, step_jitter=0.2, jitter_seed=3))
    b = summarize(run(wl, "goodput", mixed_chunk=True, step_jitter=0.2, jitter_seed=3))
    assert a == b
    assert a["sim_end_s"] != steady["sim_end_s"]
    assert a["finished"] == steady["finished"] == 30


def _steps(periods: list[float]) -> list[Step]:
    return [Step(t=i * 0.1, dur_s=p, mode="DECODE", prefill_tokens=0, prefill_reqs=0, prefill_pairs=0.0,
                 decode_rows=1, decode_context=0, period_s=p) for i, p in enumerate(periods)]


def test_step_spread_is_the_rms_of_steps_around_the_model() -> None:
    model = StepModel(base_s=0.05, per_decode_token_s=0.0)
    assert step_spread(model, _steps([0.05] * 100)) == 0.0
    assert step_spread(model, _steps([0.05] * 5)) is None  # too few steps to say
    spread = step_spread(model, _steps([0.06, 0.04] * 100), bucket_s=None)
    assert spread is not None and abs(spread - 0.2) < 1e-9
    # the machine's drift is not spread once each step is measured against its bucket's speed
    drift = _steps([0.05] * 100 + [0.075] * 100)
    assert step_spread(model, drift, bucket_s=None) > 0.3
    assert step_spread(model, drift, bucket_s=1.0) < 1e-9
