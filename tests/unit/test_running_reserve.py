"""The running reserve (--running-reserve): one rule for our views, SGLang's PrefillAdder (through
our hook) and the simulator; SGLang's own reserve wherever it does not apply."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from superinfer_sgl.config import ConfigError, SuperInferConfig
from superinfer_sgl.integration import hooks, views
from superinfer_sgl.integration.runtime import RotaSchedRuntime
from superinfer_sgl.rotasched.planner import POLICIES, running_reserve_ratio
from superinfer_sgl.rotasched.views import ViewRules
from superinfer_sgl.sim.runner import Job, run_job


def _req(max_new: int, out: int, ignore_eos: bool) -> SimpleNamespace:
    return SimpleNamespace(sampling_params=SimpleNamespace(max_new_tokens=max_new, ignore_eos=ignore_eos),
                           output_ids=[0] * out)


def test_rule_applies_the_share_to_sglangs_reserve() -> None:
    assert running_reserve_ratio(True, 0.3, 0.4) == 0.4  # fixed-length: SGLang keeps all outputs left
    assert running_reserve_ratio(False, 0.3, 0.4) == pytest.approx(0.12)  # EOS: its decaying estimate
    assert running_reserve_ratio(False, 0.3, 1.0) == 0.3 and running_reserve_ratio(True, 0.3, 1.0) == 1.0
    assert POLICIES["paper"].running_reserve == 1.0 and 0 < POLICIES["goodput"].running_reserve < 1


def test_config_share_is_checked() -> None:
    assert SuperInferConfig(running_reserve=0.5).running_reserve == 0.5
    for bad in (0.0, 1.5, float("nan")):
        with pytest.raises(ConfigError, match="running-reserve"):
            SuperInferConfig(running_reserve=bad)


def _adder_offset(req: SimpleNamespace, ratio: float) -> float:
    from sglang.srt.managers.schedule_policy import PrefillAdder

    return PrefillAdder._get_running_request_total_token_offset(SimpleNamespace(new_token_ratio=ratio), req)


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_views_match_sglangs_adder_at_share_1(ignore_eos: bool) -> None:
    sched = SimpleNamespace(new_token_ratio_tracker=SimpleNamespace(current=0.25))
    req = _req(300, 120, ignore_eos)
    assert views.running_reserve(sched, req, 1.0) == pytest.approx(_adder_offset(req, 0.25))


def test_hook_gives_sglangs_adder_the_views_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    sched = SimpleNamespace(new_token_ratio_tracker=SimpleNamespace(current=0.25))
    rt = SimpleNamespace(sched=sched, running_share=0.4, rules=ViewRules(16, running_share=0.4))
    monkeypatch.setattr(hooks, "_RUNTIME", rt)
    adder = SimpleNamespace(new_token_ratio=0.25)

    def original(a: object, r: SimpleNamespace) -> float:
        return _adder_offset(r, 0.25)

    fixed, eos = _req(300, 100, True), _req(300, 100, False)
    assert hooks._running_offset(original, adder, fixed) == pytest.approx(200 * 0.4)
    assert hooks._running_offset(original, adder, fixed) == views.running_reserve(sched, fixed, 0.4)
    assert hooks._running_offset(original, adder, eos) == pytest.approx(200 * 0.25 * 0.4)  # share of its estimate
    assert hooks._running_offset(original, adder, eos) == views.running_reserve(sched, eos, 0.4)
    # SGLang's reserve clip (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION), as the runtime read it at start
    monkeypatch.setattr(rt, "rules", ViewRules(16, clip=150, running_share=0.4))
    assert hooks._running_offset(original, adder, fixed) == pytest.approx(150 * 0.4)
    rt.running_share = 1.0
    assert hooks._running_offset(original, adder, fixed) == original(adder, fixed) == 200.0
    assert hooks._running_offset(original, adder, eos) == original(adder, eos) == 200 * 0.25
    monkeypatch.setattr(hooks, "_RUNTIME", None)  # stock scheduling through our launcher
    assert hooks._running_offset(original, adder, fixed) == 200.0


def test_runtime_keeps_sglangs_reserve_without_rotation() -> None:
    sched = SimpleNamespace(waiting_queue=[], tree_cache=None, max_total_num_tokens=1000, chunked_prefill_size=64)
    assert RotaSchedRuntime(sched, SuperInferConfig()).running_share == 1.0  # no engine: nothing to rotate
    engine = SimpleNamespace(host_pool=SimpleNamespace(allocator=SimpleNamespace(num_used=0), num_blocks=8))
    rt = RotaSchedRuntime(sched, SuperInferConfig(), engine=engine)  # type: ignore[arg-type]
    assert rt.running_share == POLICIES["goodput"].running_reserve
    rt = RotaSchedRuntime(sched, SuperInferConfig(policy="paper"), engine=engine)  # type: ignore[arg-type]
    assert rt.running_share == 1.0
    rt = RotaSchedRuntime(sched, SuperInferConfig(running_reserve=0.7), engine=engine)  # type: ignore[arg-type]
    assert rt.running_share == 0.7


def test_simulator_admits_more_and_rotates_instead_of_recomputing() -> None:
    """Past its capacity (H100 PCIe profile, 8 req/s), the smaller reserve serves more tokens per
    second and more requests on time, with no decode retraction: shortages are rotations."""
    job = Job("h100-pcie5-qwen2.5-32b", "goodput", rate=8.0, duration=120.0, seed=909, mixed_chunk=True)
    full = run_job(Job(**{**job.__dict__, "running_reserve": 1.0}))
    small = run_job(job)
    assert small["throughput_tok_s"] > 1.05 * full["throughput_tok_s"]
    assert small["both_attainment"] > full["both_attainment"]
    assert small["retractions"] == 0 and small["finished"] == small["requests"]
