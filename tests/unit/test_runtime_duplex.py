"""RotaSchedRuntime steps driving a real RotationEngine: full-duplex rotation and prefetch.

The scheduler is a fake with SGLang's shapes: a token allocator whose free list is LIFO (a slot just
freed is the next one handed out, so a resume given an outgoing request's slots is exercised), a
radix tree that records what is inserted, and release_req returning a request's slots. LVF's
decision is scripted per iteration. Lanes are synchronous on a CPU; every restored byte is compared.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fakes import FakeReq as Req
from fakes import sampling
from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.duplexkv.device_pool import DevicePoolView
from superinfer_sgl.duplexkv.engine import RotationEngine
from superinfer_sgl.duplexkv.host_pool import HostKVPool
from superinfer_sgl.integration import rotation
from superinfer_sgl.integration.runtime import RotaSchedRuntime
from superinfer_sgl.rotasched import Decision, DecisionSync
from superinfer_sgl.rotasched.request_view import ReqState

LAYERS, HEADS, DIM, BT = 2, 2, 4, 4


class FakeAllocator:
    page_size = 1

    def __init__(self, size: int) -> None:
        self.size = size
        self.free_list = list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self.free_list)

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_list):
            return None
        taken, self.free_list = self.free_list[:n], self.free_list[n:]
        return torch.tensor(taken, dtype=torch.int64)

    def free(self, slots: torch.Tensor) -> None:
        freed = slots.tolist()
        assert not set(freed) & set(self.free_list), "double free"
        self.free_list = freed + self.free_list  # LIFO: freed slots are handed out first


class FakeTree:
    disable = False

    def __init__(self) -> None:
        self.inserted: dict[tuple[int, ...], torch.Tensor] = {}
        self.locked: list[Any] = []
        self.unlocked: list[Any] = []

    def insert(self, params: Any) -> Any:
        self.inserted[tuple(params.key.token_ids)] = params.value.clone()
        return SimpleNamespace(prefix_len=0)

    def match_prefix(self, params: Any) -> Any:
        return SimpleNamespace(last_device_node=tuple(params.key.token_ids), device_prefix_len=0)

    def lock(self, node: Any) -> Any:
        self.locked.append(node)
        return ("lock", node)

    def unlock(self, lock: Any) -> None:
        self.unlocked.append(lock)

    def evictable_size(self) -> int:
        return 0

    def supports_prefix_sharing(self) -> bool:
        return False  # evict_from_tree_cache is then a no-op


class Batch:
    def __init__(self, reqs: list[Req]) -> None:
        self.reqs = reqs
        self.batch_is_full = True

    def filter_batch(self, keep_indices: list[int]) -> None:
        self.reqs = [self.reqs[i] for i in keep_indices]


class Harness:
    """A runtime on a fake scheduler; `step(decision)` runs one iteration with LVF's answer scripted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, pool: int = 64, host_blocks: int = 32,
                 real_sglang: bool = False, store_dtype: torch.dtype | None = None, **cfg: Any) -> None:
        self.dev = DevicePoolView.synthetic(pool + 1, LAYERS, HEADS, DIM, torch.float32)
        for buf in (*self.dev.k_buffers, *self.dev.v_buffers):
            buf.copy_(torch.randn_like(buf))
        host = HostKVPool(host_blocks, LAYERS, HEADS, DIM, BT, torch.float32, pin=False, store_dtype=store_dtype)
        self.engine = RotationEngine(self.dev, host, "torch")
        self.alloc, self.tree = _sglang_pools(pool) if real_sglang else (FakeAllocator(pool), FakeTree())
        kvcache = SimpleNamespace(layer_num=LAYERS, start_layer=0,
                                  get_kv_buffer=lambda i: (self.dev.k_buffers[i], self.dev.v_buffers[i]))
        self.alloc.get_kvcache = lambda: kvcache  # type: ignore[attr-defined]
        self.requeued: list[Req] = []
        self.sched = SimpleNamespace(
            req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros((8, 256), dtype=torch.int32)),
            token_to_kv_pool_allocator=self.alloc, tree_cache=self.tree, waiting_queue=[],
            chunked_req=None, last_batch=None, max_total_num_tokens=pool, chunked_prefill_size=None,
            _add_request_to_queue=lambda r, is_retracted=False: self.requeued.append(r),
        )
        import sglang.srt.managers.schedule_batch as sb

        monkeypatch.setattr(sb, "release_req", self._release)
        config = SuperInferConfig(rotary_block_tokens=BT, rotation_budget_blocks=64, **cfg)
        self.rt = RotaSchedRuntime(self.sched, config, engine=self.engine)
        self.batch = Batch([])
        self.kv: dict[str, list[torch.Tensor]] = {}  # expected bytes of each request's restorable tokens
        self.decisions: list[Decision] = []
        self.rt._decide = lambda views, running_batch, now, policy, budget: self.decisions.pop(0)  # type: ignore[method-assign]
        self.rotate_calls: list[dict[str, Any]] = []
        real_rotate = self.engine.rotate

        def rotate(out: Any = (), inn: Any = (), **kw: Any) -> Any:
            out, inn = list(out), list(inn)
            self.rotate_calls.append({"out": [o.rid for o in out], "in": [i.slots.clone() for i in inn], **kw})
            return real_rotate(out=out, inn=inn, **kw)

        self.engine.rotate = rotate  # type: ignore[method-assign]
        self.to_device = 0
        path_to_device = self.engine._path.to_device

        def to_device(*args: Any) -> None:
            self.to_device += 1
            path_to_device(*args)

        self.engine._path.to_device = to_device  # type: ignore[method-assign]

    def _release(self, *, req: Req, token_to_kv_pool_allocator: Any, req_to_token_pool: Any, **_: Any) -> None:
        row = req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len]
        token_to_kv_pool_allocator.free(row.to(torch.int64).clone())
        req.kv.holds_kv = False

    def run(self, rid: str, prompt: int, outputs: int, pool_idx: int, page: int = 1) -> Req:
        """A running request whose KV (random bytes) fills freshly allocated slots, on whole pages
        of `page` tokens (as SGLang's paged extend allocates)."""
        n = prompt + outputs
        slots = self.alloc.alloc(-(-n // page) * page)
        assert slots is not None
        slots = slots[:n]
        for buf in (*self.dev.k_buffers, *self.dev.v_buffers):
            buf[slots] = torch.randn((n, *buf.shape[1:]))
        self.sched.req_to_token_pool.req_to_token[pool_idx, :n] = slots.to(torch.int32)
        kv = SimpleNamespace(req_pool_idx=pool_idx, holds_kv=True, kv_allocated_len=n)
        req = Req(rid, list(range(100, 100 + prompt)), list(range(outputs)), kv, sampling(max_new_tokens=0))
        self.kv[rid] = self.device_kv(slots[: n - 1])
        self.batch.reqs.append(req)
        return req

    def device_kv(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return [b[slots].clone() for b in (*self.dev.k_buffers, *self.dev.v_buffers)]

    def step(self, **decision: Any) -> None:
        self.decisions.append(Decision(**decision))
        self.rt.around_prefill(lambda sched, batch: None, self.sched, self.batch)  # admits nobody

    def restored_slots(self, req: Req) -> torch.Tensor:
        return self.tree.inserted[tuple((req.origin_input_ids + req.output_ids)[: len(self.kv[req.rid][0])])]

    def assert_restored(self, req: Req) -> torch.Tensor:
        slots = self.restored_slots(req)
        got = self.device_kv(slots)
        assert all(torch.equal(a, b) for a, b in zip(got, self.kv[req.rid], strict=True)), req.rid
        return slots


def _sglang_pools(pool: int) -> tuple[Any, Any]:
    """SGLang's own token allocator and radix tree, on a CPU."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    alloc = TokenToKVPoolAllocator(pool, torch.float32, "cpu", None, False)
    return alloc, RadixCache(CacheInitParams(disable=False, req_to_token_pool=None,
                                             token_to_kv_pool_allocator=alloc, page_size=1))


@pytest.mark.parametrize("tight", [False, True])
def test_a_step_with_outs_and_ins_is_one_rotate_call_carrying_both(
    monkeypatch: pytest.MonkeyPatch, tight: bool
) -> None:
    # tight: once c takes the slots b freed, no slot is free, so b's resume needs the slots a frees
    # this very step; its copy in must then be ordered after a's copy out (in_after_out).
    h = Harness(monkeypatch, pool=40 if tight else 64, prefetch=False)
    a, b = h.run("a", 12, 8, pool_idx=1), h.run("b", 13, 7, pool_idx=2)
    h.step(rotate_out=("b",))
    assert h.rt.store.entries.keys() == {"b"} and h.rotate_calls[-1]["out"] == ["b"] and h.rotate_calls[-1]["in"] == []
    others = [h.run("c", 14, 6, pool_idx=3)] if tight else []
    assert (h.alloc.available_size() == 0) is tight
    a_slots = h.sched.req_to_token_pool.req_to_token[1, :19].tolist()
    h.rotate_calls.clear()
    h.step(rotate_out=("a",), resume=("b",))
    assert len(h.rotate_calls) == 1  # both directions, one engine call
    call = h.rotate_calls[0]
    assert call["out"] == ["a"] and len(call["in"]) == 1 and call["in_after_out"] is tight
    b_slots = h.assert_restored(b)
    assert bool(set(b_slots.tolist()) & set(a_slots)) is tight  # tight: b really got a's old slots
    assert h.rt.store.entries.keys() == {"a"} and h.rt.store.resume_locks.keys() == {"b"}
    assert h.rt.stats.duplex_steps == 1 and (h.rt.stats.rotations_out, h.rt.stats.resumes) == (2, 1)
    assert h.rt.clocks.by_rid["a"].state == ReqState.ROTARY and h.rt.clocks.by_rid["b"].state == ReqState.WAITING
    assert h.rt.clocks.by_rid["a"].rotations == 1 and h.rt.has_work()
    assert h.batch.reqs == others and h.sched.waiting_queue == [b]
    # a's saved bytes are the ones it had before b's KV came into its old slots
    h.sched.waiting_queue.clear()
    h.rt.store.unlock_admitted([b])
    h.alloc.free(b_slots)
    h.step(resume=("a",))
    h.assert_restored(a)


def test_prefetched_resume_uses_the_prefetched_slots_and_copies_nothing_again(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    h.run("a", 12, 8, pool_idx=1)
    b = h.run("b", 13, 7, pool_idx=2)
    h.step(rotate_out=("b",))
    assert not h.rt.store.prefetched  # rotated out this very step: not a candidate
    free_before = h.alloc.available_size()
    h.step()  # LVF resumes nobody; b is the rotary request it would take next
    bpt = h.engine.device_pool.bytes_per_token
    assert h.rt.store.prefetched.keys() == {"b"} and h.rt.stats.prefetches == 1
    assert h.alloc.available_size() == free_before - 19 and h.engine.bytes_prefetched == 19 * bpt
    prefetched_slots = h.rt.store.prefetched["b"].slots
    bytes_in, copies = h.engine.bytes_in, h.to_device
    h.step(resume=("b",))
    assert h.to_device == copies and h.engine.bytes_in == bytes_in  # no second copy
    assert h.engine.prefetch_hits == 1 and h.engine.bytes_prefetch_hits == 19 * bpt
    assert h.rt.stats.prefetch_hits == 1 and not h.rt.store.prefetched
    assert torch.equal(h.assert_restored(b), prefetched_slots)
    assert torch.equal(h.rotate_calls[-1]["in"][0], prefetched_slots)


def test_an_unused_prefetch_is_cancelled_and_its_slots_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    h.run("a", 12, 8, pool_idx=1)
    b = h.run("b", 13, 7, pool_idx=2)
    h.step(rotate_out=("b",))
    free_before, host_before = h.alloc.available_size(), h.engine.host_pool.allocator.num_used
    h.step()
    assert h.rt.store.prefetched.keys() == {"b"}
    h.step()  # b not resumed: the guess was wrong
    assert not h.rt.store.prefetched and h.rt.stats.prefetch_cancelled == 1 and h.engine.prefetches_cancelled == 1
    assert h.alloc.available_size() == free_before and h.engine.host_pool.allocator.num_used == host_before
    h.step()
    assert not h.rt.store.prefetched  # a miss is not chased again this stint
    copies = h.to_device
    h.step(resume=("b",))
    assert h.to_device > copies and h.engine.prefetch_hits == 0
    h.assert_restored(b)


def test_a_tp_rank_runs_the_step_on_rank_0s_rotation_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each TP rank measures its own step times, so their rotation budgets can differ by a block; a
    rank that prefetched where rank 0 did not would hold device slots rank 0 keeps free, and their
    next steps would part. Rank 0's budget comes with its decision (`DecisionSync`)."""
    h = Harness(monkeypatch)  # this rank's own budget: the flag's 64 blocks
    h.run("a", 12, 8, pool_idx=1)
    h.run("b", 13, 7, pool_idx=2)
    h.sched.tp_size = 2
    rank0 = {"budget": 3}  # b's 19 tokens are 5 blocks of 4: over it
    h.rt.sync = DecisionSync(1, lambda _: (h.decisions.pop(0), rank0["budget"]))
    h.step(rotate_out=("b",))
    h.step()  # b is the next resume's candidate, but not within rank 0's budget
    assert h.rt.budget == 3 and not h.rt.store.prefetched and h.rt.stats.prefetches == 0
    rank0["budget"] = 5
    h.step()
    assert h.rt.budget == 5 and h.rt.store.prefetched.keys() == {"b"}


def test_aborting_a_prefetched_rotary_request_leaks_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    a = h.run("a", 12, 8, pool_idx=1)
    h.run("b", 13, 7, pool_idx=2)
    h.step(rotate_out=("b",))
    h.step()
    assert h.rt.store.prefetched.keys() == {"b"}
    h.rt.before_abort(SimpleNamespace(abort_all=False, rid="b"))
    assert not h.rt.store.prefetched and not h.rt.store.entries and [r.rid for r in h.sched.waiting_queue] == ["b"]
    assert h.alloc.available_size() == h.alloc.size - 20  # only a's slots are in use
    # a finishes: its mirror goes, its slots go back; nothing of b is left anywhere
    h.rt.on_finished(a)
    h._release(req=a, token_to_kv_pool_allocator=h.alloc, req_to_token_pool=h.sched.req_to_token_pool)
    h.engine.quiesce()
    assert h.alloc.available_size() == h.alloc.size and h.engine.host_pool.allocator.num_used == 0
    h.engine.check_invariants()


def test_a_retract_pause_sends_every_rotary_request_back_to_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's pause_generation(mode="retract") (its weight-update path) drops every running
    request's KV to recompute it: rotary requests follow (host KV freed, a prefetch given back),
    resume locks are released and every host mirror dropped, so no KV of the old weights comes
    back and nothing of ours keeps SGLang from flushing its cache."""
    h = Harness(monkeypatch)
    a = h.run("a", 12, 8, pool_idx=1)
    h.run("b", 13, 7, pool_idx=2)
    h.run("c", 10, 6, pool_idx=3)
    h.step(rotate_out=("b", "c"))
    h.step()
    assert h.rt.store.prefetched.keys() == {"b"}
    h.step(resume=("b",))  # b's KV is back under our lock, waiting for admission; c stays rotary
    assert h.rt.store.resume_locks.keys() == {"b"} and h.rt.store.entries.keys() == {"c"}
    rotation.eager_sync(h.sched, a, h.engine, max_bytes=None)  # a running request's mirror
    assert "a" in h.engine.mirror
    h.rt.after_retract_pause()
    assert not h.rt.has_work() and not h.rt.store.prefetched
    assert [r.rid for r in h.requeued] == ["c"] and h.rt.clocks.by_rid["c"].recomputes == 1
    assert h.tree.unlocked == [("lock", h.tree.locked[-1])]  # b's restored prefix is SGLang's again
    assert "a" not in h.engine.mirror
    h.engine.quiesce()
    assert h.engine.host_pool.allocator.num_used == 0
    h.engine.check_invariants()


def test_priority_preemption_drops_the_preempted_requests_mirrors(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's priority preemption (PrefillAdder.preempt_to_schedule) releases running requests to
    recompute them: their host mirrors would be stale, so the hook drops them."""
    from superinfer_sgl.integration import hooks as hooks_mod

    h = Harness(monkeypatch)
    a, b = h.run("a", 12, 8, pool_idx=1), h.run("b", 13, 7, pool_idx=2)
    for req in (a, b):
        rotation.eager_sync(h.sched, req, h.engine, max_bytes=None)
    monkeypatch.setattr(hooks_mod, "_RUNTIME", h.rt)
    hook = next(fn for target, fn, _ in hooks_mod.hooks(h.rt.cfg) if target.endswith("preempt_to_schedule"))
    assert hook(False, SimpleNamespace(preempt_list=[a])) is False and "a" in h.engine.mirror  # none preempted
    assert hook(True, SimpleNamespace(preempt_list=[a])) is True
    assert "a" not in h.engine.mirror and "b" in h.engine.mirror


def test_full_host_pool_falls_back_to_recompute_for_the_outs_that_do_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, host_blocks=6, eager_sync=False)
    a, b = h.run("a", 12, 8, pool_idx=1), h.run("b", 13, 7, pool_idx=2)  # 5 host blocks each
    h.step(rotate_out=("a", "b"))
    assert h.rt.store.entries.keys() == {"a"} and h.requeued == [b]
    assert h.rt.stats.recompute_fallbacks == 1 and h.rt.stats.rotations_out == 1
    assert h.rt.clocks.by_rid["b"].recomputes == 1 and h.rt.clocks.by_rid["b"].state == ReqState.WAITING
    assert not b.kv.holds_kv and h.batch.reqs == [] and not h.batch.batch_is_full
    assert h.alloc.available_size() == h.alloc.size  # both released
    h.step(resume=("a",))
    h.assert_restored(a)


def test_verify_hashes_across_a_duplex_step(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, prefetch=False, verify_rotation=True)
    h.run("a", 12, 8, pool_idx=1)
    b = h.run("b", 13, 7, pool_idx=2)
    h.step(rotate_out=("b",))
    assert "b" in h.rt.store.digests
    h.step(resume=("b",))
    b.kv.req_pool_idx, b.kv.holds_kv = 3, True  # admitted: SGLang matched the restored prefix
    h.sched.req_to_token_pool.req_to_token[3, :19] = h.restored_slots(b).to(torch.int32)
    h.rt.store.unlock_admitted([b])
    assert h.rt.stats.kv_verified == 1 and h.rt.stats.kv_mismatches == 0


def test_verify_checks_only_the_prefix_a_logprob_request_reads_back(monkeypatch: pytest.MonkeyPatch) -> None:
    # SGLang matches a return_logprob request only up to logprob_start_len (its prompt's length) and
    # extends the rest into fresh, not yet written slots: those are not restored KV to compare.
    h = Harness(monkeypatch, prefetch=False, verify_rotation=True)
    b = h.run("b", 13, 7, pool_idx=2)
    b.return_logprob, b.logprob_start_len = True, 13  # type: ignore[attr-defined]
    h.step(rotate_out=("b",))
    assert h.rt.store.digests["b"][0] == 13
    h.step(resume=("b",))
    b.kv.req_pool_idx, b.kv.holds_kv, b.prefix_len = 3, True, 13  # type: ignore[attr-defined]
    row = h.sched.req_to_token_pool.req_to_token
    row[3, :13] = h.restored_slots(b)[:13].to(torch.int32)
    row[3, 13:20] = h.alloc.alloc(7).to(torch.int32)  # the extend's slots, garbage until the forward
    h.rt.store.unlock_admitted([b])
    assert h.rt.stats.kv_verified == 1 and h.rt.stats.kv_mismatches == 0


def test_verify_skips_a_shorter_match_than_the_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, prefetch=False, verify_rotation=True)
    b = h.run("b", 13, 7, pool_idx=2)
    h.step(rotate_out=("b",))
    h.step(resume=("b",))
    b.kv.req_pool_idx, b.kv.holds_kv, b.prefix_len = 3, True, 10  # type: ignore[attr-defined]
    row = h.sched.req_to_token_pool.req_to_token
    row[3, :10] = h.restored_slots(b)[:10].to(torch.int32)
    row[3, 10:20] = h.alloc.alloc(10).to(torch.int32)
    h.rt.store.unlock_admitted([b])
    assert h.rt.stats.kv_unverified == 1 and h.rt.stats.kv_mismatches == 0 and "b" not in h.rt.store.digests


def test_a_held_rotary_request_is_prefetched_the_iteration_before_it_may_resume(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness(monkeypatch, test_hold_rotary_iters=3)
    h.run("a", 12, 8, pool_idx=1)
    b = h.run("b", 13, 7, pool_idx=2)
    h.step(rotate_out=("b",))  # iteration 1
    h.step(resume=("b",))  # 2: held, and not resumable next iteration either
    assert "b" in h.rt.store.entries and not h.rt.store.prefetched
    h.step(resume=("b",))  # 3: held; resumable next iteration, so prefetched now
    assert "b" in h.rt.store.entries and h.rt.store.prefetched.keys() == {"b"}
    copies = h.to_device
    h.step(resume=("b",))  # 4: resumed from the prefetched slots
    assert "b" not in h.rt.store.entries and h.to_device == copies and h.rt.stats.prefetch_hits == 1
    h.assert_restored(b)


def test_resume_through_sglangs_own_allocator_and_radix_tree_evicting_a_cached_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    h = Harness(monkeypatch, pool=40, real_sglang=True)
    h.run("a", 12, 8, pool_idx=1)
    b = h.run("b", 13, 7, pool_idx=2)
    h.step(rotate_out=("b",))
    for first, n in ((500, 10), (600, 5)):  # other requests' cached prefixes take most of what b freed
        cached = h.alloc.alloc(n)
        h.tree.insert(InsertParams(key=RadixKey(list(range(first, first + n))), value=cached, prev_prefix_len=0))
    assert h.alloc.available_size() == 5 and h.tree.evictable_size() == 15
    h.step(resume=("b",))  # needs 19 slots: 14 more than free, so both cached prefixes must go
    assert "b" not in h.rt.store.entries and h.tree.protected_size() == 19  # restored and locked by us
    tokens = (b.origin_input_ids + b.output_ids)[:19]
    match = h.tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    assert match.device_prefix_len == 19
    slots = h.tree.path_device_indices(match.last_device_node)
    assert all(torch.equal(x, y) for x, y in zip(h.device_kv(slots), h.kv["b"], strict=True))
    h.rt.store.unlock_admitted([b])
    assert h.tree.protected_size() == 0 and h.tree.evictable_size() == 19


def _resume_over_a_cached_prefix(monkeypatch: pytest.MonkeyPatch, same_bytes: bool,
                                 tp_size: int = 1) -> tuple[Harness, Req, int]:
    """b is rotated out; meanwhile another request caches b's first 8 tokens in the tree, with KV
    equal to b's own bytes or not (recomputed in another batch: equal tokens, other bits)."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    h = Harness(monkeypatch, pool=64, real_sglang=True)
    h.sched.tp_size = tp_size
    b = h.run("b", 13, 7, pool_idx=2)
    h.step(rotate_out=("b",))
    cached = h.alloc.alloc(8)
    for i, buf in enumerate((*h.dev.k_buffers, *h.dev.v_buffers)):
        buf[cached] = h.kv["b"][i][:8] + (0.0 if same_bytes else 1e-6)
    h.tree.insert(InsertParams(key=RadixKey(b.origin_input_ids[:8]), value=cached, prev_prefix_len=0))
    h.step(resume=("b",))
    assert "b" not in h.rt.store.entries and h.rt.store.resume_locks.keys() == {"b"}
    return h, b, int(cached[0])


@pytest.mark.parametrize("same_bytes", [True, False])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_resumed_request_reads_its_own_kv_bytes_even_over_a_recomputed_tree_prefix(
    monkeypatch: pytest.MonkeyPatch, same_bytes: bool, tp_size: int
) -> None:
    """Lossless rotation: what b reads after resuming is exactly what it saved. A tree prefix with
    identical bytes is shared as before; one whose bits differ is not used (b's cache namespace
    becomes private), where it used to replace b's own bytes."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from superinfer_sgl.integration.rotation import PRIVATE_SALT_TAG

    h, b, first_cached = _resume_over_a_cached_prefix(monkeypatch, same_bytes, tp_size)
    shared = same_bytes and tp_size == 1  # TP > 1 never shares (ranks could disagree on bytes)
    assert (b.cache_salt is None) is shared
    if not shared:
        assert PRIVATE_SALT_TAG in b.cache_salt
    tokens = (b.origin_input_ids + b.output_ids)[:19]
    match = h.tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens, b.extra_key, cache_salt=b.cache_salt)))
    assert match.device_prefix_len == 19  # what b's own prefill will match
    slots = h.tree.path_device_indices(match.last_device_node)
    assert all(torch.equal(x, y) for x, y in zip(h.device_kv(slots), h.kv["b"], strict=True))
    assert (int(slots[0]) == first_cached) is shared  # shared only when byte-identical
    assert h.engine.synced_tokens("b") == 19 // BT * BT  # its full restored blocks are its mirror, both cases
    h.rt.store.unlock_admitted([b])
    assert h.tree.protected_size() == 0


