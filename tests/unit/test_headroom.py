"""Headroom figures for routers/autoscalers (rotasched.headroom) on hand-built views."""

from __future__ import annotations

import pytest

from superinfer_sgl.rotasched import ReqState, ReqView, VltParams
from superinfer_sgl.rotasched.goodput import GoodputParams, StepCosts
from superinfer_sgl.rotasched.headroom import AttainmentWindow, Headroom, headroom

NOW = 1000.0
W, RUN, ROT = ReqState.WAITING, ReqState.RUNNING, ReqState.ROTARY
# 1 ms per prefill token, 20 ms decode steps: a 1000-token prompt takes ~1 s to its first token.
GP = GoodputParams(StepCosts(1e-3, 0.0, 0.02, 0.0), max_best_effort_wait_s=30.0)
P = VltParams(alpha=3.0, beta_ttft=0.5, beta_tbt=0.0)


def waiting(rid: str, waited: float, tokens: int = 100, ttft: float = 5.0) -> ReqView:
    return ReqView(rid, W, NOW - waited, None, None, ttft, 0.1, 1, 0, True, tokens)


def rotary(rid: str, paused: float, misses_left: int = 3, tbt: float = 0.1) -> ReqView:
    return ReqView(rid, ROT, NOW - 10, NOW - paused, None, 5.0, tbt, 1, 0, True, 0, misses_left, True)


def running(rid: str, misses_left: int = 3, ttft_met: bool = True) -> ReqView:
    return ReqView(rid, RUN, NOW - 10, NOW - 0.01, NOW - 1, 5.0, 0.1, 0, 1, True, 0, misses_left, ttft_met)


def test_empty_server_has_full_headroom() -> None:
    assert headroom([], NOW, P, GP) == Headroom(0.0, 0, 0, 0, 0, 0)


def test_vlt_max_is_the_largest_queued_lag_and_ignores_running() -> None:
    # waiting 4 s with a 5 s TTFT SLO and beta_ttft 0.5: 4 - 2.5 = 1.5 s past its slack; rotary,
    # its last token 0.6 s ago, beta_tbt 0: 0.6 s (the scheduler's VLT weighs it by alpha 3, 1.8;
    # the gauge is in seconds whatever --vlt-alpha is)
    h = headroom([waiting("w", 4.0), rotary("r", 0.6), running("x")], NOW, P, GP)
    assert h.vlt_max_s == pytest.approx(1.5)
    assert (h.waiting, h.rotary) == (1, 1)
    assert headroom([waiting("w", 4.0), rotary("r", 2.0)], NOW, P, GP).vlt_max_s == pytest.approx(2.0)
    h = headroom([waiting("w", 4.0), waiting("fresh", 1.0)], NOW, P, GP)
    assert h.vlt_max_s == pytest.approx(1.5)


def test_within_slack_is_zero_vlt() -> None:
    assert headroom([waiting("w", 2.0)], NOW, P, GP).vlt_max_s == 0.0  # 2 s < 0.5 x 5 s


def test_at_risk_follows_the_goodput_tiers() -> None:
    views = [
        waiting("ok", 1.0, tokens=100),  # 4 s left, needs ~0.12 s: viable
        waiting("late", 4.5, tokens=1000),  # 0.5 s left, needs ~1 s: cannot make it
        waiting("expired", 6.0),  # past its TTFT deadline
        rotary("keeps", 0.05, misses_left=2),  # still has gaps to spare
        rotary("tbt_lost", 0.05, misses_left=-1),
        running("fine"), running("lost", misses_left=-1), running("late_first", ttft_met=False),
    ]
    h = headroom(views, NOW, P, GP)
    assert (h.at_risk_waiting, h.at_risk_rotary, h.at_risk) == (2, 1, 3)
    assert h.lost_running == 2
    assert (h.waiting, h.rotary) == (3, 2)


def test_at_risk_uses_the_measured_prefill_cost() -> None:
    slow = GoodputParams(StepCosts(1e-2, 0.0, 0.02, 0.0))  # 10 ms per token: 100 tokens ~1 s
    v = [waiting("w", 3.5, tokens=100)]  # 1.5 s left
    assert headroom(v, NOW, P, GP).at_risk == 0
    slower = GoodputParams(StepCosts(2e-2, 0.0, 0.02, 0.0))  # 2 s of prefill: too late
    assert headroom(v, NOW, P, slow).at_risk == 0
    assert headroom(v, NOW, P, slower).at_risk == 1


def test_attainment_window_per_class_and_slo() -> None:
    w = AttainmentWindow(size=3)
    w.add("interactive", True, True)
    w.add("interactive", False, True)
    w.add(None, True, None)  # one output token: no TBT verdict, so no joint verdict either
    got = w.attainment()
    assert got[("interactive", "ttft")] == (1, 2)
    assert got[("interactive", "tbt")] == (2, 2)
    assert got[("interactive", "joint")] == (1, 2)
    assert got[("default", "ttft")] == (1, 1)
    assert ("default", "tbt") not in got and ("default", "joint") not in got


def test_attainment_window_forgets_beyond_its_size() -> None:
    w = AttainmentWindow(size=2)
    for met in (False, False, True, True):
        w.add("batch", met, met)
    assert w.attainment()[("batch", "joint")] == (2, 2)  # the two misses slid out
    w.add("batch", False, True)
    assert w.attainment()[("batch", "joint")] == (1, 2)
    with pytest.raises(ValueError):
        AttainmentWindow(size=0)


def test_a_paused_request_out_of_spare_gaps_is_at_risk_once_its_pause_outlasts_its_tbt() -> None:
    """Its open gap is not counted in `misses_left` yet, but its next token is certainly a miss
    (a review of 2026-12-03)."""
    assert headroom([rotary("r", 0.05, misses_left=0)], NOW, P, GP).at_risk_rotary == 0  # within 0.1 s
    assert headroom([rotary("r", 5.0, misses_left=0)], NOW, P, GP).at_risk_rotary == 1
    assert headroom([rotary("r", 5.0, misses_left=2)], NOW, P, GP).at_risk_rotary == 0  # gaps to spare
