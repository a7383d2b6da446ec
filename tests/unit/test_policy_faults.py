"""Faults a review of the policy layer reproduced: each test fails on the code before its fix."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer_sgl.rotasched.clock import ReqClock
from superinfer_sgl.rotasched.costs import StepCosts
from superinfer_sgl.rotasched.goodput import GoodputLvf, GoodputParams, rotation_affordable
from superinfer_sgl.rotasched.planner import plan_step
from superinfer_sgl.rotasched.request_view import ReqState, ReqView
from superinfer_sgl.rotasched.shedding import shed
from superinfer_sgl.rotasched.slo import Slo, SloClasses, SloError, looks_like_slo_key
from superinfer_sgl.rotasched.step_size import prefill_cap, prefill_time_s, spare_misses
from superinfer_sgl.rotasched.views import ViewRules
from superinfer_sgl.rotasched.vlt import VltParams

RULES = ViewRules(block_tokens=16, running_share=0.4)
GP = GoodputParams(StepCosts(1e-4, 0.0, 0.02, 0.0), max_best_effort_wait_s=60.0)


def _running(rid: str, now: float, outputs_left: int = 50, fixed: bool = False) -> ReqView:
    clk = ReqClock(rid, arrival=now - 0.5, slo=Slo(5000, 100))
    clk.first_token = clk.last_token = now - 0.05
    clk.outputs_seen, clk.state, clk.run_start = 5, ReqState.RUNNING, now - 0.4
    return RULES.running(clk, seqlen=100, outputs_left=outputs_left, ratio=1.0, rotatable=True, fixed=fixed)


def _paused(rid: str, paused_at: float) -> ReqView:
    clk = ReqClock(rid, arrival=0.0, slo=Slo(5000, 100))
    clk.first_token = clk.last_token = paused_at
    clk.outputs_seen, clk.state = 10, ReqState.ROTARY
    return RULES.rotary(clk, host_tokens=200, outputs_left=4000, ratio=1.0)  # 263 blocks, 13 of them KV


def _waiting(rid: str, now: float, prompt: int) -> ReqView:
    clk = ReqClock(rid, arrival=now, slo=Slo(5000, 100))
    return RULES.waiting(clk, prompt, 0, 0, 16, 1.0)


def test_a_promoted_resume_over_the_whole_budget_goes_alone_under_contention() -> None:
    """Its need counts a decode reserve never copied; over the budget, it was skipped every step
    and came back only once nothing at all ran, past the best-effort wait bound."""
    now, budget = 400.0, 256
    views = [_running("run", now), _paused("paused", paused_at=now - 100.0), _waiting("w", now, 2000)]
    assert views[1].blocks_needed > budget
    d = plan_step(views, 300, budget, now, VltParams(), GoodputLvf(GP), chunked_active=False)
    assert d.contention and d.resume == ("paused",)
    # not yet past its bound: skipped, as before (over the budget, it does not block the scan)
    views[1] = _paused("paused", paused_at=now - 1.0)
    d = plan_step(views, 300, budget, now, VltParams(), GoodputLvf(GP), chunked_active=False)
    assert d.resume == () and d.blocked is None


def test_a_fixed_length_request_past_the_clip_keeps_its_gap_budget() -> None:
    """Past 4,096 outputs left it lost `outputs_known`: no gap to spare, so it capped every mixed
    step's prefill and blocked rotations, though its gap budget is exact."""
    costs = StepCosts(prefill_s_per_token=2e-4, prefill_base_s=0.005, decode_step_s=0.03, rotation_s=0.08)
    for left in (4096, 4097, 6000):
        v = _running("r", 10.0, outputs_left=left, fixed=True)
        assert v.outputs_known and spare_misses(v) == v.misses_left > 400
        assert prefill_cap([v], costs) is None and rotation_affordable([v], costs)


NOW = 100.0
COSTS = StepCosts(prefill_s_per_token=0.001, prefill_base_s=0.002, decode_step_s=0.003, rotation_s=0.0)
SHARE = 0.001


def _wait_view(i: int, ttft: float, prompt: int, outs: int, known: bool, weight: float, ago: float) -> ReqView:
    return ReqView(f"r{i}", ReqState.WAITING, NOW - ago, None, None, ttft, 0.1, 1, 0, True, prompt,
                   weight=weight, outputs_left=outs, outputs_known=known)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 2.0), st.integers(1, 500), st.integers(0, 400), st.booleans(),
                          st.sampled_from((0.5, 1.0, 2.0, 8.0)), st.floats(0.0, 0.5)), min_size=1, max_size=14),
       st.sampled_from((None, 64, 256)))
def test_every_request_shedding_keeps_gets_its_first_token_in_time(rows: list, chunk: int | None) -> None:
    """Moore and Hodgson's one removal per late request made it on time only without weights and
    decode shares: with them a late request could stay while an on-time one was shed."""
    views = sorted((_wait_view(i, *r) for i, r in enumerate(rows)), key=lambda v: (v.arrival + v.ttft_slo, v.rid))
    out = shed(views, NOW, COSTS, chunk, SHARE, 64)
    tokens, outputs = 0, 0.0
    for v in views:
        if v.rid in out:
            continue
        tokens += v.prefill_tokens
        first = NOW + prefill_time_s(tokens, COSTS, chunk) + SHARE * outputs + COSTS.decode_step_s
        assert first <= v.arrival + v.ttft_slo + 1e-9, (v.rid, first, sorted(out))
        outputs += v.outputs_left if v.outputs_known else 0.0


def test_shedding_keeps_the_on_time_ones_when_one_removal_would_not_do() -> None:
    a = _wait_view(0, 0.31, 300, 0, True, 1.0, 0.0)
    p = _wait_view(1, 0.31, 10, 280, True, 1.0, 0.0)  # a decode share delays those behind it, not itself
    v = _wait_view(2, 0.31, 200, 0, True, 1.0, 0.0)
    assert shed([a, p, v], NOW, StepCosts(0.001, 0.0, 0.0, 0.0), None, SHARE, 64) == {"r2"}


@pytest.mark.parametrize("key", ["SLOClass", "TTFTSloMs", "SLOTtftMs", "TBTSLOMs", "TpotMs"])
def test_acronym_spellings_of_slo_keys_are_caught(key: str) -> None:
    assert looks_like_slo_key(key)


@pytest.mark.parametrize("key", ["slot_id", "SLOTId", "isolation", "thinking_budget", "HTTPTimeout"])
def test_other_keys_still_pass(key: str) -> None:
    assert not looks_like_slo_key(key)


@pytest.mark.parametrize("weight", [1e-310, 1e-4, 1e4, 1e308])
def test_class_weights_out_of_range_are_refused(weight: float) -> None:
    """Near the float range's ends a weight ranked its class at +-inf, out of deadline order."""
    with pytest.raises(SloError, match=r"a\.weight.*within 0\.001\.\.1000"):
        SloClasses.parse(f'{{"a": {{"ttft_ms": 5, "weight": {weight!r}}}}}', default=Slo(5000, 100))
    assert SloClasses.parse('{"a": {"ttft_ms": 5, "weight": 1000}}', default=Slo(5000, 100))
