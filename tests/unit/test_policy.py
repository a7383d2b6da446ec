"""The policy as an object: the registry that picks it by name, the paper's hooks, and the executor's
fallbacks (idle resume, prefetch) following the policy's own order of paused requests."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from superinfer_sgl.config import POLICIES as CONFIG_POLICIES
from superinfer_sgl.registry import Registry, UnknownName
from superinfer_sgl.rotasched import Decision, ReqState, ReqView, VltParams, idle_resume, rank_order
from superinfer_sgl.rotasched.goodput import GoodputLvf, GoodputParams, StepCosts
from superinfer_sgl.rotasched.planner import POLICIES, quantum_s
from superinfer_sgl.rotasched.policy import PAPER, PaperLvf
from superinfer_sgl.sim.policies import POLICIES as SIM_POLICIES
from superinfer_sgl.sim.policies import make_policy

NOW = 100.0
P = VltParams()
GP = GoodputParams(StepCosts(1e-3, 0.0, 0.02, 0.0), max_best_effort_wait_s=30.0)


def rotary(rid: str, last_token: float, misses_left: int, arrival: float = 90.0) -> ReqView:
    return ReqView(rid, ReqState.ROTARY, arrival, last_token, None, 5.0, 0.1, 4, 0, True, 0,
                   misses_left, True)


def test_a_registry_lists_its_entries_in_order_and_names_them_when_one_is_unknown() -> None:
    reg: Registry[int] = Registry("transfer path", {"naive": 1, "duplex": 2})
    reg.register("batched")(3)
    assert reg.names() == ("naive", "duplex", "batched") and list(reg) == list(reg.names())
    assert reg["duplex"] == 2 and "batched" in reg and "torch" not in reg and reg.get("torch") is None
    with pytest.raises(ValueError, match="unknown transfer path 'torch'; known: naive, duplex, batched"):
        reg["torch"]
    with pytest.raises(KeyError):  # also a KeyError: what Mapping's contract promises
        reg["torch"]
    with pytest.raises(ValueError, match="registered twice"):
        reg.add("naive", 4)
    assert issubclass(UnknownName, ValueError)


def test_the_servers_policies_come_from_one_registry() -> None:
    assert POLICIES.names() == CONFIG_POLICIES == ("goodput", "paper")
    assert POLICIES["paper"] is PaperLvf and POLICIES["goodput"] is GoodputLvf
    assert POLICIES["paper"].for_step(lambda: pytest.fail("the paper's rule reads no costs")) is PAPER
    assert POLICIES["goodput"].for_step(lambda: GP) == GoodputLvf(GP)
    assert quantum_s("paper", None, 0.058) == 5.0 and quantum_s("goodput", None, 0.058) == 20 * 0.058
    with pytest.raises(ValueError, match="known: goodput, paper"):
        quantum_s("fcfs", None, 0.0)


def test_the_simulators_policies_come_from_the_same_registry_shape() -> None:
    assert isinstance(SIM_POLICIES, Registry) and "goodput" in SIM_POLICIES
    assert make_policy("paper").name == "paper" and make_policy("lvf-duplex").policy == "paper"
    with pytest.raises(ValueError, match="unknown simulator policy"):
        make_policy("fcfs")


def test_transfer_paths_and_bench_profiles_are_registries_too() -> None:
    from superinfer_sgl.bench.profiles import PROFILES
    from superinfer_sgl.duplexkv.transfer import PATHS, TRANSFERS

    assert isinstance(PATHS, Registry) and TRANSFERS == ("auto", *PATHS.names())  # config's: test_config.py
    with pytest.raises(ValueError, match="unknown transfer path 'auto'"):  # a choice among paths, not one
        PATHS["auto"]
    assert isinstance(PROFILES, Registry) and sorted(PROFILES) == ["cpu", "gpu", "smoke"]
    with pytest.raises(ValueError, match="unknown bench profile 'h100'; known: smoke, cpu, gpu"):
        PROFILES["h100"]


def test_idle_resume_and_rank_order_follow_the_policys_order() -> None:
    """Nothing runs and LVF moved nobody. By VLT the paper resumes `lost` (paused 1.5 s ago, its
    TBT already lost); goodput resumes `fine` (paused 0.5 s, gaps to spare), the request it would
    rank first, so a resume (or a prefetch) is not spent on a request it would not serve."""
    views = [rotary("lost", NOW - 1.5, misses_left=-1), rotary("fine", NOW - 0.5, misses_left=3)]
    assert [v.rid for v in rank_order(views, NOW, P)] == ["lost", "fine"]
    assert [v.rid for v in rank_order(views, NOW, P, GoodputLvf(GP))] == ["fine", "lost"]
    noop = Decision(contention=True)
    assert idle_resume(noop, views, NOW, P).resume == ("lost",)
    assert idle_resume(noop, views, NOW, P, GoodputLvf(GP)).resume == ("fine",)


def test_prefetch_candidates_keep_the_order_they_are_given() -> None:
    from superinfer_sgl.integration.prefetch import Prefetcher
    from superinfer_sgl.integration.rotary_store import RotaryStore
    from superinfer_sgl.integration.rotation import RotationStats

    entries = {rid: SimpleNamespace(prefetch_tried=False, paused_iter=1) for rid in ("a", "b", "c")}
    stats = RotationStats()
    store = RotaryStore(SimpleNamespace(), None, stats)
    store.entries.update(entries)  # type: ignore[arg-type]
    p = Prefetcher(SimpleNamespace(), None, store, stats, lambda obj: obj)
    entries["b"].prefetch_tried = True  # a miss is not chased
    ranked = [rotary(rid, NOW - 1.0, 3) for rid in ("c", "b", "a")]
    assert [e for e in p._candidates(ranked, iteration=2)] == [entries["c"], entries["a"]]
    assert p._candidates(ranked, iteration=1) == []  # rotated out this very step
