"""rotasched.output_share: what requests that may stop at EOS decode of their max_new_tokens, as
shedding reads it; and the simulator's requests of unknown length (a bound above their outputs)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer_sgl.rotasched.output_share import MIN_FINISHED, OutputShare

finished = st.tuples(st.integers(0, 10_000), st.integers(1, 10_000))


@settings(max_examples=200, deadline=None)
@given(st.lists(finished, min_size=1, max_size=200))
def test_the_share_is_a_fraction_and_zero_until_enough_have_finished(rows: list[tuple[int, int]]) -> None:
    share = OutputShare()
    for i, (outputs, asked) in enumerate(rows):
        share.observe(outputs, asked)
        assert share.seen == i + 1
        assert 0.0 <= share.share <= 1.0
        if i + 1 < MIN_FINISHED:
            assert share.share == 0.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 512), min_size=MIN_FINISHED, max_size=100), st.integers(0, 8))
def test_requests_that_each_decode_the_same_share_teach_that_share(eighths_asked: list[int], eighths: int) -> None:
    """A ratio of weighted sums: when every request decodes k/8 of what it asked for, so does
    the estimate, whatever the bounds."""
    share = OutputShare()
    for m in eighths_asked:
        share.observe(m * eighths, 8 * m)
    assert share.share == pytest.approx(eighths / 8)


def test_bounds_past_the_clip_count_as_the_clip_and_the_share_follows_a_change() -> None:
    share = OutputShare(clip=4096)
    for _ in range(MIN_FINISHED):
        share.observe(512, 100_000)  # a client asking for everything: the reserve sees 4096
    assert share.share == pytest.approx(512 / 4096)
    for _ in range(500):  # ten of its ~50-request memories later the new workload's share stands
        share.observe(100, 200)
    assert share.share == pytest.approx(0.5, abs=0.01)
    share.observe(5000, 10)  # outputs past the bound (cannot happen) count as the bound
    assert share.share <= 1.0


def test_simulated_requests_of_unknown_length_stop_before_the_bound_the_server_sees() -> None:
    from superinfer_sgl.sim.runner import Job, build_workload, run_job

    wl = build_workload("sharegpt-like", 4.0, 20.0, 3).with_max_new_tokens(1024)
    assert all(r.max_new_tokens == max(1024, r.output_tokens) for r in wl.requests)
    assert "max_new_tokens 1024" in wl.source
    with pytest.raises(ValueError, match=">= 1"):
        wl.with_max_new_tokens(0)
    with pytest.raises(ValueError, match="EOS"):
        Job("gh200-qwen2.5-32b", "goodput", max_new_tokens=1024)  # fixed-length: it would decode 1024
    base = dict(profile="gh200-qwen2.5-32b", policy="goodput", rate=4.0, duration=20.0, seed=3,
                mixed_chunk=True, ignore_eos=False)
    capped, exact = run_job(Job(**base, max_new_tokens=1024)), run_job(Job(**base))
    # the same work either way (outputs end at the trace's lengths); only what the server knew differs
    assert capped["output_tokens"] == exact["output_tokens"] == sum(r.output_tokens for r in wl.requests)


def test_the_simulated_server_learns_the_share_as_the_server_does() -> None:
    from superinfer_sgl.sim.engine import SimConfig, Simulator
    from superinfer_sgl.sim.policies import make_policy
    from superinfer_sgl.sim.profile import resolve_profile
    from superinfer_sgl.sim.runner import build_workload

    wl = build_workload("sharegpt-like", 4.0, 20.0, 3).with_max_new_tokens(1024)
    profile = resolve_profile("gh200-qwen2.5-32b")
    sim = Simulator(wl, profile, make_policy("goodput"), SimConfig(ignore_eos=False, mixed_chunk=True)).run()
    asked = sum(min(r.max_new_tokens, 4096) for r in wl.requests)
    assert sim.output_share.seen == len(wl.requests)
    # exponentially weighted: near the plain ratio of sums on a stationary workload
    assert sim.output_share.share == pytest.approx(sum(r.output_tokens for r in wl.requests) / asked, rel=0.35)
    fixed = Simulator(build_workload("sharegpt-like", 4.0, 20.0, 3), profile, make_policy("goodput"),
                      SimConfig(mixed_chunk=True)).run()
    assert fixed.output_share.seen == 0  # fixed-length requests teach nothing