@pytest.mark.parametrize("stint_ms", [0.0, 5000.0])
def test_min_stint_keeps_young_running_requests_out_of_lvf_victims(monkeypatch: pytest.MonkeyPatch,
                                                                   stint_ms: float) -> None:
    """--min-stint-ms: a running request is a rotate-out candidate only after that long in its
    current stint (0: the paper's rule, at once)."""
    h = Harness(monkeypatch, min_stint_ms=stint_ms)
    req = h.run("a", 8, 4, 0)
    h.rt.clocks.observe([req], h.rt.sched.waiting_queue, 100.0)  # its stint starts now
    rotatable = {}
    for now in (100.5, 104.9, 105.0, 130.0):
        rotatable[now] = h.rt._views([req], now).fresh_running()[0].rotatable
    if stint_ms:
        assert rotatable == {100.5: False, 104.9: False, 105.0: True, 130.0: True}
    else:
        assert all(rotatable.values())


@pytest.mark.parametrize("blocked", [None, "w2"])
def test_a_blocked_urgent_request_keeps_the_others_out_of_the_fallback(monkeypatch: pytest.MonkeyPatch,
                                                                       blocked: str | None) -> None:
    """runtime._step's queue for SGLang's adder: LVF's admissions, then every other waiting
    request in arrival order, unless LVF stopped at an urgent request that did not fit: then only
    that one (token-exact admission may still fit it), so nobody takes the memory it waits for."""
    h = Harness(monkeypatch)
    waiting = [Req(f"w{i}", [1, 2, 3], [], SimpleNamespace(holds_kv=False), sampling(max_new_tokens=0))
               for i in range(4)]
    h.sched.waiting_queue = list(waiting)
    h.rt.clocks.observe([], h.rt.step_views.watch.look(h.rt.sched.waiting_queue), 100.0)  # as around_prefill
    h.decisions.append(Decision(admit=("w3",), contention=True, blocked=blocked))
    queue = h.rt._step(h.batch, [], 100.0, h.rt.budget)
    want = ["w3", "w2"] if blocked else ["w3", "w0", "w1", "w2"]
    assert [r.rid for r in queue] == want


