"""The simulator running the server's own cost meter (SimConfig.measured_costs): the goodput
policy reads what a CostMeter fed every simulated iteration learned, as the server's does."""

from __future__ import annotations

from superinfer_sgl.sim.metrics import summarize
from superinfer_sgl.sim.profile import resolve_profile
from superinfer_sgl.sim.workload import sharegpt_like
from test_sim_engine import run


def test_the_meter_learns_the_profiles_costs_from_the_simulated_steps() -> None:
    prof = resolve_profile("gh200-qwen2.5-32b")
    wl = sharegpt_like(10.0, 20.0, seed=3)
    sim = run(wl, "goodput", prof, mixed_chunk=True, measured_costs=True, min_stint_s=None)
    assert summarize(sim)["finished"] == len(wl.requests)
    meter = sim.policy._meter  # type: ignore[attr-defined]
    assert meter is not None and meter.observed["prefill"] > 50 and meter.observed["decode"] > 50
    costs, step = meter.costs, prof.step
    # per prompt token: not under the profile's slope, what a long prompt pays past the decode
    # floor's slack (the mean of time / tokens was 20-40% under it); the slack moves with the
    # batch, so the estimate wanders above it
    assert 0.95 < costs.prefill_s_per_token / step.per_prefill_token_s < 1.3
    running = 1 + len(sim.running)
    assert 0.9 * step.seconds(decode_reqs=1) < costs.decode_step_s < 1.5 * step.seconds(decode_reqs=running + 200)


def test_measured_costs_change_nothing_for_the_other_policies() -> None:
    wl = sharegpt_like(5.0, 10.0, seed=1)
    for policy in ("sglang", "paper"):
        a = summarize(run(wl, policy, mixed_chunk=True, measured_costs=False))
        b = summarize(run(wl, policy, mixed_chunk=True, measured_costs=True))
        assert a == b


def test_the_server_as_shipped_is_the_default() -> None:
    """`sim run --policy goodput` runs the server's defaults: the meter, not the profile's costs."""
    from superinfer_sgl.sim.__main__ import _parser as build_parser
    from superinfer_sgl.sim.engine import SimConfig
    from superinfer_sgl.sim.runner import Job
    assert SimConfig().measured_costs and Job("gh200-qwen2.5-32b", "goodput").config().measured_costs
    args = build_parser().parse_args(["run", "--policy", "goodput"])
    assert not args.profile_costs
    assert build_parser().parse_args(["run", "--policy", "goodput", "--profile-costs"]).profile_costs
