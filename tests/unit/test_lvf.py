"""LVF (Algorithm 1), hand-worked scenarios.

Clock at NOW = 100 s, paper defaults (alpha 3, beta_ttft 0.5, beta_tbt 0) and TTFT 5 s,
so a waiting request has 2.5 s of slack: arrival 96 -> VLT 1.5, arrival 99 -> VLT 0.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from superinfer_sgl.rotasched import Decision, ReqState, ReqView, VltParams, lvf_decide

NOW = 100.0
P = VltParams()


def waiting(rid: str, arrival: float, need: int, ttft: float = 5.0) -> ReqView:
    return ReqView(rid, ReqState.WAITING, arrival, None, None, ttft, 0.1, need, 0)


def rotary(rid: str, last_token: float, need: int, arrival: float = 90.0) -> ReqView:
    return ReqView(rid, ReqState.ROTARY, arrival, last_token, None, 5.0, 0.1, need, 0)


def running(rid: str, run_start: float, held: int, rotatable: bool = True) -> ReqView:
    return ReqView(rid, ReqState.RUNNING, 80.0, NOW - 0.05, run_start, 5.0, 0.1, 0, held, rotatable)


def decide(views: list[ReqView], free: int, budget: int = 100, params: VltParams = P) -> Decision:
    return lvf_decide(views, free, budget, NOW, params)


def test_no_contention_is_fcfs() -> None:
    views = [waiting("a", 99.9, 10), running("r", 95.0, 50), waiting("b", 99.5, 5),
             rotary("c", 99.0, 8, arrival=90.0)]
    d = decide(views, free=23)
    assert d == Decision(admit=("b", "a"), resume=("c",), rotate_out=(), contention=False)


def test_no_contention_resumes_within_inbound_budget() -> None:
    views = [rotary("c", 99.0, 4, arrival=90.0), rotary("d", 99.0, 3, arrival=91.0),
             rotary("e", 99.0, 1, arrival=92.0), waiting("w", 99.0, 20)]
    d = decide(views, free=100, budget=5)
    assert (d.admit, d.resume, d.contention) == (("w",), ("c", "e"), False)


def test_no_contention_a_resume_over_the_whole_budget_goes_alone() -> None:
    """Skipped, it came back only once nothing ran, however much memory sat free (its need counts
    a decode reserve that is never copied)."""
    views = [rotary("c", 99.0, 8, arrival=90.0), rotary("d", 99.0, 3, arrival=91.0),
             waiting("w", 99.0, 20), running("r", 99.0, 4)]
    d = decide(views, free=100, budget=5)
    assert (d.admit, d.resume, d.contention) == (("w",), ("c",), False)
    # behind a resume that fits, it waits for the next step
    d = decide([rotary("b", 99.0, 2, arrival=89.0), *views], free=100, budget=5)
    assert d.resume == ("b", "d")


def test_nothing_pending_is_noop() -> None:
    d = decide([running("r", 90.0, 10)], free=0)
    assert d.is_noop and not d.contention


def test_positive_vlt_displaces_longest_running() -> None:
    views = [waiting("w", 96.0, 4), running("young", 99.0, 4), running("old", 95.0, 4)]
    d = decide(views, free=0)
    assert d == Decision(admit=("w",), resume=(), rotate_out=("old",), contention=True)


def test_rotates_out_only_what_is_needed() -> None:
    views = [waiting("w", 96.0, 6), running("r1", 90.0, 4), running("r2", 91.0, 4),
             running("r3", 92.0, 4)]
    d = decide(views, free=1)
    assert d.rotate_out == ("r1", "r2")  # 1 free + 8 freed >= 6; r3 keeps running


def test_zero_vlt_does_not_displace() -> None:
    views = [waiting("w", 99.0, 4), running("r", 95.0, 4)]
    d = decide(views, free=0)
    assert d.is_noop and d.contention


def test_zero_vlt_uses_free_memory_oldest_first() -> None:
    views = [waiting("w0", 99.0, 4), waiting("w1", 98.5, 4), running("r", 95.0, 4)]
    d = decide(views, free=4)
    assert (d.admit, d.rotate_out) == (("w1",), ())


def test_zero_vlt_gets_no_memory_a_displacer_took() -> None:
    views = [waiting("hot", 96.0, 6), waiting("zero", 99.0, 1), running("r", 95.0, 4)]
    d = decide(views, free=4)
    assert (d.admit, d.rotate_out) == (("hot",), ("r",))


def test_skip_and_continue_when_not_fitting() -> None:
    views = [waiting("big", 95.0, 10), waiting("small", 96.0, 5)]
    d = decide(views, free=5, budget=0)
    assert d.admit == ("small",)


def test_skip_when_beyond_free_plus_budget() -> None:
    views = [waiting("big", 95.0, 10), waiting("small", 96.0, 4), running("r", 90.0, 4)]
    d = decide(views, free=0, budget=6)
    assert (d.admit, d.rotate_out) == (("small",), ("r",))


def test_rotary_and_waiting_compete_on_one_scale() -> None:
    # Waiting VLT 1.5; rotary paused 0.6 s: alpha 3 -> 1.8 wins, alpha 1 -> 0.6 loses.
    views = [waiting("w", 96.0, 4), rotary("x", 99.4, 4)]
    d = decide(views, free=4)
    assert (d.admit, d.resume) == ((), ("x",))
    d = decide(views, free=4, params=VltParams(alpha=1.0))
    assert (d.admit, d.resume) == (("w",), ())


def test_inbound_budget_limits_resumes() -> None:
    # x1 (VLT 3) needs 5 > budget 4: skipped; x2 (1.5, older than w) resumes; w fits in free.
    views = [rotary("x1", 99.0, 5), rotary("x2", 99.5, 4, arrival=90.0), waiting("w", 96.0, 6)]
    d = decide(views, free=10, budget=4)
    assert d == Decision(admit=("w",), resume=("x2",), rotate_out=(), contention=True)


def test_outbound_budget_limits_rotate_outs() -> None:
    # "old" holds 8 > budget 5: skipped; "mid" (5) goes instead.
    views = [waiting("w", 96.0, 4), running("old", 90.0, 8), running("mid", 95.0, 5)]
    d = decide(views, free=0, budget=5)
    assert (d.admit, d.rotate_out) == (("w",), ("mid",))


def test_host_room_limits_rotate_outs() -> None:
    # A rotation the host pool cannot take would become a recompute: none is chosen beyond its room.
    views = [waiting("w", 96.0, 4), running("old", 90.0, 8), running("mid", 95.0, 5)]
    assert lvf_decide(views, 0, 100, NOW, P).rotate_out == ("old",)
    d = lvf_decide(views, 0, 100, NOW, P, host_room_blocks=5)  # "old" does not fit, "mid" does
    assert (d.admit, d.rotate_out) == (("w",), ("mid",))
    d = lvf_decide(views, 0, 100, NOW, P, host_room_blocks=4)  # nobody fits: the urgent one waits
    assert (d.admit, d.rotate_out, d.blocked) == ((), (), "w")
    # free memory is still used, and resumes (which free host blocks) are not limited by the room
    views = [waiting("w", 96.0, 3), rotary("x", 97.0, 2), running("old", 90.0, 8)]
    d = lvf_decide(views, 5, 100, NOW, P, host_room_blocks=0)
    assert (set(d.admit) | set(d.resume), d.rotate_out) == ({"w", "x"}, ())


def test_non_rotatable_is_never_rotated_out() -> None:
    views = [waiting("w", 96.0, 4), running("chunked", 90.0, 8, rotatable=False),
             running("r", 99.0, 4)]
    d = decide(views, free=0)
    assert d.rotate_out == ("r",)


def test_withdraws_lowest_vlt_when_tail_falls_short() -> None:
    # a (VLT 3) and b (VLT 2) need 6; only "r" (4) can leave: a stays, b is withdrawn.
    views = [waiting("a", 94.5, 3), waiting("b", 95.5, 3), running("r", 90.0, 4),
             running("pinned", 80.0, 50, rotatable=False)]
    d = decide(views, free=0)
    assert (d.admit, d.rotate_out) == (("a",), ("r",))


def test_withdrawal_refits_a_smaller_request() -> None:
    # a (need 10) can never fit in the 4 freeable blocks; b still gets in behind it.
    views = [waiting("a", 94.5, 10), waiting("b", 95.5, 2), running("r1", 90.0, 2),
             running("r2", 95.0, 2)]
    d = decide(views, free=0)
    assert (d.admit, d.rotate_out) == (("b",), ("r1",))  # r2 is no longer needed


def test_withdrawal_of_everything_rotates_nobody() -> None:
    views = [waiting("a", 94.5, 6), running("r", 90.0, 4)]
    d = decide(views, free=0)
    assert d.is_noop and d.contention


def test_ties_break_by_arrival() -> None:
    # Both VLT 2.5 (5 - 2.5 and 4 - 1.5): the older one wins the single slot.
    views = [waiting("young", 96.0, 4, ttft=3.0), waiting("old", 95.0, 4, ttft=5.0)]
    d = decide(views, free=4)
    assert d.admit == ("old",)


def test_admission_order_is_vlt_order() -> None:
    views = [waiting("w1", 96.0, 1), waiting("w3", 94.0, 1), waiting("w2", 95.0, 1),
             running("r", 90.0, 4)]
    d = decide(views, free=0)
    assert d.admit == ("w3", "w2", "w1")


def test_input_order_does_not_matter() -> None:
    views = [waiting("a", 94.5, 3), rotary("x", 99.5, 2), waiting("b", 95.5, 3),
             running("r1", 90.0, 4), running("r2", 92.0, 3)]
    assert decide(views, free=1) == decide(views[::-1], free=1)


def test_duplicate_rid_rejected() -> None:
    with pytest.raises(AssertionError):
        decide([waiting("a", 96.0, 1), waiting("a", 95.0, 1)], free=0)


def test_policy_imports_only_stdlib() -> None:
    # The policy must stay importable without torch/sglang/numpy (CPU tests, reuse).
    pkg = Path(__file__).resolve().parents[2] / "superinfer_sgl" / "rotasched"
    for path in [*pkg.glob("*.py"), pkg.parent / "registry.py"]:  # the policy registry's type too
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                ours = name.startswith("superinfer_sgl.rotasched") or name == "superinfer_sgl.registry"
                assert ours or top in sys.stdlib_module_names, f"{path.name} imports {name}"


def test_idle_resume_brings_back_what_block_rounding_or_the_budget_would_strand() -> None:
    from superinfer_sgl.rotasched import idle_resume

    # Needs 14 blocks, 13 free (rounded down) and nothing runs: LVF moves nobody.
    views = [rotary("c", 99.0, 14, arrival=90.0), rotary("d", 98.0, 14, arrival=91.0)]
    d = decide(views, free=13)
    assert d.is_noop
    assert idle_resume(d, views, NOW, P) == Decision(resume=("d",), contention=d.contention)  # larger VLT
    # Over the inbound budget with memory to spare: LVF itself resumes it, alone.
    d = decide(views[:1], free=100, budget=10)
    assert d.resume == ("c",) and idle_resume(d, views[:1], NOW, P) is d


def test_idle_resume_leaves_lvf_alone_otherwise() -> None:
    from superinfer_sgl.rotasched import idle_resume

    views = [rotary("c", 99.0, 14), running("r", 95.0, 50, rotatable=False)]
    d = decide(views, free=13)
    assert d.is_noop and idle_resume(d, views, NOW, P) is d  # something runs: it will free memory
    moved = Decision(admit=("w",))
    assert idle_resume(moved, [rotary("c", 99.0, 14), waiting("w", 99.0, 1)], NOW, P) is moved
    assert idle_resume(Decision(), [waiting("w", 99.0, 50)], NOW, P) == Decision()  # nothing rotary


def test_an_urgent_request_that_does_not_fit_stops_the_scan() -> None:
    """Head-of-line for urgent requests: big R (VLT 8 > 0) needs 30 blocks, 10 are free and the
    only running request is too young to rotate. Skipping R would admit S (VLT 1.5) into the
    memory R waits for, and R would starve while smaller requests keep coming."""
    views = [waiting("R", 90.0, 30), waiting("S", 96.0, 5), running("r", 99.0, 40, rotatable=False)]
    d = decide(views, free=10, budget=5)
    assert d == Decision(contention=True, blocked="R")
    # Ranked above R, S would still go first.
    views = [waiting("R", 95.0, 30), waiting("S", 90.0, 5), running("r", 99.0, 40, rotatable=False)]
    assert decide(views, free=10, budget=5) == Decision(admit=("S",), contention=True, blocked="R")


def test_requests_that_do_not_block_the_scan() -> None:
    young = running("r", 99.0, 40, rotatable=False)
    # Within its slack (VLT 0): skipped, as before.
    d = decide([waiting("R", 99.5, 30), waiting("S", 99.6, 5), young], free=10, budget=5)
    assert (d.admit, d.blocked) == (("S",), None)
    # More than all the memory requests can hold (10 free + 40 held): it could never fit.
    d = decide([waiting("R", 90.0, 60), waiting("S", 96.0, 5), young], free=10, budget=5)
    assert (d.admit, d.blocked) == (("S",), None)
    # A rotary request over the inbound rotation budget: skipped, not waited for.
    d = decide([rotary("C", 98.0, 12), waiting("S", 96.0, 5), young], free=10, budget=5)
    assert (d.admit, d.resume, d.blocked) == (("S",), (), None)
