"""RotaSchedRuntime's bookkeeping with fake SGLang objects: no server, no model.
(Rotation steps against a real RotationEngine: test_runtime_duplex.py.)"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.duplexkv.engine import HostKV
from superinfer_sgl.integration import rotation
from superinfer_sgl.integration.clocks import CPU_ROTATION_S_PRIOR, Clocks, step_prior
from superinfer_sgl.integration.rotary_store import abort_match
from superinfer_sgl.integration.runtime import RotaSchedRuntime
from superinfer_sgl.rotasched import Decision, Slo
from superinfer_sgl.rotasched.goodput import StepCosts
from superinfer_sgl.rotasched.planner import rotation_budget
from fakes import FakeReq, sampling


class FakeBatch:
    def __init__(self, reqs: list[FakeReq]) -> None:
        self.reqs = reqs
        self.batch_is_full = True

    def filter_batch(self, keep_indices: list[int]) -> None:
        self.reqs = [self.reqs[i] for i in keep_indices]


class FakeEngine:
    def __init__(self) -> None:
        self.freed: list[HostKV] = []
        self.host_pool = SimpleNamespace(allocator=SimpleNamespace(num_used=0), num_blocks=8)

        self.untracked: list[str] = []

    def free(self, host_kv: HostKV) -> None:
        self.freed.append(host_kv)

    def untrack(self, rid: str) -> None:
        self.untracked.append(rid)


class FakeTree:
    def __init__(self) -> None:
        self.unlocked: list[Any] = []

    def unlock(self, lock: Any) -> None:
        self.unlocked.append(lock)


def make_runtime(waiting: list[FakeReq] | None = None) -> RotaSchedRuntime:
    """The real constructor on a fake scheduler and engine: it does no I/O (startup.create_runtime does)."""
    requeued: list[FakeReq] = []
    sched = SimpleNamespace(waiting_queue=list(waiting or []), tree_cache=FakeTree(), requeued=requeued,
                            chunked_prefill_size=512, max_total_num_tokens=10_000_000, chunked_req=None,
                            _add_request_to_queue=lambda r, is_retracted=False: requeued.append(r))
    rt = RotaSchedRuntime(sched, SuperInferConfig(), engine=FakeEngine())  # type: ignore[arg-type]
    assert rt.budget == 2400 and rt.metrics is None  # the paper's budget: the pool is large
    return rt


def test_abort_releases_rotary_and_resume_locks() -> None:
    rt = make_runtime()
    a, b, c = FakeReq("a"), FakeReq("b"), FakeReq("c")
    for r in (a, b, c):
        rt.clocks.clock(r, 0.0)
    rt.store.entries["a"] = rotation.RotaryEntry(a, HostKV((3,), 4, 16), 0.0)
    rt.store.entries["c"] = rotation.RotaryEntry(c, HostKV((4,), 4, 16), 0.0)
    rt.store.resume_locks["b"] = "lock-b"
    rt.before_abort(SimpleNamespace(abort_all=False, rid="a"))
    assert rt.sched.waiting_queue == [a]  # SGLang's own abort path finds it there
    assert [k.block_ids for k in rt.engine.freed] == [(3,)]  # type: ignore[attr-defined]
    assert "c" in rt.store.entries and rt.stats.aborted_rotary == 1 and "a" not in rt.clocks.by_rid
    rt.before_abort(SimpleNamespace(abort_all=True, rid=""))
    assert not rt.store.entries and not rt.store.resume_locks and not rt.clocks.by_rid
    assert rt.sched.tree_cache.unlocked == ["lock-b"] and not rt.has_work()
    assert set(rt.engine.untracked) == {"a", "b", "c"}  # type: ignore[attr-defined]


def test_admit_in_order_offers_only_chosen_and_keeps_the_rest() -> None:
    w = [FakeReq(x) for x in "abcd"]
    rt = make_runtime(waiting=w)
    rt.store.resume_locks["c"] = "lock-c"
    late = FakeReq("late")

    def original(sched: Any, running_batch: Any) -> str:
        assert [r.rid for r in sched.waiting_queue] == ["c", "a"]  # LVF's order, nobody else
        sched.waiting_queue = [r for r in sched.waiting_queue if r.rid != "c"] + [late]
        return "plan"

    assert rt._admit_in_order(original, rt.sched, FakeBatch([]), [w[2], w[0]]) == "plan"
    assert [r.rid for r in rt.sched.waiting_queue] == ["a", "b", "d", "late"]
    assert rt.sched.tree_cache.unlocked == ["lock-c"] and "c" not in rt.store.resume_locks


def test_a_request_sglang_queues_during_admission_stays_queued() -> None:
    """Issue 17: SGLang's get_new_batch_prefill first moves requests whose grammar compiled (or that
    were aborted in the grammar queue) into the waiting queue, appending to the very list it was
    handed (`_add_request_to_queue`). That list was our `order`, so such a request counted as one we
    offered, and the queue rebuilt from the snapshot before the call lost it: never admitted, never
    answered, with the server idle. Both ways SGLang's call can end are checked: admitting nobody
    (the list left as it is) and admitting someone (the list rebuilt without them)."""
    for admits in ([], ["a"]):
        w = [FakeReq("a"), FakeReq("b")]
        rt = make_runtime(waiting=w)
        compiled = FakeReq("grammar-ready")

        def original(sched: Any, running_batch: Any) -> str:
            sched.waiting_queue.append(compiled)  # as Scheduler._add_request_to_queue does
            if admits:
                sched.waiting_queue = [r for r in sched.waiting_queue if r.rid not in admits]
            return "plan"

        rt._admit_in_order(original, rt.sched, FakeBatch([]), [w[0]])
        expected = [r for r in ["a", "b"] if r not in admits] + ["grammar-ready"]
        assert [r.rid for r in rt.sched.waiting_queue] == expected, admits


def test_the_decisions_prefill_cap_is_the_steps_chunk_size() -> None:
    rt = make_runtime(waiting=[FakeReq("a")])
    seen: list[int] = []

    def original(sched: Any, running_batch: Any) -> None:
        seen.append(sched.chunked_prefill_size)

    rt._decision = Decision(prefill_cap=96)
    rt._admit_in_order(original, rt.sched, FakeBatch([]), [])
    rt._decision = Decision(prefill_cap=4096)  # above the configured size: the configured one
    rt._admit_in_order(original, rt.sched, FakeBatch([]), [])
    rt.sched.is_mixed_chunk = True  # SGLang charges the 3 decode rows to the budget: added back
    rt._decision = Decision(prefill_cap=96)
    rt._admit_in_order(original, rt.sched, FakeBatch([FakeReq("r1"), FakeReq("r2"), FakeReq("r3")]), [])
    assert seen == [96, 512, 99] and rt.sched.chunked_prefill_size == 512  # restored after the step


def test_a_step_the_decision_keeps_unmixed_runs_its_prefill_alone() -> None:
    """`Decision.mix` False turns SGLang's mixed chunk off for that one call (unless a restored
    request is queued: a resume's one-token extend rides along), and back on after it."""
    rt = make_runtime(waiting=[FakeReq("a")])
    seen: list[bool] = []

    def original(sched: Any, running_batch: Any) -> None:
        seen.append(sched.is_mixed_chunk)

    rt.sched.is_mixed_chunk = True
    for decision in (Decision(), Decision(mix=False)):
        rt._decision = decision
        rt._admit_in_order(original, rt.sched, FakeBatch([FakeReq("r1")]), [])
    rt.store.resume_locks["resumed"] = object()
    rt._admit_in_order(original, rt.sched, FakeBatch([FakeReq("r1")]), [])
    del rt.store.resume_locks["resumed"]
    rt.sched.is_mixed_chunk = False  # a server without mixed chunk stays without it
    rt._decision = Decision()
    rt._admit_in_order(original, rt.sched, FakeBatch([FakeReq("r1")]), [])
    assert seen == [True, False, True, False] and rt.sched.is_mixed_chunk is False


