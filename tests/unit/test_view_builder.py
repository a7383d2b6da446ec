"""One view builder (rotasched.views) and its two adapters: the server's over SGLang's Req
(integration/views.py, RotaSchedRuntime._views) and the simulator's over SimReq
(sim/policies/rotasched.py). Each adapter must only read a request's numbers: its views equal the
builder's from those numbers. (One end-to-end scenario through both sides:
test_planner_equivalence.py.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fakes import FakeReq, sampling
from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.integration import views as server_views
from superinfer_sgl.integration.runtime import RotaSchedRuntime
from superinfer_sgl.rotasched import ReqState, Slo
from superinfer_sgl.rotasched.clock import ReqClock
from superinfer_sgl.rotasched.views import ViewRules, free_blocks, view
from superinfer_sgl.sim.engine import SimConfig, Simulator
from superinfer_sgl.sim.policies.rotasched import RotaSched
from superinfer_sgl.sim.profile import LinkModel, ModelShape, Profile, ServerLimits, StepModel
from superinfer_sgl.sim.request import Phase
from superinfer_sgl.sim.workload import RequestSpec, Workload


def _clock(rid: str, outputs: int = 0) -> ReqClock:
    clk = ReqClock(rid, 1.0, Slo(2000.0, 100.0, 2.0))
    for i in range(outputs):
        clk.observe_outputs(i + 1, 1.5 + 0.3 * i)  # gaps of 300 ms: every one missed
    return clk


def test_rules_by_hand() -> None:
    rules = ViewRules(block_tokens=4, clip=100, running_share=0.5)
    clk = _clock("a", outputs=3)
    clk.set_state(ReqState.RUNNING, 2.0)
    run = rules.running(clk, seqlen=20, outputs_left=300, ratio=0.5, rotatable=True)
    assert run.blocks_held == 18 and run.blocks_needed == 0  # ceil((20 + 100 x 0.5) / 4)
    assert run.outputs_left == 100 and run.run_start == 2.0 and run.weight == 2.0  # clipped as the reserve is
    assert run.misses_left == clk.misses_left(300) and run.ttft_slo == 2.0 and run.tbt_slo == 0.1
    wait = rules.waiting(clk, prompt=30, outputs=3, resident=10, outputs_left=8, ratio=0.5)
    assert (wait.blocks_needed, wait.prefill_tokens, wait.run_start) == (7, 23, None)  # ceil((23 + 4) / 4)
    rot = rules.rotary(clk, host_tokens=32, outputs_left=8, ratio=1.0)
    assert rot.blocks_needed == 11 and rot.state is ReqState.ROTARY  # ceil((32 + 1 + 8) / 4)
    assert rules.running_ratio(True, 0.3) == 0.5 and rules.running_ratio(False, 0.3) == pytest.approx(0.15)  # share x SGLang's
    assert free_blocks(100.5, 20.0, 16) == 5 and free_blocks(10, 20, 16) == 0
    # a finished-looking request (no outputs left) has no reserve and nothing left to miss
    assert view(clk, ReqState.WAITING, 1, 0, True, -3, -5).outputs_left == 0


def _runtime(ratio: float, share: float, clip: int, waiting: list[FakeReq]) -> RotaSchedRuntime:
    sched = SimpleNamespace(waiting_queue=waiting, tree_cache=None, max_total_num_tokens=10_000,
                            chunked_prefill_size=512, chunked_req=None, last_batch=None,
                            new_token_ratio_tracker=SimpleNamespace(current=ratio))
    engine = SimpleNamespace(host_pool=SimpleNamespace(allocator=SimpleNamespace(num_used=0), num_blocks=8),
                             room_blocks=lambda enough: 1 << 20)
    cfg = SuperInferConfig(rotary_block_tokens=4, running_reserve=share, min_stint_ms=0.0)
    return RotaSchedRuntime(sched, cfg, engine=engine, clip=clip)  # type: ignore[arg-type]


@pytest.mark.parametrize("ignore_eos", [True, False])
def test_server_adapter_reads_the_numbers(ignore_eos: bool) -> None:
    ratio, share, clip = 0.5, 0.4, 64
    run = FakeReq("run", list(range(20)), [1] * 5, sampling_params=sampling(200, ignore_eos))
    wait = FakeReq("wait", list(range(30)), [], sampling_params=sampling(50, ignore_eos))
    back = FakeReq("back", list(range(12)), [1] * 4, sampling_params=sampling(40, ignore_eos))  # restored
    rot = FakeReq("rot", list(range(16)), [1] * 6, sampling_params=sampling(300, ignore_eos))
    rt = _runtime(ratio, share, clip, [wait, back])
    rt.clocks.observe([run], rt.step_views.watch.look(rt.sched.waiting_queue), 3.0)  # as around_prefill
    for req in (rot, back):
        rt.clocks.clock(req, 2.0).observe_outputs(len(req.output_ids), 2.5)
    rt.store.resume_locks["back"] = object()
    rt.store.entries["rot"] = SimpleNamespace(req=rot, host_kv=SimpleNamespace(num_tokens=21))
    views = rt._views([run], 3.0)
    rules, c = ViewRules(4, clip, share), rt.clocks.by_rid
    r = 1.0  # candidates: SGLang's PrefillAdder admits against all their outputs left, whatever the ratio
    assert list(views) == [
        # mid-stint: not rotatable yet; a running request of unknown length holds the share of SGLang's ratio
        rules.running(c["run"], 25, 195, share if ignore_eos else share * ratio, False, ignore_eos),
        rules.waiting(c["wait"], 30, 0, 0, 50, r, ignore_eos),
        rules.waiting(c["back"], 12, 4, 15, 36, r, ignore_eos),  # everything but the last output token is resident
        rules.rotary(c["rot"], 21, 294, r),
    ]
    assert rt.prefetcher.rules == rt.rules == rules  # prefetch room counts by the same rules


def test_server_clip_is_read_when_the_runtime_is_created(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(server_views.CLIP_ENV, raising=False)
    assert server_views.clip_max_new_tokens() == 4096  # SGLang's default
    monkeypatch.setenv(server_views.CLIP_ENV, "64")  # after import: still honoured
    assert server_views.clip_max_new_tokens() == 64
    from superinfer_sgl.integration import startup

    monkeypatch.setattr(startup, "open_metrics", lambda: None)
    sched = SimpleNamespace(waiting_queue=[], tree_cache=None, max_total_num_tokens=1000, chunked_prefill_size=64)
    assert startup.create_runtime(sched, SuperInferConfig(scheduler="sglang")).rules.clip == 64


STEP = StepModel(base_s=0.004, per_prefill_token_s=0.0001, per_decode_token_s=0.002, per_resume_s=0.01)
LINK = LinkModel("test", (1024.0,), (1.0,), (1.0,), 1.0, 1.0)


@pytest.mark.parametrize("policy", ["goodput", "paper"])
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_sim_adapter_reads_the_numbers(policy: str, ignore_eos: bool) -> None:
    specs = tuple(RequestSpec(f"r{i}", 0.01 * i, 20 + 7 * i, 60 + 20 * i, 0.3, 0.05, weight=1 + i % 2)
                  for i in range(12))
    prof = Profile("tiny", ModelShape("tiny", 2, 1000), ServerLimits(400, 8192), STEP, LINK)
    cfg = SimConfig(block_tokens=4, budget_blocks=40, ignore_eos=ignore_eos, min_stint_s=0.0, running_reserve=0.5)
    sim = Simulator(Workload(specs, "t"), prof, RotaSched("duplex", policy=policy), cfg)
    seen = set()
    for _ in range(200):
        sim.step()
        policy_ = sim.policy
        rules = policy_.rules(sim)  # type: ignore[attr-defined]
        assert rules == ViewRules(4, 4096, 0.5)
        run_ratio = policy_.running_ratio(sim)  # type: ignore[attr-defined]
        for v in policy_._views(sim):  # type: ignore[attr-defined]
            r = next(x for x in sim.reqs if x.spec.rid == v.rid)
            seen.add(v.state)
            if v.state is ReqState.RUNNING:
                want = rules.running(r.clock, r.ctx, r.remaining, run_ratio, v.rotatable, ignore_eos)
                assert v.outputs_known is ignore_eos
                if policy == "paper":  # a cached running view keeps what LVF does not read of it
                    assert v.blocks_held == want.blocks_held and v.run_start == want.run_start
                    continue
            elif v.state is ReqState.WAITING:  # candidates at SGLang's admission ratio, whatever sim's
                want = rules.waiting(r.clock, r.spec.prompt_tokens, r.outputs, r.kv, r.remaining, 1.0, ignore_eos)
                assert v.outputs_known is ignore_eos
            else:
                assert r.phase is Phase.ROTARY
                want = rules.rotary(r.clock, r.host, r.remaining, 1.0)
            assert v == want, (v, want)
    # the paper's rule rotates here (goodput only rotates lost requests out)
    assert seen == (set(ReqState) if policy == "paper" else {ReqState.RUNNING, ReqState.WAITING}), seen
