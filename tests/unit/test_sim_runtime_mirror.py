"""The simulator follows what the servers really do: radix-cache prefix reuse, the measured cost
of a resume, and the runtime's admission order (small hand-checked cases)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from superinfer_sgl.rotasched import Decision
from superinfer_sgl.sim.engine import SimConfig, Simulator
from superinfer_sgl.sim.policies import make_policy
from superinfer_sgl.rotasched import planner
from superinfer_sgl.sim.profile import LinkModel, ModelShape, Profile, ServerLimits, StepModel
from superinfer_sgl.sim.request import Phase
from superinfer_sgl.sim.validate import earlier_prefixes
from superinfer_sgl.sim.workload import RequestSpec, Workload

# Iteration = 10 ms + 1 ms per prefill token + 5 ms per decoding request.
STEP = StepModel(base_s=0.01, per_prefill_token_s=0.001, per_decode_token_s=0.005)
LINK = LinkModel("test", (1024.0,), (1.0,), (1.0,), 1.0, 1.0)


def profile(kv_tokens: int = 10_000, step: StepModel = STEP) -> Profile:
    return Profile("tiny", ModelShape("tiny", 2, 1000), ServerLimits(kv_tokens, 8192), step, LINK)


def sim_of(specs: list[RequestSpec], policy: str = "sglang", prof: Profile | None = None, **cfg: object) -> Simulator:
    return Simulator(Workload(tuple(specs), "test"), prof or profile(), make_policy(policy), SimConfig(**cfg))  # type: ignore[arg-type]


def ttft(sim: Simulator, i: int) -> float:
    r = sim.reqs[i]
    return r.clock.first_token - r.spec.arrival  # type: ignore[operator]


def test_shared_prefix_is_neither_recomputed_nor_allocated_again() -> None:
    specs = [RequestSpec("r0", 0.0, 10, 3), RequestSpec("r1", 1.0, 10, 3, cached_tokens=6)]
    sim = sim_of(specs, prof=profile(kv_tokens=100))
    assert sim.capacity == 100 - 6  # the radix cache holds the shared prefix once
    sim.run()
    assert ttft(sim, 0) == pytest.approx(0.020)  # 10 ms + 10 prefill tokens
    assert ttft(sim, 1) == pytest.approx(0.014)  # 10 ms + the 4 tokens not cached
    assert all(r.phase is Phase.FINISHED for r in sim.reqs) and sim.used == 0

    sim = sim_of(specs, prof=profile(kv_tokens=100))
    while sim.reqs[1].phase is not Phase.RUNNING:
        sim.step()
    r1 = sim.reqs[1]
    assert r1.kv == 10 and r1.alloc == 10 - 6  # KV covers the prefix, the allocation does not


def test_without_a_prefix_cache_every_prompt_token_is_computed() -> None:
    specs = [RequestSpec("r0", 0.0, 10, 3), RequestSpec("r1", 1.0, 10, 3, cached_tokens=6)]
    sim = sim_of(specs, policy="vllm-swap-waiting-first").run()  # vLLM V0: prefix caching off
    assert ttft(sim, 1) == pytest.approx(0.020) and sim.capacity == 10_000


def test_retracted_request_keeps_its_cached_prefix() -> None:
    sim = sim_of([RequestSpec("r0", 0.0, 10, 50, cached_tokens=4)])
    sim.step()
    r = sim.reqs[0]
    sim.retract(r)
    assert r.kv == 4 and r.alloc == 0 and sim.used == 0 and r.extend == 10 + r.outputs - 4


def _rotating_case(per_resume_s: float) -> Simulator:
    # A (long) holds nearly all of a 224-token pool; B arrives, waits past its slack, displaces A.
    specs = [RequestSpec("r0", 0.0, 10, 200, 0.2, 0.1), RequestSpec("r1", 0.05, 10, 6, 0.2, 0.1)]
    step = replace(STEP, per_resume_s=per_resume_s)
    return sim_of(specs, policy="lvf-duplex", prof=profile(kv_tokens=224, step=step), min_stint_s=0.0).run()


def test_resume_cost_is_charged_once_per_readmitted_resume() -> None:
    free, costly = _rotating_case(0.0), _rotating_case(0.25)
    assert free.stats.resumes == costly.stats.resumes >= 1
    assert costly.stats.compute_s - free.stats.compute_s == pytest.approx(0.25 * costly.stats.resumes)
    assert all(r.phase is Phase.FINISHED for r in costly.reqs)


def test_admission_order_is_the_runtimes(monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime._step: restored requests (earlier resumes, then this step's), then LVF's
    admissions in LVF's order (a rid in both keeps its later place), then the rest of the queue."""
    specs = [RequestSpec(f"r{i}", 0.0, 10, 5) for i in range(5)]
    sim = sim_of(specs, policy="lvf-duplex")
    a, b, c, d, e = sim.reqs
    sim.waiting = [a, b, c, d]
    b.restored = True
    b.kv = 14
    e.phase, e.host, e.outputs = Phase.ROTARY, 12, 2
    e.clock.observe_outputs(2, 0.01)
    sim.rotary = {"r4": e}
    policy = sim.policy

    def decide(*_args: object) -> Decision:
        return Decision(admit=("r3",), resume=("r4",), rotate_out=(), contention=False)

    monkeypatch.setattr(planner, "lvf_decide", decide)
    assert [r.spec.rid for r in policy.plan(sim).admit] == ["r1", "r4", "r3", "r0", "r2"]

    def decide_restored_too(*_args: object) -> Decision:
        return Decision(admit=("r3", "r1"), resume=("r4",), rotate_out=(), contention=False)

    monkeypatch.setattr(planner, "lvf_decide", decide_restored_too)
    assert [r.spec.rid for r in policy.plan(sim).admit] == ["r4", "r3", "r1", "r0", "r2"]


