"""VLT formulas, hand-worked."""

from __future__ import annotations

import math

import pytest

from superinfer_sgl.rotasched import ReqState, ReqView, VltParams, vlt

NOW = 100.0


def view(state: ReqState, **kw: object) -> ReqView:
    fields: dict[str, object] = dict(
        rid="r", state=state, arrival=90.0, last_token=None, run_start=None,
        ttft_slo=5.0, tbt_slo=0.1, blocks_needed=0, blocks_held=0,
    )
    if state is ReqState.RUNNING:
        fields.update(run_start=98.0, last_token=99.9, blocks_held=4)
    elif state is ReqState.ROTARY:
        fields.update(last_token=99.0, blocks_needed=4)
    else:
        fields.update(blocks_needed=4)
    fields.update(kw)
    return ReqView(**fields)  # type: ignore[arg-type]


def test_defaults_are_the_papers() -> None:
    p = VltParams()
    assert (p.alpha, p.beta_ttft, p.beta_tbt) == (3.0, 0.5, 0.0)


def test_waiting_past_half_its_ttft() -> None:
    # Arrived 4 s ago, TTFT 5 s, beta 0.5: 4 - 2.5 = 1.5.
    assert vlt(view(ReqState.WAITING, arrival=96.0), NOW, VltParams()) == pytest.approx(1.5)


def test_waiting_within_slack_is_zero() -> None:
    # Arrived 1 s ago, slack 2.5 s: clamped at 0, never negative.
    assert vlt(view(ReqState.WAITING, arrival=99.0), NOW, VltParams()) == 0.0


def test_waiting_beta_zero_is_its_age() -> None:
    p = VltParams(beta_ttft=0.0)
    assert vlt(view(ReqState.WAITING, arrival=97.5), NOW, p) == pytest.approx(2.5)


def test_rotary_is_alpha_times_pause() -> None:
    # Last token 0.3 s ago, alpha 3, beta_tbt 0: 3 * 0.3 = 0.9.
    assert vlt(view(ReqState.ROTARY, last_token=99.7), NOW, VltParams()) == pytest.approx(0.9)


def test_rotary_with_tbt_slack() -> None:
    # Last token 0.3 s ago, TBT 0.1 s, beta_tbt 1, alpha 2: 2 * (0.3 - 0.1) = 0.4.
    p = VltParams(alpha=2.0, beta_tbt=1.0)
    assert vlt(view(ReqState.ROTARY, last_token=99.7), NOW, p) == pytest.approx(0.4)
    # Still within its TBT slack: 0.
    assert vlt(view(ReqState.ROTARY, last_token=99.95), NOW, p) == 0.0


def test_running_is_minus_its_stint() -> None:
    assert vlt(view(ReqState.RUNNING, run_start=98.0), NOW, VltParams()) == pytest.approx(-2.0)


def test_running_just_started_is_zero_not_negative() -> None:
    lag = vlt(view(ReqState.RUNNING, run_start=NOW), NOW, VltParams())
    assert lag == 0.0 and not math.copysign(1.0, lag) < 0


def test_waiting_with_output_uses_rotary_formula() -> None:
    # Recompute fallback: waiting again, last token 0.5 s ago -> 3 * 0.5, not its age.
    v = view(ReqState.WAITING, arrival=90.0, last_token=99.5)
    assert vlt(v, NOW, VltParams()) == pytest.approx(1.5)


def test_alpha_scales_rotary_against_waiting() -> None:
    rot = view(ReqState.ROTARY, last_token=99.0)
    assert vlt(rot, NOW, VltParams(alpha=1.0)) == pytest.approx(1.0)
    assert vlt(rot, NOW, VltParams(alpha=5.0)) == pytest.approx(5.0)


@pytest.mark.parametrize(
    "kw",
    [
        {"alpha": 0.0}, {"alpha": -1.0}, {"alpha": math.inf}, {"alpha": math.nan},
        {"beta_ttft": -0.1}, {"beta_tbt": -0.1}, {"beta_ttft": math.nan}, {"beta_tbt": math.inf},
    ],
)
def test_params_rejected(kw: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        VltParams(**kw)


def test_params_zero_betas_allowed() -> None:
    VltParams(alpha=0.5, beta_ttft=0.0, beta_tbt=0.0)


@pytest.mark.parametrize(
    "state, kw",
    [
        (ReqState.WAITING, {"blocks_needed": -1}),
        (ReqState.RUNNING, {"blocks_held": -1}),
        (ReqState.WAITING, {"ttft_slo": 0.0}),
        (ReqState.WAITING, {"tbt_slo": -1.0}),
        (ReqState.WAITING, {"ttft_slo": math.nan}),
        (ReqState.WAITING, {"run_start": 1.0}),
        (ReqState.RUNNING, {"run_start": None}),
        (ReqState.RUNNING, {"blocks_needed": 3}),
        (ReqState.ROTARY, {"blocks_held": 3}),
        (ReqState.ROTARY, {"last_token": None}),
        (ReqState.WAITING, {"rid": ""}),
    ],
)
def test_view_invariants(state: ReqState, kw: dict[str, object]) -> None:
    with pytest.raises(AssertionError):
        view(state, **kw)
