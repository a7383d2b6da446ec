"""Goodput mode of LVF on hand-built views: demotion, queueing, the starvation bound, class
weights, victims and the rotation cost gate; plus its invariants over random views, the clock's
gap budget, the cost meter and the shared planner's admission order."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer_sgl.rotasched import Decision, ReqState, ReqView, Slo, VltParams, lvf_decide
from superinfer_sgl.rotasched.costs import CostMeter
from superinfer_sgl.rotasched.goodput import MIN_PREFILL_CHUNK, GoodputLvf, GoodputParams, StepCosts, rank_key
from superinfer_sgl.rotasched.planner import admission_order, quantum_s, rotation_budget
from superinfer_sgl.rotasched.policy import BEST_EFFORT, PAPER, VIABLE
from superinfer_sgl.rotasched.clock import ReqClock
from test_lvf_properties import NOW, _params, _views, check_invariants

W, RUN, ROT = ReqState.WAITING, ReqState.RUNNING, ReqState.ROTARY
# 1 ms per prefill token, 20 ms decode steps, rotations free: a 1000-token prompt takes ~1 s.
COSTS = StepCosts(prefill_s_per_token=1e-3, prefill_base_s=0.0, decode_step_s=0.02, rotation_s=0.0)
GP = GoodputParams(COSTS, max_best_effort_wait_s=30.0)
P = VltParams()


def waiting(rid: str, waited: float, tokens: int = 100, ttft: float = 5.0, blocks: int = 10,
            weight: float = 1.0) -> ReqView:
    return ReqView(rid, W, NOW - waited, None, None, ttft, 0.1, blocks, 0, True, tokens, weight=weight)


def running(rid: str, stint: float, blocks: int = 10, misses_left: int = 5, ttft_met: bool = True,
            tbt: float = 0.1, known: bool = True) -> ReqView:
    """A running request, by default of known length (its gap budget exact)."""
    return ReqView(rid, RUN, NOW - stint - 1, NOW - 0.01, NOW - stint, 5.0, tbt, 0, blocks, True, 0,
                   misses_left, ttft_met, outputs_left=100, outputs_known=known)


def test_a_request_that_cannot_make_its_ttft_yields_to_one_that_can() -> None:
    # Both urgent (VLT > 0); only 10 blocks free. The older one has 4.5 s of its 5 s gone and a
    # 1000-token prompt (1 s): LVF's paper rule serves it, goodput serves the one that can still win.
    views = [waiting("late", 4.5, tokens=1000), waiting("ontime", 3.0), running("r", 1.0)]
    assert lvf_decide(views, 10, 0, NOW, P).admit == ("late",)
    d = lvf_decide(views, 10, 0, NOW, P, GoodputLvf(GP))
    assert d.admit == ("ontime",) and d.blocked == "late"  # best-effort now, first in its queue


def test_best_effort_takes_only_free_memory_and_never_displaces() -> None:
    views = [waiting("lost", 10.0, blocks=30), waiting("ok", 3.0, blocks=5), running("r", 9.0)]
    d = lvf_decide(views, 20, 0, NOW, P, GoodputLvf(GP))
    assert d.admit == ("ok",) and d.rotate_out == ()
    # Even with a lost running request to rotate out and the budget to do it.
    views.append(running("gone", 9.0, blocks=40, ttft_met=False))
    d = lvf_decide(views, 20, 100, NOW, P, GoodputLvf(GP))
    assert d.admit == ("ok",) and d.rotate_out == ()


def test_best_effort_requests_go_longest_output_first_in_a_queue() -> None:
    # Two lost requests and a viable one, short of memory. The viable one first; then the longest
    # remaining output (it sets when the work ends); a shorter one behind it may not take the
    # memory it waits for, however small; equal outputs (clipped alike): the oldest first.
    def lost(rid: str, waited: float, left: int, blocks: int) -> ReqView:
        return ReqView(rid, W, NOW - waited, None, None, 5.0, 0.1, blocks, 0, True, 100, outputs_left=left)
    short, long_ = lost("short", 20.0, 50, 5), lost("long", 8.0, 2000, 10)
    views = [short, long_, waiting("ok", 1.0, blocks=10), running("r", 9.0, blocks=40)]
    d = lvf_decide(views, 24, 0, NOW, P, GoodputLvf(GP))
    assert d.admit == ("ok", "long") and d.blocked == "short"
    d = lvf_decide(views, 15, 0, NOW, P, GoodputLvf(GP))
    assert d.admit == ("ok",) and d.blocked == "long"
    assert admission_order(["short", "long", "ok"], [], d) == ["ok", "long"]
    a, b = lost("a", 9.0, 4096, 10), lost("b", 12.0, 4096, 10)
    assert lvf_decide([a, b, running("r", 9.0, blocks=40)], 10, 0, NOW, P, GoodputLvf(GP)).admit == ("b",)
    # A head that could never fit (more than free plus all running requests hold) is skipped.
    huge = lost("huge", 8.0, 3000, 100)
    assert lvf_decide([huge, short, running("r", 9.0, blocks=40)], 10, 0, NOW, P, GoodputLvf(GP)).admit == ("short",)


def test_queue_ahead_counts_prefills_already_chosen() -> None:
    # Each alone could finish in time (1.5 s prefill, 2 s left); behind the first, the second can't.
    a = waiting("a", 3.0, tokens=1500)
    b = waiting("b", 2.99, tokens=1500)
    d = lvf_decide([a, b, running("r", 1.0)], 20, 0, NOW, P, GoodputLvf(GP))
    assert d.admit == ("a", "b")  # b still gets free memory, as best-effort, after everyone viable
    c = waiting("c", 1.0, tokens=100, blocks=10)  # viable, ranked below b by VLT
    d = lvf_decide([a, b, c, running("r", 1.0)], 20, 0, NOW, P, GoodputLvf(GP))
    assert d.admit == ("a", "c")


def test_a_capped_prefill_counts_one_decode_step_per_chunk() -> None:
    from superinfer_sgl.rotasched.goodput import prefill_time_s, ttft_reachable
    costs = StepCosts(prefill_s_per_token=1e-3, prefill_base_s=0.01, decode_step_s=0.05, rotation_s=0.0)
    assert math.isclose(prefill_time_s(300, costs, None), 0.01 + 0.3)  # uncapped: one step
    assert math.isclose(prefill_time_s(300, costs, 100), 3 * 0.01 + 2 * 0.05 + 0.3)
    assert math.isclose(prefill_time_s(300, costs, 512), prefill_time_s(300, costs, None))
    # 0.4 s left: 300 tokens in one step (0.31 s + the 0.05 s stream step) make it, three capped
    # chunks (0.43 s) do not; 100 tokens ahead push even the uncapped prefill out.
    v = waiting("v", 4.6, tokens=300)
    assert ttft_reachable(v, NOW, 0, costs) and not ttft_reachable(v, NOW, 0, costs, 100)
    assert not ttft_reachable(v, NOW, 100, costs)


def test_the_steps_prefill_cap_decides_who_can_still_make_it() -> None:
    # A running request with no gap to spare caps this step's prefill at its floor, so a
    # 300-token prompt takes ten capped steps, not one: it can no longer make its TTFT.
    import dataclasses

    from superinfer_sgl.rotasched.planner import plan_step
    costs = StepCosts(prefill_s_per_token=1e-3, prefill_base_s=0.0, decode_step_s=0.06, rotation_s=0.0)
    gp = GoodputParams(costs, max_best_effort_wait_s=30.0)
    tight = running("t", 1.0, misses_left=0, tbt=0.1, blocks=10)
    late, fresh = waiting("late", 4.4, tokens=300, blocks=10), waiting("fresh", 1.0, tokens=300, blocks=10)
    d = plan_step([late, fresh, tight], 10, 0, NOW, P, GoodputLvf(gp), False, mix_prefill="needed")
    assert d.prefill_cap == MIN_PREFILL_CHUNK and d.admit == ("fresh",) and d.mix
    # a request that may stop at EOS counts its budget against max_new_tokens, which it may never
    # reach: protected as if it had no gap to spare (step_size.spare_misses)
    open_ended = running("t", 1.0, misses_left=5, tbt=0.1, blocks=10, known=False)
    d = plan_step([late, fresh, open_ended], 10, 0, NOW, P, GoodputLvf(gp), False, mix_prefill="needed")
    assert d.prefill_cap == MIN_PREFILL_CHUNK and d.admit == ("fresh",)
    # ... unless finished requests of unknown length have been decoding nearly all they asked for
    bounded = GoodputLvf(dataclasses.replace(gp, eos_output_share=0.95))
    assert plan_step([late, fresh, open_ended], 10, 0, NOW, P, bounded, False).prefill_cap != MIN_PREFILL_CHUNK
    lost_ = running("t", 1.0, misses_left=-1, tbt=0.1, blocks=10, known=False)  # lost: nothing to protect
    assert plan_step([late, fresh, lost_], 10, 0, NOW, P, GoodputLvf(gp), False).prefill_cap != MIN_PREFILL_CHUNK
    roomy = running("t", 1.0, misses_left=5, tbt=0.1, blocks=10)  # gaps to spare: no TBT cap,
    d = plan_step([late, fresh, roomy], 10, 0, NOW, P, GoodputLvf(gp), False, mix_prefill="needed")
    # only late's own deadline (0.6 s left: one step of at most ~540 tokens, deadline_budget);
    # mixed while fresh waits (a mixed step saves the running batch a decode step: throughput)
    assert d.prefill_cap in (539, 540) and d.admit == ("late",) and d.mix
    # nobody left waiting and nobody running needs it: the prefill runs alone
    d = plan_step([late, roomy], 10, 0, NOW, P, GoodputLvf(gp), False, mix_prefill="needed")
    assert d.prefill_cap in (539, 540) and d.admit == ("late",) and not d.mix
    assert plan_step([late, roomy], 10, 0, NOW, P, GoodputLvf(gp), False).mix  # the default: always
    assert plan_step([late, tight], 10, 0, NOW, P, GoodputLvf(gp), False, mix_prefill="needed").mix
    # a decode step of 80 ms: even the floor's step (112 ms) breaks the 100 ms TBT, so capping
    # protects nobody: as with gaps to spare
    slow = GoodputLvf(dataclasses.replace(gp, costs=dataclasses.replace(costs, decode_step_s=0.08)))
    d = plan_step([late, tight], 10, 0, NOW, P, slow, False)
    assert d.prefill_cap in (519, 520) and d.admit == ("late",) and d.mix


def test_starvation_bound_promotes_a_best_effort_request_to_the_head_of_the_line() -> None:
    old = waiting("old", 31.0, blocks=15)  # lost long ago, past the 30 s bound
    views = [old, waiting("ok", 3.0, blocks=5), running("r", 1.0, blocks=40)]
    d = lvf_decide(views, 10, 0, NOW, P, GoodputLvf(GP))
    assert d.admit == () and d.blocked == "old"  # nobody takes the memory it waits for
    assert lvf_decide(views, 20, 0, NOW, P, GoodputLvf(GP)).admit == ("old", "ok")
    young = GoodputParams(COSTS, max_best_effort_wait_s=math.inf)
    assert lvf_decide(views, 10, 0, NOW, P, GoodputLvf(young)).admit == ("ok",)


def test_earliest_deadline_first_across_classes() -> None:
    # Scarce memory: a loose request past half its TTFT SLO (VLT 0.5 s, 2.5 s of slack left)
    # and a fresh tight one (VLT 0, 1.3 s left). LVF serves the one with the larger lag; goodput
    # the one whose deadline comes first, which the loose one can still afford to wait behind.
    loose = waiting("loose", 3.0, ttft=5.5)
    tight = waiting("tight", 0.2, ttft=1.5)
    views = [loose, tight, running("r", 1.0)]
    assert lvf_decide(views, 10, 0, NOW, P).admit == ("loose",)
    assert lvf_decide(views, 10, 0, NOW, P, GoodputLvf(GP)).admit == ("tight",)


def test_class_weight_decides_who_gets_scarce_memory() -> None:
    batchy = waiting("batch", 4.5, ttft=5.0, blocks=10)  # 0.5 s of slack left
    inter = waiting("inter", 0.5, ttft=1.5, blocks=10, weight=8.0)  # 1 s left, / 8
    views = [batchy, inter, running("r", 1.0)]
    assert lvf_decide(views, 10, 0, NOW, P, GoodputLvf(GP)).admit == ("inter",)
    same = [batchy, waiting("inter", 0.5, ttft=1.5, blocks=10), running("r", 1.0)]
    assert lvf_decide(same, 10, 0, NOW, P, GoodputLvf(GP)).admit == ("batch",)


@settings(max_examples=200, deadline=None, database=None)
@given(st.integers(-500, 500), st.integers(-500, 500), st.floats(1.0, 16.0))
def test_rank_key_orders_by_slack_and_a_weight_only_moves_its_own_class_ahead(
        a_cs: int, b_cs: int, weight: float) -> None:
    a, b = a_cs / 100, b_cs / 100  # slack in seconds, whole centiseconds (no float ties)
    va = ReqView("a", W, NOW - 10.0 + a, None, None, 10.0, 0.1, 1, 0)
    vb = ReqView("b", W, NOW - 10.0 + b, None, None, 10.0, 0.1, 1, 0)
    assert (rank_key(va, NOW) < rank_key(vb, NOW)) == (a < b)
    heavy = ReqView("a", W, va.arrival, None, None, 10.0, 0.1, 1, 0, weight=weight)
    assert rank_key(heavy, NOW) <= rank_key(va, NOW)


def test_only_requests_that_already_lost_are_rotated_out() -> None:
    views = [waiting("new", 3.0, blocks=10), running("fine", 9.0), running("lost", 2.0, ttft_met=False),
             running("tbt_lost", 8.0, misses_left=-1)]
    d = lvf_decide(views, 0, 100, NOW, P, GoodputLvf(GP))
    assert d.admit == ("new",) and d.rotate_out == ("tbt_lost",)  # both lost: the longer stint
    d = lvf_decide([v for v in views if v.rid not in ("lost", "tbt_lost")], 0, 100, NOW, P, GoodputLvf(GP))
    assert d.rotate_out == () and d.blocked == "new"
    assert lvf_decide(views, 0, 100, NOW, P).rotate_out == ("fine",)  # paper: the longest stint


def test_rotation_gate_protects_running_requests_with_no_gap_to_spare() -> None:
    views = [waiting("new", 3.0), running("lost", 2.0, ttft_met=False), running("tight", 1.0, misses_left=0)]
    cheap = GoodputParams(StepCosts(1e-3, 0.0, 0.02, 0.05))
    assert lvf_decide(views, 0, 100, NOW, P, GoodputLvf(cheap)).rotate_out == ("lost",)
    dear = GoodputParams(StepCosts(1e-3, 0.0, 0.02, 0.09))  # 20 + 90 ms > the 100 ms TBT SLO
    assert lvf_decide(views, 0, 100, NOW, P, GoodputLvf(dear)).rotate_out == ()


def test_quantum_follows_the_policy_and_the_measured_rotation_cost() -> None:
    assert quantum_s("paper", None, 0.058) == 5.0
    assert quantum_s("goodput", None, 0.058) == 20 * 0.058
    assert quantum_s("goodput", 250.0, 0.058) == 0.25


@settings(max_examples=200, deadline=None, database=None)
@given(_views, st.integers(0, 120), st.integers(0, 60), _params,
       st.sampled_from([0.0, 1e-4, 1e-2]), st.sampled_from([1.0, 30.0, math.inf]))
def test_goodput_keeps_lvf_guarantees(views: list[ReqView], free: int, budget: int, params: VltParams,
                                      per_token: float, bound: float) -> None:
    gp = GoodputParams(StepCosts(per_token, 0.0, 0.02, 0.01), bound)
    d = lvf_decide(views, free, budget, NOW, params, GoodputLvf(gp))
    check_invariants(views, d, free, budget, params)
    by_rid = {v.rid: v for v in views}
    assert all(by_rid[r].ttft_met is False or by_rid[r].misses_left < 0 for r in d.rotate_out)


def test_misses_left_is_the_share_of_gaps_the_slo_allows() -> None:
    clk = ReqClock("a", 0.0, Slo(1000, 100))
    assert clk.misses_left(21) == 2  # 20 gaps: 10% of them may miss
    for i, t in enumerate([1.0, 1.05, 1.5, 2.0, 2.5]):  # gaps 50 ms, then three of 500 ms
        clk.observe_outputs(i + 1, t)
    assert clk.gaps_missed == 3
    assert clk.misses_left(16) == 2 - 3  # 20 gaps in all, three missed: TBT lost
    assert clk.misses_left(0) == 0 - 3


def test_cost_meter_moves_towards_what_it_observes() -> None:
    m = CostMeter(StepCosts(0.0, 0.0, 0.0, 0.058), smoothing=0.5)
    m.observe_decode(0.04)
    m.observe_decode(0.02)
    m.observe_prefill(10, 5.0)  # too small to say anything per token
    m.observe_prefill(1000, 2.0)
    m.observe_rotation(float("nan"))
    c = m.costs
    assert math.isclose(c.decode_step_s, 0.03) and math.isclose(c.prefill_s_per_token, 2e-3)
    assert c.rotation_s == 0.058 and m.observed == {"decode": 2, "prefill": 1, "rotation": 0}
    # a step capped at the prefill cap's floor is still one the meter learns from
    m.observe_prefill(MIN_PREFILL_CHUNK, MIN_PREFILL_CHUNK * 4e-3)
    assert m.observed["prefill"] == 2 and math.isclose(m.costs.prefill_s_per_token, 3e-3)


def test_cost_meter_splits_a_prefill_into_fixed_and_per_token_time() -> None:
    import random

    rng = random.Random(0)
    # A GPU's prefills (the H100 profile: 10.45 ms fixed, 0.0815 ms per token), single steps
    # spread 10%, sizes from capped chunks to long prompts
    m = CostMeter(StepCosts(0.0, 0.0, 0.03, 0.0))
    for _ in range(300):
        n = rng.randint(MIN_PREFILL_CHUNK, 4096)
        m.observe_prefill(n, (0.01045 + 8.154e-5 * n) * rng.uniform(0.9, 1.1), decode_s=0.03)
    c = m.costs
    assert 0.007 < c.prefill_base_s < 0.014 and abs(c.prefill_s_per_token / 8.154e-5 - 1) < 0.08
    # a 64-token chunk: the per-token mean alone (no fixed time) priced it at ~40% of its time
    chunk = c.prefill_base_s + 64 * c.prefill_s_per_token
    assert abs(chunk / (0.01045 + 64 * 8.154e-5) - 1) < 0.25
    # every prefill the same size (all capped): the line is undetermined, the prior base stands
    same = CostMeter(StepCosts(0.0, 0.002, 0.03, 0.0))
    for _ in range(300):
        same.observe_prefill(256, 0.002 + 256 * 1e-4 * rng.uniform(0.9, 1.1))
    assert same.costs.prefill_base_s == 0.002 and abs(same.costs.prefill_s_per_token / 1e-4 - 1) < 0.1


def test_cost_meter_prices_long_prompts_at_the_slope_when_a_decode_floor_hides_small_ones() -> None:
    # The GH200 profile's mixed steps: max(20.5 ms floor, 0.11 ms x (prefill + decode rows)); with
    # 100 decode rows a small prefill partly fills the floor's slack for free. What a long prompt
    # pays per token is the slope, 0.11 ms: the mean of time / tokens said ~0.07-0.09.
    def step(tokens: int, rows: int = 100) -> float:
        return 0.003 + max(0.0205, 1.104e-4 * (tokens + rows))

    m = CostMeter(StepCosts(0.0, 0.0, 0.0, 0.0))
    sizes = [64, 128, 256, 512, 1024, 2048, 4096, 8192]
    for i in range(400):
        m.observe_step(step(0), 0, 100)  # the decode step the mixed ones ride with
        m.observe_step(step(sizes[i % len(sizes)]), sizes[i % len(sizes)], 100)
    c = m.costs
    assert abs(c.prefill_s_per_token / 1.104e-4 - 1) < 0.03 and c.prefill_base_s == 0.0
    assert abs(c.decode_step_s - step(0)) < 1e-9
    # the server's whole prefill (a step with no decode rows) is one observation too
    p = CostMeter(StepCosts(0.0, 0.0, 0.0, 0.0))
    p.observe_step(0.2, 1000, 0)
    assert math.isclose(p.costs.prefill_s_per_token, 2e-4) and p.observed["decode"] == 0


def test_cost_meter_keeps_prefills_run_alone_on_their_own_line() -> None:
    """A CPU's steps (the cpu profile's shape): a forward costs 30 ms fixed, 1 ms per prefill token
    and 0.8 ms per decode row. A mixed step's prefill adds only its tokens to the decode step; a
    prefill run alone beside the running batch (--mix-prefill needed) pays the 30 ms itself. Read as
    a mixed step's, that 30 ms became every mixed step's prefill base, and the TBT cap and the
    mixing rule then priced a mixed step a decode step too long (the simulator showed the policy
    stop protecting anyone)."""
    def step(tokens: int, rows: int) -> float:
        return 0.03 + 1e-3 * tokens + 8e-4 * rows

    sizes = [32, 64, 128, 256, 512]
    both = CostMeter(StepCosts(0.0, 0.0, 0.0, 0.0))
    for i in range(200):
        n = sizes[i % len(sizes)]
        both.observe_step(step(0, 10), 0, 10)
        both.observe_step(step(n, 10), n, 10)  # mixed
        both.observe_step(step(n, 0), n, 0, alone=True)
    c = both.costs
    assert c.prefill_base_s < 1e-3 and abs(c.prefill_s_per_token / 1e-3 - 1) < 0.02
    mixed_only = CostMeter(StepCosts(0.0, 0.0, 0.0, 0.0))
    for i in range(200):
        n = sizes[i % len(sizes)]
        mixed_only.observe_step(step(0, 10), 0, 10)
        mixed_only.observe_step(step(n, 10), n, 10)
    assert math.isclose(c.prefill_base_s, mixed_only.costs.prefill_base_s, abs_tol=1e-4)
    # without the flag the same steps pull the mixed line's base up to the forward's fixed time
    merged = CostMeter(StepCosts(0.0, 0.0, 0.0, 0.0))
    for i in range(200):
        n = sizes[i % len(sizes)]
        merged.observe_step(step(0, 10), 0, 10)
        merged.observe_step(step(n, 10), n, 10)
        merged.observe_step(step(n, 0), n, 0)
    assert merged.costs.prefill_base_s > 0.01


def test_mixing_is_needed_only_for_a_gap_a_protected_request_would_miss() -> None:
    from superinfer_sgl.rotasched.step_size import mix_needed, protected

    # 20 ms decode, 1 ms per token: alone, a 40-token prefill makes the gap 2 x 20 + 40 = 80 ms
    tight = running("t", 1.0, misses_left=0, tbt=0.1)
    assert not mix_needed([tight], 40, COSTS)  # 80 ms < 90% of 100 ms
    assert mix_needed([tight], 60, COSTS)  # 100 ms
    assert not mix_needed([running("s", 1.0, misses_left=5, tbt=0.1)], 60, COSTS)  # gaps to spare
    # a TBT the floor's step (20 + 32 ms) cannot keep: not protected, so no reason to mix
    hopeless = running("h", 1.0, misses_left=0, tbt=0.05)
    assert protected([hopeless, tight], COSTS) == [tight] and not mix_needed([hopeless], 60, COSTS)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20000),
                          st.one_of(st.floats(-1.0, 100.0), st.sampled_from([math.nan, math.inf]))),
                max_size=80))
def test_cost_meter_estimates_stay_finite_and_non_negative(prefills: list[tuple[int, float]]) -> None:
    m = CostMeter(StepCosts(1e-3, 0.0, 0.05, 0.0))
    for tokens, seconds in prefills:
        m.observe_prefill(tokens, seconds)
        c = m.costs  # StepCosts validates: finite and >= 0
        assert c.prefill_base_s <= max([0.0, *(s for _, s in prefills if math.isfinite(s))]) + 1e-9


def test_admission_order_restored_then_lvf_then_rest_or_only_the_blocked() -> None:
    d = Decision(admit=("c", "a"), resume=("r",))
    assert admission_order(["a", "b", "c", "x"], ["x", "r"], d) == ["x", "r", "c", "a", "b"]
    blocked = Decision(admit=("c",), blocked="b")
    assert admission_order(["a", "b", "c", "d"], [], blocked) == ["c", "b"]


def test_prefill_cap_keeps_tight_running_requests_within_their_tbt() -> None:
    from superinfer_sgl.rotasched.step_size import CAP_TBT_SHARE, MIN_PREFILL_CHUNK, SPARE_MISSES, prefill_cap
    from superinfer_sgl.rotasched.planner import chunk_tokens, plan_step

    # 20 ms decode step, 1 ms per prefill token: a step aimed at 90% of a 100 ms TBT leaves room
    # for 70 prefill tokens; protected from one gap left to spare (a reserve for slow steps)
    assert (CAP_TBT_SHARE, SPARE_MISSES) == (0.9, 1)
    tight = running("t", 1.0, misses_left=0, tbt=0.1)
    assert prefill_cap([tight, waiting("w", 0.1)], COSTS) == 70
    assert prefill_cap([running("one", 1.0, misses_left=1, tbt=0.1)], COSTS) == 70
    # the tightest protected SLO sets the cap
    assert prefill_cap([tight, running("t2", 1.0, misses_left=0, tbt=0.2)], COSTS) == 70
    # gaps to spare, a lost request, or nothing running: no cap (the configured chunk stands)
    assert prefill_cap([running("s", 1.0, misses_left=2)], COSTS) is None
    assert prefill_cap([running("gone", 1.0, misses_left=-1)], COSTS) is None
    assert prefill_cap([running("l", 1.0, misses_left=0, ttft_met=False)], COSTS) is None
    assert prefill_cap([waiting("w", 0.1)], COSTS) is None
    # a TBT that even the floor's step (20 + 32 ms) breaks is not protected: capping would only add
    # steps; just above the floor, the floor stands (prefills always progress)
    assert prefill_cap([running("x", 1.0, misses_left=0, tbt=0.051)], COSTS) is None
    assert prefill_cap([running("y", 1.0, misses_left=0, tbt=0.053)], COSTS) == MIN_PREFILL_CHUNK
    assert prefill_cap([running("x", 1.0, misses_left=0, tbt=0.051), tight], COSTS) == 70
    # the planner carries it in the decision (goodput only); the executor's chunk is the lower one
    d = plan_step([tight, waiting("w", 0.1)], 100, 0, NOW, P, GoodputLvf(GP), False)
    assert d.prefill_cap == 70 and chunk_tokens(512, d) == 70 and chunk_tokens(64, d) == 64
    assert chunk_tokens(None, d) is None and chunk_tokens(-1, d) == -1  # chunking off: nothing to cap
    # SGLang charges a mixed step's decode rows to the chunk budget: they are added back, so 100
    # running requests still leave the step 70 prefill tokens (never a zero or negative chunk)
    assert chunk_tokens(512, d, mixed_rows=100) == 170 and chunk_tokens(150, d, mixed_rows=100) == 150
    assert plan_step([tight, waiting("w", 0.1)], 100, 0, NOW, P, PAPER, False).prefill_cap is None
    # a server that runs prefills alone (no mixed chunk) stalls the decodes for the whole prompt,
    # chunked or not: no TBT cap then, the step sized as with nobody running (by first-token deadlines)
    w = waiting("w", 0.1)
    alone = plan_step([tight, w], 100, 0, NOW, P, GoodputLvf(GP), False, mixed=False)
    assert alone.admit == ("w",) and alone.prefill_cap == plan_step([w], 100, 0, NOW, P, GoodputLvf(GP), False).prefill_cap
    assert alone.prefill_cap > 70


def test_rotation_budget_is_the_flag_else_one_step_of_the_measured_link_within_the_pool_cap() -> None:
    pool, bt = 160_000, 16  # 10,000 blocks: the cap is 1,250
    assert rotation_budget(7, pool, bt, link_blocks_per_step=500.0) == 7  # the flag wins
    assert rotation_budget(None, pool, bt) == 1250  # not measured yet: the paper's 2400, capped
    assert rotation_budget(None, 1_000_000, bt) == 2400
    assert rotation_budget(None, pool, bt, link_blocks_per_step=375.9) == 375
    assert rotation_budget(None, pool, bt, link_blocks_per_step=1e9) == 1250
    assert rotation_budget(None, pool, bt, link_blocks_per_step=0.2) == 1  # always some progress


def test_prefill_cap_aims_lower_where_steps_spread() -> None:
    import dataclasses

    from superinfer_sgl.rotasched.step_size import CAP_TBT_SHARE, GAP_JITTER_Z, cap_share, prefill_cap

    tight = [running("t", 1.0, misses_left=0, tbt=0.1)]
    costs = dataclasses.replace(COSTS, prefill_s_per_token=5e-4)  # 0.5 ms per token: room above the floor
    assert cap_share(0.0) == CAP_TBT_SHARE and prefill_cap(tight, costs) == 140
    # 20% spread: a step aimed at 0.1 / (1 + 2 x 0.2) = 71.4 ms exceeds 100 ms ~2% of the time
    spread = dataclasses.replace(costs, step_cv=0.2)
    assert GAP_JITTER_Z == 2.0 and math.isclose(cap_share(0.2), 1 / (1 + GAP_JITTER_Z * 0.2))
    assert prefill_cap(tight, spread) == int((0.1 / (1 + GAP_JITTER_Z * 0.2) - 0.02) / 5e-4) == 102
    # a small spread stays at the fixed share: it already leaves that much margin
    assert cap_share(0.05) == CAP_TBT_SHARE


@given(st.floats(0.0, 5.0), st.floats(0.0, 5.0))
def test_cap_share_never_grows_with_the_spread(a: float, b: float) -> None:
    from superinfer_sgl.rotasched.step_size import CAP_TBT_SHARE, cap_share

    lo, hi = sorted((a, b))
    assert 0 < cap_share(hi) <= cap_share(lo) <= CAP_TBT_SHARE


def test_cost_meter_measures_the_spread_of_steps_around_its_means() -> None:
    from superinfer_sgl.rotasched.costs import SPREAD_CLIP

    steady = CostMeter(StepCosts(0.0, 0.0, 0.0, 0.0))
    for _ in range(300):
        steady.observe_decode(0.05)
    assert steady.costs.step_cv == 0.0
    # decode steps alternating 20% above and below their mean: a spread of ~0.2
    m = CostMeter(StepCosts(0.0, 0.0, 0.0, 0.0))
    for i in range(2000):
        m.observe_decode(0.05 * (1.2 if i % 2 else 0.8))
    assert 0.17 < m.costs.step_cv < 0.23
    # an idle turn counted as one enormous step moves it by at most the clip's share
    before = m.costs.step_cv
    m.observe_decode(100.0)
    assert m.costs.step_cv ** 2 <= before ** 2 + 0.02 * SPREAD_CLIP ** 2 + 1e-12
    # mixed steps are measured whole: prefill share plus the decode step it rode with
    p = CostMeter(StepCosts(1e-3, 0.0, 0.05, 0.0))
    for i in range(2000):
        p.observe_prefill(100, (0.15 * (1.1 if i % 2 else 0.9)) - 0.05, decode_s=0.05)
    assert 0.07 < p.costs.step_cv < 0.13


def _awaiting_first_token(rid: str, waited: float, ttft: float) -> ReqView:
    """Running: its prefill ended last step, its first token not yet streamed."""
    return ReqView(rid, RUN, NOW - waited, None, NOW - 0.05, ttft, 0.1, 0, 10, True, 0, 5, None)


def test_deadline_budget_keeps_the_first_tokens_of_the_step_in_time() -> None:
    from superinfer_sgl.rotasched.goodput import deadline_budget
    from superinfer_sgl.rotasched.planner import plan_step

    # 1 ms per token, 20 ms decode step: "tight" has 0.4 s left, room for 380 prompt tokens in
    # one step; "loose" (10 s) admitted behind it would push the step to 500 tokens
    tight = waiting("tight", 0.1, tokens=200, ttft=0.5, blocks=5)
    loose = waiting("loose", 0.05, tokens=300, ttft=10.0, blocks=5)
    assert deadline_budget([tight, loose], [tight, loose], NOW, GP, None) == 380
    # the planner lowers the step's cap to it (memory covers both: FCFS admits both)
    d = plan_step([tight, loose], 100, 0, NOW, P, GoodputLvf(GP), False)
    assert d.admit == ("tight", "loose") and d.prefill_cap == 380
    # a TBT cap already below it stands
    assert deadline_budget([tight, loose], [tight, loose], NOW, GP, 256) is None
    # loose first: tight's prompt ends at 500 tokens, past its room: it sets no limit here, only
    # loose's own far deadline does
    assert deadline_budget([tight, loose], [loose, tight], NOW, GP, None) == math.floor((9.95 - 0.02) / 1e-3)
    # one that can no longer make it in this step sets no limit either
    late = waiting("late", 0.45, tokens=200, ttft=0.5)
    assert deadline_budget([late], [late], NOW, GP, None) is None
    # a prompt that spills past the limit is planned again next step; the one ahead keeps its room
    second = waiting("second", 0.0, tokens=250, ttft=0.5)
    assert deadline_budget([tight, second], [tight, second], NOW, GP, None) == 380
    # the steps' spread shrinks the room as it shrinks the TBT cap: 0.4 s / (1 + 1.28 x 0.5)
    spread = GoodputParams(StepCosts(1e-3, 0.0, 0.02, 0.0, step_cv=0.5))
    assert deadline_budget([tight], [tight], NOW, spread, None) == math.floor((0.4 / 1.64 - 0.02) / 1e-3)


def test_deadline_budget_waits_for_first_tokens_streamed_after_the_next_step() -> None:
    from superinfer_sgl.rotasched.goodput import deadline_budget

    # prefilled last step, 0.2 s left: on a server that streams a step's tokens when the next step
    # ends, this step may carry 180 prefill tokens; elsewhere its token is already out
    first = _awaiting_first_token("first", 0.3, ttft=0.5)
    lagged = GoodputParams(COSTS, emit_after_next_step=True)
    assert deadline_budget([first], [], NOW, lagged, None) == 180
    assert deadline_budget([first], [], NOW, GP, None) is None
    # at least the floor, so prefills progress; none for a request already past its deadline
    close = _awaiting_first_token("close", 0.47, ttft=0.5)
    assert deadline_budget([close], [], NOW, lagged, None) == MIN_PREFILL_CHUNK
    assert deadline_budget([_awaiting_first_token("gone", 0.6, ttft=0.5)], [], NOW, lagged, None) is None


@settings(max_examples=200, deadline=None, database=None)
@given(_views, st.integers(0, 120), st.booleans(), st.sampled_from([1e-4, 1e-3, 1e-2]))
def test_the_step_cap_only_ever_lowers_and_keeps_the_floor(views: list[ReqView], free: int, lagged: bool,
                                                           per_token: float) -> None:
    from superinfer_sgl.rotasched.step_size import prefill_cap
    from superinfer_sgl.rotasched.planner import plan_step

    gp = GoodputParams(StepCosts(per_token, 0.001, 0.02, 0.0, 0.2), emit_after_next_step=lagged)
    tbt_cap = prefill_cap(views, gp.costs)
    d = plan_step(views, free, 8, NOW, P, GoodputLvf(gp), False)
    if d.prefill_cap is not None:
        assert d.prefill_cap >= MIN_PREFILL_CHUNK
        assert tbt_cap is None or d.prefill_cap <= tbt_cap
    else:
        assert tbt_cap is None


def _fixed(rid: str, waited: float, tokens: int, outputs: int, ttft: float = 5.0) -> ReqView:
    return ReqView(rid, W, NOW - waited, None, None, ttft, 0.1, 10, 0, True, tokens, outputs_left=outputs,
                   outputs_known=True)


def test_shedding_drops_the_request_with_the_most_work_so_the_others_make_it() -> None:
    from superinfer_sgl.rotasched.shedding import shed
    # Deadline order a, big, b, c (1 ms per prompt token, 20 ms steps). Behind a and big, b's first
    # token would come 0.1 + 1.3 + 0.1 + 0.02 s from now, past its 1.51 s left: the largest kept
    # (big) goes, and a, b and c all make it. Without shedding b alone misses (the planner's
    # `defers` moves it behind everyone).
    a, big = waiting("a", 4.0, tokens=100), waiting("big", 3.5, tokens=1300)
    b, c = waiting("b", 3.49, tokens=100), waiting("c", 3.4, tokens=100)
    assert shed([a, big, b, c], NOW, COSTS, None, 0.0, 256) == {"big"}
    assert shed([a, big, b, c], NOW, COSTS, None, 0.0, 2) == set()  # only the window is read
    # Room for three of the four: shedding admits the three that make their TTFT; without it, a,
    # big and c (b deferred).
    views = [a, big, b, c, running("r", 1.0)]
    assert lvf_decide(views, 30, 0, NOW, P, GoodputLvf(GP)).admit == ("a", "b", "c")
    off = GoodputLvf(dataclasses.replace(GP, ttft_shedding=False))
    assert lvf_decide(views, 30, 0, NOW, P, off).admit == ("a", "big", "c")


def test_shedding_counts_decoding_only_where_the_length_is_known() -> None:
    from superinfer_sgl.rotasched.shedding import shed
    # 10 ms of device per output token (a 20 ms step over two running requests). Ahead of d,
    # long's 300 outputs cost 3 s when they are known: long goes; open-ended (ignore_eos off: its
    # outputs_left is only max_new_tokens' bound) it counts as its 100-token prompt, and stays.
    long_, d = _fixed("long", 3.0, 100, 300), _fixed("d", 2.0, 100, 10, ttft=4.0)
    assert shed([long_, d], NOW, COSTS, None, 0.01, 256) == {"long"}
    assert shed([dataclasses.replace(long_, outputs_known=False), d], NOW, COSTS, None, 0.01, 256) == set()
    # the class weight: of two with equal work, the lighter class's goes, wherever it stands (equal
    # weights: the later one)
    twin, later = dataclasses.replace(long_, rid="twin"), _fixed("later", 2.0, 100, 10, ttft=5.5)
    assert shed([long_, twin, later], NOW, COSTS, None, 0.01, 256) == {"twin"}
    assert shed([long_, dataclasses.replace(twin, weight=2.0), later], NOW, COSTS, None, 0.01, 256) == {"long"}
    # with what finished requests of unknown length decoded (OutputShare): that share of the bound
    # counts; all of it is the known case, a third (100 of 300 outputs: 1 s ahead of d) is not enough
    open_ended = dataclasses.replace(long_, outputs_known=False)
    assert shed([open_ended, d], NOW, COSTS, None, 0.01, 256, 1.0) == {"long"}
    assert shed([open_ended, d], NOW, COSTS, None, 0.01, 256, 1 / 3) == set()
    assert shed([long_, d], NOW, COSTS, None, 0.01, 256, 0.0) == {"long"}  # a known length is exact
    # the policy hands it over from its parameters
    eos = GoodputLvf(dataclasses.replace(GP, eos_output_share=1.0), decode_share_s=0.01)
    assert eos.rank([open_ended, d], [0.0, 0.0], NOW)[0] == [BEST_EFFORT, VIABLE]
    assert GoodputLvf(GP, decode_share_s=0.01).rank([open_ended, d], [0.0, 0.0], NOW)[0] == [VIABLE, VIABLE]
    with pytest.raises(ValueError, match="eos_output_share"):
        dataclasses.replace(GP, eos_output_share=1.5)
    # the share is the step's decode time over the running batch (planner.plan_step asks `batched`)
    policy = GoodputLvf(GP).batched([running("r", 1.0), running("s", 1.0)])
    assert policy.decode_share_s == COSTS.decode_step_s / 2
    assert GoodputLvf(dataclasses.replace(GP, ttft_shedding=False)).batched([]).decode_share_s == 0.0