@pytest.mark.parametrize("tree_holds_prefix", [False, True])
def test_fp8_host_blocks_resume_within_the_e4m3_bound(monkeypatch: pytest.MonkeyPatch,
                                                      tree_holds_prefix: bool) -> None:
    """--rotary-kv-dtype fp8_e4m3 through a runtime step with SGLang's allocator and radix tree: b
    resumes with every restorable token matched, its KV within e4m3's bound of what it saved. When
    the tree holds b's prefix (exact bytes), the lossy restore differs from it, so b reads its own
    bytes in a private cache namespace (not shared), as for any byte difference; when it does not,
    b's approximate KV still goes into a namespace of its own, where no other request reads it."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from superinfer_sgl.duplexkv import quant

    h = Harness(monkeypatch, pool=64, real_sglang=True, store_dtype=quant.FP8_DTYPE, rotary_kv_dtype="fp8_e4m3",
                eager_sync=True)
    b = h.run("b", 13, 7, pool_idx=2)
    h.step(rotate_out=("b",))
    if tree_holds_prefix:
        cached = h.alloc.alloc(8)
        for i, buf in enumerate((*h.dev.k_buffers, *h.dev.v_buffers)):
            buf[cached] = h.kv["b"][i][:8]
        h.tree.insert(InsertParams(key=RadixKey(b.origin_input_ids[:8]), value=cached, prev_prefix_len=0))
    h.step(resume=("b",))
    assert "b" not in h.rt.store.entries and h.rt.store.resume_locks.keys() == {"b"}
    assert rotation.PRIVATE_SALT_TAG in (b.cache_salt or "")  # lossy KV never enters the shared tree
    shared = h.tree.match_prefix(MatchPrefixParams(key=RadixKey((b.origin_input_ids + b.output_ids)[:19])))
    assert shared.device_prefix_len == (8 if tree_holds_prefix else 0)
    tokens = (b.origin_input_ids + b.output_ids)[:19]
    match = h.tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens, b.extra_key, cache_salt=b.cache_salt)))
    assert match.device_prefix_len == 19
    got = h.device_kv(h.tree.path_device_indices(match.last_device_node))
    for x, y in zip(h.kv["b"], got, strict=True):
        # e4m3's bound: 2**-4 relative for normals, half a subnormal step (scale x 2**-10) below;
        # the tensor-wide scale bounds every block's (values near zero made this flaky before)
        assert not torch.equal(x, y)
        assert bool(((x - y).abs() <= quant.error_bound(x, quant.scales_for(x.abs().amax()))).all())
    # one byte per value (the eager sync had copied the full blocks already)
    assert h.engine.bytes_out + h.engine.bytes_reused == 19 * LAYERS * 2 * HEADS * DIM
    h.rt.store.unlock_admitted([b])
    assert h.tree.protected_size() == 0


def test_eager_sync_is_on_where_copies_overlap_compute(monkeypatch: pytest.MonkeyPatch) -> None:
    """--eager-sync unset: off on CPU (each copy would be synchronous, on every step's critical
    path), on with CUDA; the flag overrides either way. On, a step copies running requests' full
    blocks ahead of any rotation; off, it copies nothing."""
    h = Harness(monkeypatch)
    assert h.rt.eager_sync is False
    h.run("a", 40, 9, pool_idx=1)  # 48 restorable tokens: 3 full blocks
    h.step()
    assert h.engine.bytes_eager_out == 0
    on = Harness(monkeypatch, eager_sync=True)
    on.run("a", 40, 9, pool_idx=1)
    on.step()
    assert on.engine.bytes_eager_out > 0
    h.sched.server_args = SimpleNamespace(device="cuda")
    assert RotaSchedRuntime(h.sched, SuperInferConfig()).eager_sync is True
    assert RotaSchedRuntime(h.sched, SuperInferConfig(eager_sync=False)).eager_sync is False


def test_first_tokens_stream_a_step_late_only_on_a_cpu_with_the_overlap_scheduler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU SGLang's overlap scheduler streams a step's tokens when the next step ends (its
    launch is the forward): goodput's deadline budget then also protects running requests still
    waiting for their first token. Not without the overlap scheduler, nor on a GPU."""
    h = Harness(monkeypatch)
    h.sched.enable_overlap = True
    assert RotaSchedRuntime(h.sched, SuperInferConfig()).emit_late is True
    h.sched.enable_overlap = False
    assert RotaSchedRuntime(h.sched, SuperInferConfig()).emit_late is False
    h.sched.enable_overlap = True
    h.sched.server_args = SimpleNamespace(device="cuda")
    assert RotaSchedRuntime(h.sched, SuperInferConfig()).emit_late is False


