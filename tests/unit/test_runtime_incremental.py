"""The runtime's incremental step (views rebuilt only for requests whose inputs changed, waiting
requests looked at when they enter the queue, the pending index kept between steps, the running
reserve summed once, the admission order in one pass) decides exactly what building everything
afresh decides, over random step sequences: arrivals, admissions, decode steps, rotations out and
back, finishes, the clock and SGLang's new-token ratio moving."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace

from hypothesis import example, given, settings
from hypothesis import strategies as st

from fakes import FakeReq, sampling
from test_lvf_properties import NOW, _params, _views
from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.integration.runtime import RotaSchedRuntime
from superinfer_sgl.integration.views import StepViews
from superinfer_sgl.rotasched import Decision, ReqState, planner
from superinfer_sgl.rotasched.goodput import GoodputParams, StepCosts

OPS = ("arrive", "admit", "decode", "rotate", "resume", "finish", "wait", "ratio", "abort")
# fields a kept running view may hold from its build (what the policy reads of them is checked)
RUNNING_CACHED = {"last_token", "misses_left", "ttft_met", "outputs_left"}
# fields a running view holds from its build until LVF asks for fresh ones (StepQueue.fresh_running)
LAZY = frozenset({"blocks_held", "rotatable"})
# goodput's costs, with and without the one-step late token stream (deadline_budget reads running
# requests still waiting for their first token then)
COSTS = (GoodputParams(StepCosts(2e-4, 0.002, 0.03, 0.001, 0.1)),
         GoodputParams(StepCosts(1e-3, 0.002, 0.03, 0.001), emit_after_next_step=True))


def _runtime(policy: str, clip: int = 4096) -> RotaSchedRuntime:
    sched = SimpleNamespace(waiting_queue=[], tree_cache=None, max_total_num_tokens=100_000,
                            chunked_prefill_size=512, chunked_req=None, last_batch=None,
                            new_token_ratio_tracker=SimpleNamespace(current=0.7))
    engine = SimpleNamespace(host_pool=SimpleNamespace(allocator=SimpleNamespace(num_used=0), num_blocks=8),
                             room_blocks=lambda enough: 1 << 20,
                             untrack=lambda rid: None)
    classes = '{"a": {"ttft_ms": 400, "tbt_ms": 50, "weight": 2}, "b": {"ttft_ms": 3000, "tbt_ms": 200}}'
    cfg = SuperInferConfig(policy=policy, rotary_block_tokens=4, min_stint_ms=300.0, slo_classes=classes)
    return RotaSchedRuntime(sched, cfg, engine=engine, clip=clip)  # type: ignore[arg-type]


class World:
    """Requests moving between the fake scheduler's queue, its running batch and the rotary set."""

    def __init__(self, policy: str, clip: int = 4096) -> None:
        self.rt = _runtime(policy, clip)
        self.running: list[FakeReq] = []
        self.now, self.n = 100.0, 0

    def apply(self, op: str, x: int) -> None:
        rt, sched = self.rt, self.rt.sched

        def pick(xs: list) -> object:
            return xs[x % len(xs)]

        if op == "arrive":
            self.n += 1
            sp = sampling(8 + x % 40, ignore_eos=x % 3 == 0, custom_params={"slo_class": "ab"[x % 2]})
            req = FakeReq(f"r{self.n}", list(range(4 + x % 30)), [], sampling_params=sp)
            req.kv.kv_allocated_len = 1 << 20
            sched.waiting_queue.append(req)
        elif op == "admit" and sched.waiting_queue:
            req = pick(sched.waiting_queue)
            sched.waiting_queue.remove(req)
            rt.store.resume_locks.pop(req.rid, None)
            req.output_ids.append(1)
            self.running.append(req)
        elif op == "decode":
            for req in self.running:
                req.output_ids.append(2)
        elif op == "rotate" and self.running:
            req = pick(self.running)
            self.running.remove(req)
            n = len(req.origin_input_ids) + len(req.output_ids) - 1
            rt.store.entries[req.rid] = SimpleNamespace(req=req, host_kv=SimpleNamespace(num_tokens=n))
            rt.clocks.by_rid[req.rid].set_state(ReqState.ROTARY, self.now)
        elif op == "resume" and rt.store.entries:
            rid = pick(sorted(rt.store.entries))
            entry = rt.store.entries.pop(rid)
            rt.store.resume_locks[rid] = object()
            sched.waiting_queue.append(entry.req)
        elif op == "finish" and self.running:
            req = pick(self.running)
            self.running.remove(req)
            rt.on_finished(req)
        elif op == "wait":
            self.now += (x % 7) * 0.07
        elif op == "abort" and (queued := [r for r in sched.waiting_queue if r.rid not in rt.store.resume_locks]):
            # SGLang's abort: our hook first, then out of its queue (not a resumed request: its
            # radix-tree lock needs a tree this fake scheduler does not have)
            req = pick(queued)
            if not any(rid.startswith(req.rid) for rid in rt.store.resume_locks):
                rt.before_abort(SimpleNamespace(rid=req.rid, abort_all=False))
                sched.waiting_queue.remove(req)
        elif op == "ratio":
            sched.new_token_ratio_tracker.current = max(0.1, sched.new_token_ratio_tracker.current - 0.05)

    def check_step(self) -> None:
        rt = self.rt
        self.now += 0.01
        rt.clocks.observe(self.running, rt.step_views.watch.look(rt.sched.waiting_queue), self.now)  # as the runtime
        young = self.now - rt.clocks.min_stint_s
        args = (rt.sched, self.running, rt.clocks.by_rid, rt.store.resume_locks, rt.store.entries, young)
        got, reserved = rt.step_views.build(*args)
        want, want_reserved = StepViews(rt.rules, reuse=False).build(*args)
        assert reserved == want_reserved  # bit for bit: the same sum in the same order
        assert [v.rid for v in got.running] == [v.rid for v in want.running]
        assert got.pending.blocks_needed == want.pending.blocks_needed
        goodput = rt.cfg.policy == "goodput"
        by_rid = {v.rid: v for v in want}
        # the running views as kept (before LVF asks for fresh ones), then fresh
        for views, lazy in ((got.running, LAZY), (list(got), frozenset())):
            assert sorted(v.rid for v in views if v.state is ReqState.RUNNING) == sorted(
                v.rid for v in want.running)
            for a in views:
                self._compare(a, by_rid[a.rid], goodput, lazy)
        assert sorted(v.rid for v in got) == sorted(by_rid)
        budget = 1 + len(self.running) % 9
        for costs in COSTS:
            policy = rt.policy_class.for_step(lambda: costs)
            for free in (0, 7, 60):
                kept, _ = rt.step_views.build(*args)  # a fresh queue whose running views are as kept
                d = planner.plan_step(kept, free, budget, self.now, rt.params, policy, False)
                assert d == planner.plan_step(want, free, budget, self.now, rt.params, policy, False)

    @staticmethod
    def _compare(a: object, b: object, goodput: bool, lazy: frozenset[str]) -> None:
        for f in fields(a):
            if a.state is ReqState.RUNNING and f.name in RUNNING_CACHED | lazy:
                if goodput and f.name in ("misses_left", "ttft_met"):  # goodput reads these
                    assert getattr(a, f.name) == getattr(b, f.name), (a.rid, f.name)
                if f.name == "last_token":
                    assert (a.last_token is None) == (b.last_token is None), a.rid
                continue
            assert getattr(a, f.name) == getattr(b, f.name), (a.rid, f.name)