def test_slo_from_custom_params_and_bad_values_fall_back() -> None:
    rt = make_runtime()
    r = FakeReq("x")
    r.sampling_params.custom_params = {"slo_class": "interactive", "other": 1}
    assert rt.clocks.clock(r, 0.0).slo == Slo(1000.0, 50.0) and rt.clocks.by_rid["x"].slo_class == "interactive"
    bad = FakeReq("y")
    bad.sampling_params.custom_params = {"ttft_slo_ms": -1}
    assert rt.clocks.clock(bad, 0.0).slo == rt.clocks.default_slo  # validated earlier, in the tokenizer


def test_a_clock_starts_when_the_http_layer_received_the_request() -> None:
    import time

    from superinfer_sgl.integration.http_slo import MAX_INTAKE_S, RECEIVED_KEY, intake_delay_s

    rt = make_runtime()
    r = FakeReq("x")
    r.sampling_params.custom_params = {RECEIVED_KEY: time.time() - 0.25}
    arrival = rt.clocks.clock(r, 100.0).arrival
    assert 99.7 < arrival <= 99.75  # backdated by what the client already waited
    assert intake_delay_s({RECEIVED_KEY: 50.0}, 40.0) == 0.0  # another process's clock ahead
    assert intake_delay_s({RECEIVED_KEY: 0.0}, 1e9) == MAX_INTAKE_S
    for odd in ({RECEIVED_KEY: True}, {RECEIVED_KEY: "1"}, {RECEIVED_KEY: float("nan")}, {}, None, [1]):
        assert intake_delay_s(odd, 1e9) == 0.0


