"""Simulator event loop on small hand-checked cases (tiny cost profile, exact times)."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

import superinfer_sgl.rotasched.lvf as production_lvf
import superinfer_sgl.rotasched.planner as planner
from superinfer_sgl.sim.engine import SimConfig, Simulator
from superinfer_sgl.sim.metrics import summarize
from superinfer_sgl.sim.policies import POLICIES, make_policy
from superinfer_sgl.sim.policies import rotasched as sim_rotasched
from superinfer_sgl.sim.profile import LinkModel, ModelShape, Profile, ServerLimits, StepModel
from superinfer_sgl.sim.request import Phase
from superinfer_sgl.sim.workload import RequestSpec, Workload

# Iteration = 10 ms + 1 ms per prefill token + 5 ms per decoding request.
STEP = StepModel(base_s=0.01, per_prefill_token_s=0.001, per_decode_token_s=0.005)
LINK = LinkModel("test", (1024.0,), (1.0,), (1.0,), 1.0, 1.0)  # 1 GB/s everywhere


def profile(kv_tokens: int = 10_000, chunk: int | None = 8192, kv_bytes: int = 1000) -> Profile:
    return Profile("tiny", ModelShape("tiny", 2, kv_bytes), ServerLimits(kv_tokens, chunk), STEP, LINK)


def workload(*reqs: tuple[float, int, int], ttft: float = 5.0, tbt: float = 0.1) -> Workload:
    specs = [RequestSpec(f"r{i}", a, p, o, ttft, tbt) for i, (a, p, o) in enumerate(reqs)]
    return Workload(tuple(specs), "test")


def run(wl: Workload, policy: str = "sglang", prof: Profile | None = None, **cfg: object) -> Simulator:
    """These cases test LVF's own mechanics: the paper's rule (no rotation quantum) unless given."""
    cfg.setdefault("min_stint_s", 0.0)
    return Simulator(wl, prof or profile(), make_policy(policy), SimConfig(**cfg)).run()  # type: ignore[arg-type]


def ttft(sim: Simulator, i: int) -> float:
    r = sim.reqs[i]
    return r.clock.first_token - r.spec.arrival  # type: ignore[operator]


def test_one_request_prefill_then_decode_steps() -> None:
    sim = run(workload((0.0, 10, 3)))
    assert ttft(sim, 0) == pytest.approx(0.020)  # 10 ms + 10 prefill tokens
    assert list(sim.gaps) == pytest.approx([0.015, 0.015])  # decode of one request: 10 + 5 ms
    assert sim.now == pytest.approx(0.050)
    assert sim.reqs[0].phase is Phase.FINISHED and sim.used == 0


def test_emit_after_next_step_streams_each_steps_tokens_when_the_next_one_ends() -> None:
    """SGLang's overlap scheduler on a CPU: a step's tokens are streamed after the following step;
    the last step's at once (nothing follows). One request, 3 tokens: prefill 20 ms, decodes 15 ms."""
    prof = profile()
    deferred = replace(prof, server=replace(prof.server, emit_after_next_step=True))
    sim = run(workload((0.0, 10, 3)), prof=deferred)
    assert ttft(sim, 0) == pytest.approx(0.035)  # the prefill's token goes out after the first decode
    assert list(sim.gaps) == pytest.approx([0.015, 0.0])  # the last two tokens go out together
    assert sim.now == pytest.approx(0.050) and sim.reqs[0].phase is Phase.FINISHED
    # a second request arriving after the first finished: its prefill's token waits for its own
    # first decode, not for the idle gap
    sim = run(workload((0.0, 10, 2), (1.0, 10, 2)), prof=deferred)
    assert ttft(sim, 0) == pytest.approx(0.035) and ttft(sim, 1) == pytest.approx(0.035)
    assert list(sim.gaps) == pytest.approx([0.0, 0.0])