def test_earlier_prefixes_by_hand() -> None:
    seqs = [[1, 2, 3], [1, 2, 4, 5], [9], [1, 2, 4, 6], [1, 2, 3, 7]]
    assert earlier_prefixes(seqs) == [0, 2, 0, 3, 3]


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=6), max_size=12))
def test_earlier_prefixes_equal_brute_force(seqs: list[list[int]]) -> None:
    def lcp(x: list[int], y: list[int]) -> int:
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        return n

    want = [max([lcp(s, t) for t in seqs[:i]], default=0) for i, s in enumerate(seqs)]
    assert earlier_prefixes(seqs) == want


def test_the_default_rotation_quantum_is_the_servers() -> None:
    from superinfer_sgl.config import SuperInferConfig

    # Both leave the quantum to the policy's default (rotasched.planner.quantum_s).
    assert SimConfig().min_stint_s is None and SuperInferConfig().min_stint_ms is None
    # B waits: A has not run 5 s yet, so it is not a victim (under the paper's rule it would be).
    specs = [RequestSpec("r0", 0.0, 10, 200, 0.2, 0.1), RequestSpec("r1", 0.05, 10, 6, 0.2, 0.1)]
    quantum = sim_of(specs, policy="lvf-duplex", prof=profile(kv_tokens=224)).run()
    paper = sim_of(specs, policy="lvf-duplex", prof=profile(kv_tokens=224), min_stint_s=0.0).run()
    assert quantum.reqs[0].rotations == 0 < paper.reqs[0].rotations


def test_request_overhead_delays_the_scheduler_and_counts_in_ttft() -> None:
    prof = profile()
    prof = replace(prof, server=replace(prof.server, request_overhead_s=0.05))
    sim = sim_of([RequestSpec("r0", 1.0, 10, 3)], prof=prof).run()
    r = sim.reqs[0]
    assert r.clock.arrival == pytest.approx(1.05)  # the server's clock starts when it sees it
    assert ttft(sim, 0) == pytest.approx(0.05 + 0.020)  # the client's TTFT includes the path


@pytest.mark.parametrize("shape", ["list", "batch_encoding"])
def test_chat_ids_reads_either_transformers_return_type(shape: str) -> None:
    from superinfer_sgl.sim.validate import chat_ids

    class Tok:
        def apply_chat_template(self, messages: list[dict], **_: object) -> object:
            ids = [1, 2, 3]
            return ids if shape == "list" else {"input_ids": ids, "attention_mask": [1, 1, 1]}

    assert chat_ids(Tok(), [{"role": "user", "content": "x"}]) == [1, 2, 3]


@pytest.mark.parametrize("slower", [1.0, 2.0])
def test_speed_scales_read_the_ab_probe(slower: float) -> None:
    """--rescale: a probe that measured exactly what the profile predicts scales by 1; one twice
    as slow on every figure scales both sides by 2."""
    from superinfer_sgl.sim.validate import PROBE_OUT_TOKENS, scaled, speed_scales

    prof, n = profile(), 100
    ctx = n + PROBE_OUT_TOKENS // 2
    steps = [[b, 1000.0 * slower * STEP.seconds(decode_reqs=b, decode_context=b * ctx)] for b in (1, 4, 8)]
    cal = {"speed": {"steps_ms": steps, "prefill_ms_per_token": 1000.0 * slower * STEP.prefill_alone(n) / n},
           "mean_prompt_tokens": n}
    sc = speed_scales(prof, cal)
    assert sc == pytest.approx({"decode": slower, "prefill": slower})
    assert scaled(prof, sc).step.seconds(10, 50.0, 1, 4, 100) == pytest.approx(slower * STEP.seconds(10, 50.0, 1, 4, 100))
    assert speed_scales(prof, {}) is None and scaled(prof, None) is prof