def test_default_budget_is_the_papers_capped_by_the_pool() -> None:
    cfg = SuperInferConfig()
    assert rotation_budget(cfg.rotation_budget_blocks, 10_000_000, 16) == 2400
    assert rotation_budget(cfg.rotation_budget_blocks, 2048, 16) == 16  # 128 blocks of 16 tokens / 8
    assert rotation_budget(SuperInferConfig(rotation_budget_blocks=7).rotation_budget_blocks, 2048, 16) == 7


def test_a_mixed_steps_prefill_cost_is_its_time_beyond_a_decode_step() -> None:
    clocks = Clocks(SuperInferConfig(), StepCosts(0.0, 0.0, 0.05, 0.0))
    mixed = SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True, is_mixed=lambda: True)
    # 100 prompt tokens plus 4 decode rows (SGLang counts both in extend_num_tokens), 0.25 s in all
    last = SimpleNamespace(forward_mode=mixed, extend_num_tokens=104, decoding_reqs=[0] * 4)
    clocks.measure_last_step(None, 10.0)  # the first iteration: nothing before it to time
    clocks.measure_last_step(last, 10.25)
    assert abs(clocks.meter.costs.prefill_s_per_token - 0.20 / 100) < 1e-12


def test_the_cpu_prior_prices_a_rotation_before_any_is_measured() -> None:
    assert step_prior(on_cpu=True).rotation_s == CPU_ROTATION_S_PRIOR and step_prior(on_cpu=False).rotation_s == 0.0
    assert make_runtime().clocks.meter.costs.rotation_s == CPU_ROTATION_S_PRIOR  # a scheduler without a device


def test_abort_matches_by_rid_prefix_or_all() -> None:
    match = abort_match(SimpleNamespace(abort_all=False, rid="req-1"))
    assert match("req-1") and match("req-1-n2") and not match("req-2")
    assert abort_match(SimpleNamespace(abort_all=True, rid="x"))("anything")


def test_the_step_policy_reads_the_output_share_finished_requests_taught() -> None:
    """What requests of unknown length decoded (Clocks.outputs) reaches shedding each step."""
    from superinfer_sgl.rotasched.output_share import MIN_FINISHED

    rt = make_runtime()
    assert rt._step_policy().params.eos_output_share == 0.0
    for i in range(MIN_FINISHED):
        req = FakeReq(f"r{i}", output_ids=[1] * 30, sampling_params=sampling(120, ignore_eos=False))
        rt.clocks.clock(req, 0.0)
        assert rt.on_finished(req) is not None
    assert rt._step_policy().params.eos_output_share == pytest.approx(0.25)
    probe = FakeReq("HEALTH_CHECK_1", output_ids=[1], sampling_params=sampling(1, ignore_eos=False))
    rt.clocks.clock(probe, 0.0)
    rt.on_finished(probe)  # SGLang's own health probe (metrics.metered): it teaches nothing
    assert rt.clocks.outputs.seen == MIN_FINISHED