DECODE = SimpleNamespace(is_extend=lambda: False, is_decode=lambda: True)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_recompute_fallback_waits_a_step_under_the_overlap_scheduler(monkeypatch: pytest.MonkeyPatch,
                                                                        overlap: bool) -> None:
    """Under the overlap scheduler the last decode batch is still in flight while the next is built
    (the running batch is that batch: rotating out filters it, so the request is no longer seen in
    it): a request sent back to recompute and prefilled in the same step would take that decode's
    token and then sample it again (the soak's repeated tokens, docs/reliability.md). It is offered
    from the next step on; without overlap, at once. Never lost: it stays queued."""
    h = Harness(monkeypatch, host_blocks=6, eager_sync=False)
    h.run("a", 12, 8, pool_idx=1)
    b = h.run("b", 13, 7, pool_idx=2)  # 5 host blocks each: b does not fit
    h.sched.enable_overlap = overlap
    h.sched.last_batch = h.batch  # SGLang's decode step: the last batch is the running batch
    h.batch.forward_mode = DECODE
    h.sched._add_request_to_queue = lambda r, is_retracted=False: (h.requeued.append(r),
                                                                    h.sched.waiting_queue.append(r))
    offered: list[list[str]] = []

    def admit_nobody(sched: Any, batch: Any) -> None:
        offered.append([r.rid for r in sched.waiting_queue])

    h.decisions.append(Decision(rotate_out=("a", "b")))
    h.rt.around_prefill(admit_nobody, h.sched, h.batch)
    assert h.requeued == [b] and h.sched.waiting_queue == [b]
    assert offered == [[] if overlap else ["b"]]
    h.decisions.append(Decision())
    h.rt.around_prefill(admit_nobody, h.sched, h.batch)
    assert offered[-1] == ["b"]


