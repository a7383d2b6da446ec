"""Per-request clocks: TTFT from arrival, TBT gaps against the SLO, running stints, meta_info.

Times are exact binary fractions so that SLO boundaries are exact.
"""

from __future__ import annotations

import pytest

from superinfer_sgl.rotasched import ReqState, Slo
from superinfer_sgl.rotasched.clock import TBT_MET_SHARE, ReqClock

SLO = Slo(ttft_ms=500, tbt_ms=100)


def _clock(arrival: float = 10.0) -> ReqClock:
    return ReqClock("r1", arrival, SLO)


def test_fresh_clock_has_no_outcomes() -> None:
    clk = _clock()
    assert clk.state is ReqState.WAITING and clk.run_start is None
    assert clk.ttft_met is None and clk.tbt_share_met is None and clk.tbt_met is None
    assert (clk.gaps, clk.gaps_missed, clk.outputs_seen) == (0, 0, 0)


@pytest.mark.parametrize(("first", "met"), [(10.25, True), (10.5, True), (10.5078125, False), (12.0, False)])
def test_ttft_relative_to_arrival(first: float, met: bool) -> None:
    clk = _clock(arrival=10.0)
    clk.observe_outputs(1, first)
    assert clk.first_token == clk.last_token == first
    assert clk.ttft_met is met
    assert clk.gaps == 0 and clk.tbt_met is None  # one token: no gap yet


def test_tbt_gaps_counted_and_missed() -> None:
    clk = _clock()
    clk.observe_outputs(1, 10.0)
    clk.observe_outputs(2, 10.0625)  # 62.5 ms: met
    clk.observe_outputs(3, 10.1625 + 0.0000001)  # just over 100 ms: missed
    clk.observe_outputs(4, 10.25)  # under 100 ms again
    assert (clk.gaps, clk.gaps_missed) == (3, 1)
    assert clk.max_gap == pytest.approx(0.1000001)
    assert clk.tbt_share_met == pytest.approx(2 / 3)
    assert clk.tbt_met is False
    assert clk.outputs_seen == 4 and clk.last_token == 10.25


def test_gap_exactly_at_slo_is_met() -> None:
    clk = ReqClock("r", 0.0, Slo(ttft_ms=500, tbt_ms=125))
    clk.observe_outputs(1, 1.0)
    clk.observe_outputs(2, 1.125)
    assert (clk.gaps, clk.gaps_missed) == (1, 0)


def test_several_tokens_at_once_are_zero_length_gaps() -> None:
    clk = _clock()
    clk.observe_outputs(1, 10.0)
    clk.observe_outputs(5, 10.5)  # one 500 ms gap (missed), then three zero-length gaps
    assert (clk.gaps, clk.gaps_missed) == (4, 1)
    assert clk.max_gap == 0.5
    assert clk.tbt_share_met == 0.75
    assert clk.outputs_seen == 5


def test_first_observation_with_several_tokens() -> None:
    clk = _clock(arrival=10.0)
    clk.observe_outputs(3, 10.25)
    assert clk.first_token == 10.25 and clk.ttft_met is True
    assert (clk.gaps, clk.gaps_missed) == (2, 0)
    assert clk.tbt_share_met == 1.0 and clk.tbt_met is True


def test_no_new_tokens_is_a_no_op() -> None:
    clk = _clock()
    clk.observe_outputs(0, 10.0)
    assert clk.first_token is None
    clk.observe_outputs(2, 10.0)
    snapshot = (clk.gaps, clk.gaps_missed, clk.last_token, clk.outputs_seen)
    clk.observe_outputs(2, 99.0)
    clk.observe_outputs(1, 99.0)
    assert (clk.gaps, clk.gaps_missed, clk.last_token, clk.outputs_seen) == snapshot


def test_tbt_met_threshold() -> None:
    clk = _clock()
    clk.observe_outputs(1, 0.0)
    t = 0.0
    for n in range(2, 12):  # 10 gaps, the last one missed: 90 % met
        t += 0.5 if n == 11 else 0.0625
        clk.observe_outputs(n, t)
    assert clk.gaps == 10 and clk.gaps_missed == 1
    assert clk.tbt_share_met == pytest.approx(TBT_MET_SHARE) and clk.tbt_met is True
    clk.observe_outputs(12, t + 0.5)  # 2 of 11 missed
    assert clk.tbt_met is False


def test_set_state_run_start() -> None:
    clk = _clock()
    clk.set_state(ReqState.RUNNING, 11.0)
    assert clk.state is ReqState.RUNNING and clk.run_start == 11.0
    clk.set_state(ReqState.RUNNING, 12.0)  # still the same stint
    assert clk.run_start == 11.0
    clk.set_state(ReqState.ROTARY, 13.0)
    assert clk.state is ReqState.ROTARY and clk.run_start is None
    clk.set_state(ReqState.ROTARY, 13.5)
    assert clk.run_start is None
    clk.set_state(ReqState.RUNNING, 14.0)  # a new stint
    assert clk.run_start == 14.0
    clk.set_state(ReqState.WAITING, 15.0)
    assert clk.state is ReqState.WAITING and clk.run_start is None