def test_emit_after_next_step_frees_a_finished_requests_kv_with_its_results() -> None:
    """The KV of a request finished in step N is freed when N's results are processed: after step
    N+1 while the server stays busy, at once when nothing else can run. A (10 + 3 tokens) and B
    (17 + 2) do not fit together in 30 tokens; C (2 + 8) decodes beside A."""
    prof = profile(kv_tokens=30)
    deferred = replace(prof, server=replace(prof.server, emit_after_next_step=True))
    # nothing else runs when A finishes at 50 ms: B's prefill (27 ms) starts right then, and its
    # token goes out after B's first decode (15 ms)
    sim = run(workload((0.0, 10, 3), (0.0, 17, 2)), prof=deferred)
    assert ttft(sim, 1) == pytest.approx(0.050 + 0.027 + 0.015) and not sim.stats.stalled

    def step_after_a_finishes(p: Profile) -> Simulator:
        sim = Simulator(workload((0.0, 10, 3), (0.0, 2, 8), (0.001, 17, 2)), p, make_policy("sglang"),
                        SimConfig(min_stint_s=0.0))
        while sim.reqs[0].phase is not Phase.FINISHED:
            sim.step()
        sim.step()
        return sim

    assert step_after_a_finishes(prof).reqs[2].phase is Phase.RUNNING  # admitted at once
    late = step_after_a_finishes(deferred)
    assert late.reqs[2].phase is Phase.WAITING and late.reqs[1].phase is Phase.RUNNING  # C decoded, B waited
    late.step()
    assert late.reqs[2].phase is Phase.RUNNING
    assert late.run().used == 0


def test_speed_trace_scales_the_steps_that_start_after_each_mark() -> None:
    """SimConfig.speed_trace: the machine twice as slow from 30 ms on. Prefill 20 ms, decode 15 ms
    at 20 ms (before the mark), then 30 ms decodes."""
    sim = run(workload((0.0, 10, 4)), speed_trace=((0.03, 2.0),))
    assert ttft(sim, 0) == pytest.approx(0.020)
    assert list(sim.gaps) == pytest.approx([0.015, 0.030, 0.030])
    with pytest.raises(AssertionError):
        SimConfig(speed_trace=((0.5, 1.0), (0.1, 1.0)))  # not sorted


def test_arrival_during_iteration_joins_next_and_prefill_stalls_decode() -> None:
    sim = run(workload((0.0, 10, 3), (0.005, 20, 2)))
    assert ttft(sim, 0) == pytest.approx(0.020)
    assert ttft(sim, 1) == pytest.approx(0.050 - 0.005)  # its prefill runs 0.02 -> 0.05
    a, b = sim.reqs
    # A waits through B's prefill (gap 0.05 - 0.02 = 0.03 plus the joint decode 0.02), then alone.
    assert a.clock.last_token == pytest.approx(0.085)
    assert b.clock.last_token == pytest.approx(0.070)
    assert sorted(sim.gaps) == pytest.approx(sorted([0.05, 0.02, 0.015]))


def test_mixed_chunk_decodes_during_prefill() -> None:
    sim = run(workload((0.0, 10, 3), (0.005, 20, 2)), mixed_chunk=True)
    # Iteration 2 prefills B (20 ms) and decodes A (5 ms) in one batch: 35 ms, ends at 0.055.
    assert ttft(sim, 1) == pytest.approx(0.055 - 0.005)
    assert sim.now == pytest.approx(0.075)