_steps = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 1000)), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
# clip 16: some requests' outputs left past SGLang's reserve clip (their reserve clipped)
@given(_steps, st.sampled_from(["goodput", "paper"]), st.sampled_from([4096, 16]))
# a missed gap changes a running view kept between steps (ReqClock.version)
@example([("arrive", 0), ("admit", 0), ("decode", 0), ("wait", 6), ("decode", 0)], "goodput", 4096)
# an abort drops clocks: what is still queued is looked at again, what left is forgotten
@example([("arrive", 0), ("arrive", 1), ("arrive", 2), ("abort", 1), ("arrive", 3), ("admit", 0)], "goodput", 4096)
# a view rebuilt by the lazy refresh is the one the next step keeps (the SGLang ratio moved)
@example([("arrive", 469), ("admit", 0), ("decode", 0), ("ratio", 0), ("decode", 0)], "goodput", 4096)
# a kept batch whose outputs left cross the clip while it decodes
@example([("arrive", 30), ("admit", 0), ("arrive", 7), ("admit", 0)] + [("decode", 0)] * 12, "goodput", 16)
def test_incremental_views_decide_as_fresh_ones(steps: list[tuple[str, int]], policy: str, clip: int) -> None:
    world = World(policy, clip)
    for op, x in steps:
        world.apply(op, x)
        world.check_step()


def _reference_order(waiting: list[str], restored: list[str], decision: Decision) -> list[str]:
    """planner.admission_order as it was written before its one-pass form."""
    first = [*restored, *decision.admit]
    rank = {rid: i for i, rid in enumerate(first)}
    ranked = sorted((rid for rid in dict.fromkeys([*waiting, *restored]) if rid in rank), key=rank.__getitem__)
    rest = [rid for rid in waiting if rid not in rank]
    if decision.blocked is not None:
        rest = [rid for rid in rest if rid == decision.blocked]
    return ranked + rest


_rids = st.lists(st.sampled_from([f"q{i}" for i in range(12)]), unique=True, max_size=12)


@settings(max_examples=300, deadline=None)
@given(_rids, _rids, _rids, st.none() | st.sampled_from([f"q{i}" for i in range(12)]))
def test_admission_order_is_the_reference(waiting: list[str], restored: list[str], admit: list[str],
                                          blocked: str | None) -> None:
    restored = [r for r in restored if r not in admit][:3] + [r for r in restored if r in admit][:1]
    decision = Decision(admit=tuple(admit), blocked=blocked)
    assert planner.admission_order(waiting, restored, decision) == _reference_order(waiting, restored, decision)


@settings(max_examples=200, deadline=None)
@given(_views, st.integers(0, 120), st.integers(0, 60), _params, st.sampled_from(["goodput", "paper"]),
       st.sampled_from([1e-4, 2e-3]))
def test_lazy_head_order_decides_as_a_full_sort(views: list, free: int, budget: int, params: object,
                                                policy: str, per_token: float) -> None:
    """LVF's head scans read the ranked rows from a heap as far as they go; a full sort, as LVF
    did before, gives the same decision (goodput with costs that defer some prefills too)."""
    import pytest

    from superinfer_sgl.rotasched import lvf

    pol = planner.POLICIES[policy].for_step(lambda: GoodputParams(StepCosts(per_token, 0.002, 0.03, 0.001)))
    lazy = lvf.lvf_decide(views, free, budget, NOW, params, pol)  # type: ignore[arg-type]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(lvf, "_LazyOrder", sorted)
        assert lvf.lvf_decide(views, free, budget, NOW, params, pol) == lazy  # type: ignore[arg-type]