def test_set_state_waiting_never_sets_run_start() -> None:
    clk = _clock()
    clk.set_state(ReqState.WAITING, 11.0)
    assert clk.run_start is None


def test_meta_info() -> None:
    clk = ReqClock("r", 0.0, SLO, slo_class="interactive")
    clk.rotations, clk.recomputes = 2, 1
    clk.observe_outputs(1, 0.25)
    clk.observe_outputs(2, 0.5)
    assert clk.meta_info() == {
        "superinfer_rotations": 2,
        "superinfer_recomputes": 1,
        "superinfer_slo_class": "interactive",
        "superinfer_ttft_slo_ms": 500.0,
        "superinfer_tbt_slo_ms": 100.0,
        "superinfer_ttft_slo_met": True,
        "superinfer_tbt_slo_met": False,
        "superinfer_tbt_gaps_met_share": 0.0,
    }


def test_meta_info_before_any_token() -> None:
    info = _clock().meta_info()
    assert info["superinfer_slo_class"] is None
    assert info["superinfer_ttft_slo_met"] is None and info["superinfer_tbt_slo_met"] is None
    assert info["superinfer_tbt_gaps_met_share"] is None


def test_server_clocks_of_a_kept_batch_follow_drops_and_finishes() -> None:
    """integration.clocks.Clocks.observe reuses the last step's clocks while the running batch is
    the same objects; a dropped (aborted) or finished clock must not be written to afterwards."""
    from fakes import FakeReq, sampling
    from superinfer_sgl.config import SuperInferConfig
    from superinfer_sgl.integration.clocks import Clocks, step_prior

    clocks = Clocks(SuperInferConfig(), step_prior(True))
    a, b = (FakeReq(rid, [1, 2], [], sampling_params=sampling(8)) for rid in ("a", "b"))
    batch = [a, b]
    clocks.observe(batch, [], 1.0)
    first = clocks.by_rid["a"]
    a.output_ids.append(5)
    clocks.observe(batch, [], 1.1)  # the same batch: the clocks found last time
    assert clocks.by_rid["a"] is first and first.outputs_seen == 1
    clocks.drop(lambda rid: rid == "a")  # an abort: a's clock goes
    a.output_ids.append(6)
    clocks.observe(batch, [], 1.2)  # the same objects, but a's clock is a new one
    assert clocks.by_rid["a"] is not first and first.outputs_seen == 1
    assert clocks.by_rid["a"].outputs_seen == 2
    done = clocks.finish(b, 1.3)
    clocks.observe(batch, [], 1.4)
    assert done is not None and clocks.by_rid["b"] is not done


def test_server_clocks_learn_the_output_share_of_requests_that_may_stop_at_eos() -> None:
    """integration.clocks.Clocks.finish feeds OutputShare only with requests whose length was
    unknown (not ignore_eos) and that ended on their own: not aborted, not SGLang's own (the
    runtime passes metrics.metered as `client`)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH

    from fakes import FakeReq, sampling
    from superinfer_sgl.config import SuperInferConfig
    from superinfer_sgl.integration.clocks import Clocks, step_prior
    from superinfer_sgl.rotasched.output_share import MIN_FINISHED

    clocks = Clocks(SuperInferConfig(), step_prior(True), clip=100)

    def end(rid: str, outputs: int, max_new: int, ignore_eos: bool = False, reason: object = None) -> None:
        req = FakeReq(rid, [1, 2], [7] * outputs, sampling_params=sampling(max_new, ignore_eos=ignore_eos))
        req.finished_reason = reason
        clocks.finish(req, 1.0)

    for i in range(MIN_FINISHED - 1):
        end(f"r{i}", 20, 80)
    assert clocks.outputs.share == 0.0  # not enough seen yet: prompts only
    end("fixed", 80, 80, ignore_eos=True)  # a known length teaches nothing
    end("gone", 1, 80, reason=FINISH_ABORT("client left"))
    clocks.finish(FakeReq("probe", [1], [7], sampling_params=sampling(1, ignore_eos=False)), 1.0, client=False)
    assert clocks.outputs.seen == MIN_FINISHED - 1
    end("last", 20, 400, reason=FINISH_LENGTH(400))  # 400 asked, clipped as the reserve is: 100
    assert clocks.outputs.seen == MIN_FINISHED
    assert 0.2 < clocks.outputs.share < 0.25  # 20 of 80 (then 20 of the clip's 100)