def test_goodput_with_mix_prefill_needed_mixes_only_when_a_running_gap_needs_it() -> None:
    """The profile's costs: a decode step of A alone 15 ms, B's 20-token prefill 20 ms more. Unmixed,
    A's next token waits for B's prefill step and a decode step (50 ms); mixed, it comes with B's
    prefill (35 ms) and B's first token 5 ms later (A's decode row). A 1 s TBT has room for 50 ms: B's
    prefill runs alone, as on stock SGLang without mixed chunk. Against 50 ms (A has no gap to spare)
    it rides with A's decode, as stock SGLang's mixed chunk always does."""
    loose = run(workload((0.0, 10, 3), (0.005, 20, 2), tbt=1.0), policy="goodput", mixed_chunk=True,
                measured_costs=False, mix_prefill="needed")
    assert ttft(loose, 1) == pytest.approx(0.045) and list(loose.gaps)[0] == pytest.approx(0.05)
    tight = run(workload((0.0, 10, 3), (0.005, 20, 2), tbt=0.05), policy="goodput", mixed_chunk=True,
                measured_costs=False, mix_prefill="needed")
    assert ttft(tight, 1) == pytest.approx(0.050) and list(tight.gaps)[0] == pytest.approx(0.035)
    stock = run(workload((0.0, 10, 3), (0.005, 20, 2), tbt=1.0), mixed_chunk=True)
    always = run(workload((0.0, 10, 3), (0.005, 20, 2), tbt=1.0), policy="goodput", mixed_chunk=True,
                 measured_costs=False)  # --mix-prefill always, the default
    assert ttft(stock, 1) == ttft(always, 1) == pytest.approx(0.050)


def test_sglang_conservative_admission_blocks_the_queue_head() -> None:
    # 30 KV tokens; each request reserves prompt 10 + output 10 = 20: B waits for A to finish.
    sim = run(workload((0.0, 10, 10), (0.0, 10, 10)), prof=profile(kv_tokens=30))
    a_done = 0.020 + 9 * 0.015
    assert sim.reqs[0].clock.last_token == pytest.approx(a_done)
    assert ttft(sim, 1) == pytest.approx(a_done + 0.020)
    assert sim.stats.retractions == 0


def test_idle_time_is_skipped_and_ttft_counts_from_arrival() -> None:
    sim = run(workload((100.0, 10, 2)))
    assert ttft(sim, 0) == pytest.approx(0.020)
    assert sim.stats.iterations == 2


def test_chunked_prefill_takes_several_iterations() -> None:
    sim = run(workload((0.0, 100, 1)), prof=profile(chunk=40))
    assert sim.stats.prefill_iterations == 3  # 40 + 40 + 20 tokens
    assert ttft(sim, 0) == pytest.approx(3 * 0.010 + 0.100)


def test_request_that_can_never_fit_is_dropped() -> None:
    sim = run(workload((0.0, 50, 60), (0.0, 10, 2)), prof=profile(kv_tokens=100))
    assert sim.reqs[0].phase is Phase.DROPPED and sim.reqs[1].phase is Phase.FINISHED
    s = summarize(sim)
    assert s["dropped"] == 1 and s["ttft_attainment"] == pytest.approx(0.5)


def test_vllm_swaps_out_latest_arrival_on_decode_oom() -> None:
    # 16-token pages, 32 tokens: both prompts (one page each) fit; at the page boundary the
    # second page cannot be had and the later arrival is swapped out.
    sim = run(workload((0.0, 10, 12), (0.001, 10, 12)), policy="vllm-swap-waiting-first",
              prof=profile(kv_tokens=32))
    assert sim.stats.rotations_out >= 1 and sim.stats.resumes == sim.stats.rotations_out
    assert sim.reqs[1].rotations >= 1 and sim.reqs[0].rotations == 0
    assert all(r.phase is Phase.FINISHED for r in sim.reqs)


def test_vllm_swap_bytes_and_time_are_exact() -> None:
    prof = profile(kv_tokens=32)
    sim = Simulator(workload((0.0, 10, 12), (0.001, 10, 12)), prof, make_policy("vllm-swap-waiting-first"))
    sim.run()
    # KV moved out = tokens whose KV exists (ctx - 1) x 1000 bytes; in = the same tokens back.
    assert sim.stats.bytes_in == sim.stats.bytes_out
    # Naive segments: 16 tokens x 1000 B / (2 x 2 layers) = 4000 B >= 1024 B: 1 GB/s each way.
    assert sim.stats.transfer_s == pytest.approx((sim.stats.bytes_out + sim.stats.bytes_in) / 1e9)