def _queue_limited_scheduler(h: Harness, sent: list[str]) -> SimpleNamespace:
    """A stand-in `self` for SGLang's `Scheduler._abort_on_queued_limit`: a one-request queue under
    priority scheduling; its `_release_aborted_request` runs our BEFORE hook (hooks.py)."""
    from superinfer_sgl.integration import hooks as hooks_mod

    hook = next(fn for target, fn, _ in hooks_mod.hooks(h.rt.cfg) if target.endswith("._release_aborted_request"))
    owner = SimpleNamespace(_superinfer=h.rt)
    return SimpleNamespace(
        max_queued_requests=1, waiting_queue=h.sched.waiting_queue, enable_priority_scheduling=True,
        schedule_low_priority_values_first=True, _release_aborted_request=lambda req: hook(owner, req),
        beam_coordinator=SimpleNamespace(retire_group=lambda req: None),
        send_abort_output=lambda out, req: sent.append(req.rid))


def test_a_resumed_request_sglangs_queue_limit_turns_away_leaves_nothing_held(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's queue limit (`--max-queued-requests`, priority scheduling) pops a queued request for
    a better arrival and aborts it without `abort_request`: a resumed request waiting for admission
    must give back our lock on its restored prefix, its clock and its mirror, or the restored
    prefix stays locked and the server never counts as idle again."""
    import sglang.srt.managers.scheduler as sched_mod

    h = Harness(monkeypatch, prefetch=False)
    h.run("a", 12, 8, pool_idx=1)
    b = h.run("b", 13, 7, pool_idx=2)
    h.step(rotate_out=("b",))
    h.step(resume=("b",))  # b's KV is back under our lock; admission takes nobody this step
    assert h.rt.store.resume_locks.keys() == {"b"} and h.sched.waiting_queue == [b]
    b.priority = 10
    new = SimpleNamespace(rid="new", priority=0, time_stats=SimpleNamespace(trace_ctx=SimpleNamespace(abort=lambda **k: None)))
    b.time_stats.trace_ctx = SimpleNamespace(abort=lambda **k: None)
    monkeypatch.setattr(sched_mod, "_make_abort_req", lambda req, **kw: req)
    sent: list[str] = []
    assert sched_mod.Scheduler._abort_on_queued_limit(_queue_limited_scheduler(h, sent), new) is False
    assert sent == ["b"] and h.sched.waiting_queue == []
    assert not h.rt.store.resume_locks and h.tree.unlocked == [("lock", h.tree.locked[-1])]
    assert "b" not in h.rt.clocks.by_rid and "b" not in h.engine.mirror and not h.rt.has_work()
    h.step()  # the next step runs on without it
    h.engine.quiesce()
    h.engine.check_invariants()


def test_the_queue_limit_turning_away_a_requeue_of_ours_drops_its_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rotation that falls back to recompute requeues through SGLang's `_add_request_to_queue`,
    which may abort the request itself (its queue full): the step goes on, the clock goes."""
    h = Harness(monkeypatch, host_blocks=2, prefetch=False)  # b's 5 blocks do not fit: recompute
    h.run("a", 12, 8, pool_idx=1)
    h.run("b", 13, 7, pool_idx=2)
    h.step()

    def refused(req: Any, is_retracted: bool = False) -> None:
        h.rt.release_aborted(req)  # what SGLang's full queue does (`_abort_on_queued_limit`)
    h.sched._add_request_to_queue = refused
    h.step(rotate_out=("b",))
    assert "b" not in h.rt.clocks.by_rid and not h.rt.store.entries and h.rt.stats.recompute_fallbacks == 1


def test_a_resume_restamps_the_wait_in_the_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resumed request's wait starts at its resume, as SGLang's own requeue stamps it, so
    `SGLANG_REQ_WAITING_TIMEOUT` does not time it out for the time it ran before."""
    import time

    from sglang.srt.managers.scheduler import Scheduler

    monkeypatch.setenv("SGLANG_REQ_WAITING_TIMEOUT", "30")
    h = Harness(monkeypatch, prefetch=False)
    h.run("a", 12, 8, pool_idx=1)
    b = h.run("b", 13, 7, pool_idx=2)
    b.time_stats.wait_queue_entry_time = time.perf_counter() - 100  # queued 100 s ago, running since
    h.step(rotate_out=("b",))
    h.step(resume=("b",))  # resumed now; admission takes nobody this step
    poll = SimpleNamespace(waiting_queue=h.sched.waiting_queue, _collect_inflight_batches=lambda: [])
    assert Scheduler._poll_timeout_aborts(poll) == []


def test_an_aborted_running_request_is_not_rotated_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang aborts a running request by setting `to_finish` (it ends at its next forward's
    result): parked on host it would wait for a resume before its abort took effect."""
    h = Harness(monkeypatch, prefetch=False)
    a = h.run("a", 12, 8, pool_idx=1)
    h.run("b", 13, 7, pool_idx=2)
    from superinfer_sgl.integration.views import rotatable

    h.step()
    assert rotatable(h.sched, a)  # what the policy's views, LVF's victims and a shortage's ask
    a.to_finish = "abort"
    h.rt.before_abort(SimpleNamespace(abort_all=False, rid="a"))
    assert not rotatable(h.sched, a) and not rotation.can_rotate(a)