def test_replay_of_an_ab_runs_the_policy_and_quantum_the_server_ran() -> None:
    from superinfer_sgl.sim.validate import served_policy, system_config

    ours = ["python", "-m", "superinfer_sgl.launch_server", "--scheduler", "rotasched"]
    cfg = {"server_commands": {"new": [*ours, "--policy", "goodput"], "stint": [*ours, "--min-stint-ms", "5000"],
                               "old": ours}}
    assert served_policy(cfg, "new") == "goodput" and served_policy(cfg, "old") == "lvf-duplex"
    assert system_config(cfg, "new", "goodput", 4096).min_stint_s is None  # the policy's default
    assert system_config(cfg, "stint", "lvf-duplex", 4096).min_stint_s == 5.0
    assert system_config(cfg, "old", "lvf-duplex", 4096).min_stint_s == 0.0  # before the quantum
    # --running-reserve: as given, else the policy's; an A/B from before the option kept SGLang's
    cfg["server_commands"]["share"] = [*ours, "--policy", "goodput", "--running-reserve", "0.7"]
    assert system_config(cfg, "share", "goodput", 4096).running_reserve == 0.7
    assert system_config(cfg, "new", "goodput", 4096).running_reserve == 1.0  # no date: an old A/B
    cfg["date_utc"] = "2026-11-28T02:00:00+00:00"
    assert system_config(cfg, "new", "goodput", 4096).running_reserve is None
    # TTFT shedding and --mix-prefill: as given, else the default (shedding off before it existed)
    cfg["server_commands"]["noshed"] = [*ours, "--policy", "goodput", "--no-ttft-shedding", "--mix-prefill", "needed"]
    assert not system_config(cfg, "new", "goodput", 4096).ttft_shedding  # dated before the option
    cfg["date_utc"] = "2026-11-30T15:36:08+00:00"
    assert system_config(cfg, "new", "goodput", 4096).ttft_shedding
    assert system_config(cfg, "new", "goodput", 4096).mix_prefill == "always"
    off = system_config(cfg, "noshed", "goodput", 4096)
    assert not off.ttft_shedding and off.mix_prefill == "needed"
    # which policy replays a system: by name, else our launcher under a variant's name as served
    from superinfer_sgl.sim.validate import system_policy
    cfg["server_commands"]["radix"] = ["python", "-m", "superinfer_sgl.launch_server", "--scheduler", "sglang"]
    cfg["server_commands"]["stock"] = ["python", "-m", "sglang.launch_server"]
    assert [system_policy(cfg, s) for s in ("new", "noshed", "old", "radix", "stock")] == \
        ["goodput", "goodput", "lvf-duplex", "sglang", None]
    assert system_policy(cfg, "sglang#2") == "sglang" and system_policy(cfg, "stock", {"stock": "sglang"}) == "sglang"


def test_a_class_weight_reaches_the_policys_views() -> None:
    """--slo-classes weights: the server's views carry them (integration.views.view); so do the
    simulator's, from the workload."""
    specs = [RequestSpec("a", 0.0, 10, 3, weight=3.0), RequestSpec("b", 0.0, 10, 3)]
    sim = sim_of(specs, "goodput")
    sim.step()
    views = sim.policy._views(sim)  # type: ignore[attr-defined]
    assert {v.rid: v.weight for v in views} == {"a": 3.0, "b": 1.0}


def test_outputs_left_are_clipped_as_the_decode_reserve_is() -> None:
    """Best-effort requests queue longest output first; past SGLang's reserve clip (4096) a
    server cannot tell long from unbounded, so the views clip there (integration.views.view
    too: the planner equivalence test compares every field)."""
    specs = [RequestSpec("a", 0.0, 10, 5000), RequestSpec("b", 0.0, 10, 30)]
    sim = sim_of(specs, "goodput")
    sim.step()  # both prefilled: one output each
    assert {v.rid: v.outputs_left for v in sim.policy._views(sim)} == {"a": 4096, "b": 29}  # type: ignore[attr-defined]