def test_lvf_uses_the_production_policy_and_rotates(monkeypatch: pytest.MonkeyPatch) -> None:
    assert planner.lvf_decide is production_lvf.lvf_decide  # the sim's policy calls planner.plan_step
    calls = []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003
        d = production_lvf.lvf_decide(*args, **kwargs)
        calls.append(d)
        return d

    monkeypatch.setattr(planner, "lvf_decide", spy)
    # A long request fills memory (prompt 10 + output 200 reserved = 14 blocks of 16, the whole
    # 224-token pool, 15 tokens left); B (10 + 6 tokens) arrives and, once past its slack
    # (TTFT SLO 0.2 s -> 0.1 s), displaces A.
    wl = workload((0.0, 10, 200), (0.05, 10, 6), ttft=0.2)
    sim = run(wl, policy="lvf-duplex", prof=profile(kv_tokens=224))
    assert calls and any(d.rotate_out == ("r0",) for d in calls)
    assert sim.reqs[0].rotations >= 1
    # parked in the host pool: at most both requests at once, their KV in whole 16-token blocks
    peak = summarize(sim)["peak_rotary"]
    assert 1 <= peak <= 2 and sim.stats.peak_host_tokens % 16 == 0 and 0 < sim.stats.peak_host_tokens <= 2 * 224
    assert ttft(sim, 1) < 0.5  # stock FCFS would wait ~3 s for A to finish
    assert all(r.phase is Phase.FINISHED for r in sim.reqs)
    fcfs = run(wl, policy="sglang", prof=profile(kv_tokens=224))
    assert ttft(fcfs, 1) > 2.5


def test_lvf_rotates_out_only_what_the_host_pool_can_take() -> None:
    # The displacement above with a host pool too small for A's KV: rotating A out would drop its
    # KV and recompute it (a host-full fallback), so LVF leaves it running and B waits for memory.
    wl = workload((0.0, 10, 200), (0.05, 10, 6), ttft=0.2)
    small = replace(profile(kv_tokens=224), server=ServerLimits(224, 8192, host_kv_tokens=16))
    sim = run(wl, policy="lvf-duplex", prof=small)
    assert sim.reqs[0].rotations == 0 and sim.stats.host_full_fallbacks == 0 and sim.stats.retractions == 0
    assert ttft(sim, 1) > 2.5 and all(r.phase is Phase.FINISHED for r in sim.reqs)
    roomy = replace(small, server=ServerLimits(224, 8192, host_kv_tokens=224))
    assert run(wl, policy="lvf-duplex", prof=roomy).reqs[0].rotations >= 1


def test_min_stint_what_if_protects_young_running_requests() -> None:
    wl = workload((0.0, 10, 200), (0.05, 10, 6), ttft=0.2)
    sim = run(wl, policy="lvf-duplex", prof=profile(kv_tokens=224), min_stint_s=100.0)
    assert sim.reqs[0].rotations == 0 and ttft(sim, 1) > 2.5  # A is never young enough to leave


def test_lvf_block_rounding_does_not_starve_a_rotary_request_that_fits_in_tokens() -> None:
    """Production edge case, fixed: LVF counts needs in whole blocks rounded up (r0 rotary:
    211 tokens -> 14 blocks) and free memory rounded down (215 tokens -> 13 blocks). r0 is
    admitted (the runtime offers every waiting request to SGLang's token-exact admission) and
    rotated out for r1; once r1 has finished, LVF alone would never resume it. The executor's
    idle fallback (rotasched.idle_resume, runtime._decide) resumes it: its slots fit in tokens."""
    sim = run(workload((0.0, 10, 200), (0.05, 10, 5), ttft=0.2), policy="lvf-duplex",
              prof=profile(kv_tokens=215))
    assert not sim.stats.stalled and summarize(sim)["stalled"] is False
    assert sim.reqs[0].rotations >= 1 and all(r.phase is Phase.FINISHED for r in sim.reqs)


def test_duplex_rotate_out_moves_only_the_unsynced_tail() -> None:
    wl = workload((0.0, 10, 200), (0.05, 10, 6), ttft=0.2)
    prof = profile(kv_tokens=224)
    naive, duplex = run(wl, "lvf-naive", prof), run(wl, "lvf-duplex", prof)
    first_out_naive = naive.reqs[0]
    assert first_out_naive.rotations >= 1
    # The first rotate-out moves every KV token under naive copies, at most one block's tail
    # (< 16 tokens) under DuplexKV's eager sync.
    assert duplex.stats.bytes_out < 16 * 1000 * duplex.stats.rotations_out
    assert naive.stats.bytes_out > 16 * 1000 * naive.stats.rotations_out


def test_tbt_attainment_uses_the_90_percent_rule() -> None:
    sim = run(workload((0.0, 10, 3), (0.005, 20, 2), tbt=0.04))
    s = summarize(sim)
    # A's gaps 0.05 (missed) and 0.015: 50% < 90% -> missed; B's only gap 0.02 -> met.
    assert s["tbt_attainment"] == pytest.approx(0.5)
    assert s["tbt_gap_attainment"] == pytest.approx(2 / 3)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_every_policy_finishes_a_contended_workload(policy: str) -> None:
    reqs = [(0.01 * i, 20 + 7 * i % 30, 5 + 3 * i % 20) for i in range(30)]
    sim = run(workload(*reqs, ttft=0.3), policy=policy, prof=profile(kv_tokens=200))
    assert all(r.phase is Phase.FINISHED for r in sim.reqs), policy
    assert sim.used == 0 and not sim.running and not sim.rotary
    s = summarize(sim)
    assert 0.0 <= s["ttft_attainment"] <= 1.0 and s["unfinished"] == 0


def test_deterministic() -> None:
    reqs = [(0.01 * i, 20 + 7 * i % 30, 5 + 3 * i % 20) for i in range(30)]
    a = summarize(run(workload(*reqs, ttft=0.3), "lvf-duplex", profile(kv_tokens=200)))
    b = summarize(run(workload(*reqs, ttft=0.3), "lvf-duplex", profile(kv_tokens=200)))
    assert a == b


def test_no_second_copy_of_scheduling_logic() -> None:
    """The simulator must call rotasched's VLT/LVF, never re-implement them."""
    sim_dir = Path(sim_rotasched.__file__).resolve().parents[1]
    banned = {"vlt", "lvf_decide", "_head_scan", "_tail_scan", "_rank", "_fcfs", "_contended"}
    for path in sim_dir.rglob("*.py"):
        tree = ast.parse(path.read_text())
        defs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        assert not defs & banned, f"{path} defines {defs & banned}"


def test_goodput_answers_a_decode_shortage_by_rotation_as_the_server_does() -> None:
    """Requests that may stop at EOS, their decode reserve a share of SGLang's decaying estimate:
    the pool runs short while they decode. The server (--decode-shortage rotate) rotates victims
    out to host and resumes them; the same policy with SGLang's retraction recomputes them."""
    wl = workload(*[(0.001 * i, 10, 40) for i in range(4)], ttft=5.0, tbt=1.0)
    sim = run(wl, policy="goodput", prof=profile(kv_tokens=96), ignore_eos=False)
    assert sim.stats.shortage_rotations >= 1 and sim.stats.retractions == 0
    assert sum(r.recomputes for r in sim.reqs) == 0 and sim.stats.resumes == sim.stats.rotations_out
    assert all(r.phase is Phase.FINISHED for r in sim.reqs) and sim.host_used == 0
    retracting = sim_rotasched.RotaSched("duplex", policy="goodput", name="goodput")  # shortage_rotates off
    sim = Simulator(wl, profile(kv_tokens=96), retracting, SimConfig(min_stint_s=0.0, ignore_eos=False)).run()
    assert sim.stats.retractions >= 1 and sim.stats.shortage_rotations == 0
    assert all(r.phase is Phase.FINISHED for r in sim.reqs)
