"""A decode memory shortage answered by rotation (integration/decode_shortage.py), on SGLang 0.5.23's
real objects on a CPU: `Req`s, `ScheduleBatch` (its own check_decode_mem, retract_decode and
filter_batch), `MHATokenToKVPool`, `TokenToKVPoolAllocator`, `ReqToTokenPool`, the default tree
(`UnifiedRadixCache`), SGLang's `release_req`, and `Scheduler.update_running_batch` itself with our
hook (hooks.py's table entry) around `ScheduleBatch.retract_decode`; a real `RotationEngine` over the
pool's own buffers and a small host pool.

The running batch fills the device pool, so its next decode step does not fit. With room in the host
pool the shortage is answered by rotation: nobody is retracted or requeued, the goodput policy's lost
request goes first (SGLang would have taken another), the batch left passes SGLang's check, and a
resume through the runtime's own step restores the victim's KV byte for byte into other slots; once
everything finishes no device slot, request row or host block is left. With a full host pool
SGLang's own retraction runs, unchanged; when rotation frees too little, SGLang's retraction takes
the rest. `--decode-shortage retract` keeps SGLang's retraction
whatever the host pool holds; SGLang's forced test retraction (memory not short) rotates one request.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any, Iterator

import pytest
import torch

from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.duplexkv.device_pool import DevicePoolView
from superinfer_sgl.duplexkv.engine import RotationEngine
from superinfer_sgl.duplexkv.host_pool import HostKVPool
from superinfer_sgl.integration import hooks as hooks_mod
from superinfer_sgl.integration.runtime import RotaSchedRuntime
from superinfer_sgl.rotasched import Decision, ReqState

pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache")

SIZE, LAYERS, HEADS, DIM, BT = 64, 2, 2, 4, 4
# (rid, prompt, outputs): 23 + 22 + 19 = 64 tokens, the whole pool; the next step needs 3 more.
# SGLang's own retraction order takes fewest outputs, then the longest prompt, first: b.
REQS = (("a", 20, 3), ("b", 20, 2), ("c", 17, 2))


@pytest.fixture(scope="module")
def sglang_config() -> Iterator[None]:
    from superinfer_sgl.bench.sched_rig import sglang_context
    from superinfer_sgl.model_prep import prepare_default_model

    stack = sglang_context(str(prepare_default_model()))
    try:
        yield
    finally:
        stack.close()


class Rig:
    """SGLang's pools, tree, batch and a Scheduler (built without __init__) whose
    update_running_batch is SGLang's own; our hook installed around ScheduleBatch.retract_decode."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, host_blocks: int, **cfg: Any) -> None:
        from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
        from sglang.srt.managers.scheduler import Scheduler
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
        from sglang.srt.mem_cache.unified_cache.components import ComponentType
        from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
        from sglang.srt.sampling.sampling_params import SamplingParams
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        self.kv = MHATokenToKVPool(size=SIZE, page_size=1, dtype=torch.float32, head_num=HEADS, head_dim=DIM,
                                   layer_num=LAYERS, device="cpu", enable_memory_saver=False)
        for buf in (*self.kv.k_buffer, *self.kv.v_buffer):
            buf.copy_(torch.randn_like(buf))
        self.alloc = TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", self.kv, False)
        self.pool = ReqToTokenPool(size=8, max_context_len=256, device="cpu", enable_memory_saver=False)
        self.tree = UnifiedRadixCache(CacheInitParams(disable=False, req_to_token_pool=self.pool,
                                                      token_to_kv_pool_allocator=self.alloc, page_size=1,
                                                      tree_components=(ComponentType.FULL,)))
        self.reqs = []
        for rid, prompt, outputs in REQS:
            req = Req(rid, "", array("q", range(100 * (ord(rid) - 96), 100 * (ord(rid) - 96) + prompt)),
                      SamplingParams(max_new_tokens=40, ignore_eos=True))
            req.output_ids.extend(range(1, outputs + 1))
            n = req.seqlen
            row = self.pool.alloc([req])[0]
            self.pool.req_to_token[row, :n] = self.alloc.alloc(n).to(torch.int32)
            req.kv.kv_allocated_len = req.kv.kv_committed_len = n
            self.reqs.append(req)
        assert self.alloc.available_size() == 0
        self.kv_before = {r.rid: self.device_kv(self.slots(r)) for r in self.reqs}
        model = SimpleNamespace(vocab_size=1000, is_encoder_decoder=False)
        batch = ScheduleBatch.init_new(list(self.reqs), self.pool, self.alloc, self.tree, model, True,
                                       SpeculativeAlgorithm.NONE)
        lens = torch.tensor([r.seqlen for r in self.reqs])
        rows = torch.tensor([r.kv.req_pool_idx for r in self.reqs])
        batch.seq_lens = batch.orig_seq_lens = batch.seq_lens_cpu = lens
        batch.req_pool_indices = batch.req_pool_indices_cpu = rows
        batch.input_ids = torch.tensor([r.output_ids[-1] for r in self.reqs])
        batch.sampling_info = SimpleNamespace(filter_batch=lambda *a: None)
        batch.prepare_for_decode = lambda: None  # the step's tensors: not what is tested here
        self.batch = batch
        self.requeued: list[Any] = []
        s = object.__new__(Scheduler)
        for k, v in dict(
            enable_skip_finishing_decode=False, result_queue=[], forward_ct=1, decode_offload_manager=None,
            token_to_kv_pool_allocator=self.alloc, tree_cache=self.tree, req_to_token_pool=self.pool,
            new_token_ratio_tracker=SimpleNamespace(current=0.3, decay_step=lambda: None),
            metrics_reporter=SimpleNamespace(num_retracted_reqs=0, enable_metrics=False),
            _add_request_to_queue=lambda req, is_retracted=False: self.requeued.append((req, is_retracted)),
            waiting_queue=[], chunked_req=None, last_batch=None, max_total_num_tokens=SIZE, tp_rank=0,
            tp_size=1, enable_overlap=True, chunked_prefill_size=64, is_mixed_chunk=False,
            server_args=SimpleNamespace(device="cpu"),
        ).items():
            setattr(s, k, v)
        s.running_batch = batch
        self.sched = s
        dev = DevicePoolView.from_sglang(self.kv)
        self.engine = RotationEngine(dev, HostKVPool(host_blocks, LAYERS, HEADS, DIM, BT, torch.float32, pin=False),
                                     "torch")
        config = SuperInferConfig(rotary_block_tokens=BT, rotation_budget_blocks=64, prefetch=False,
                                  eager_sync=False, verify_rotation=True, **cfg)
        self.rt = RotaSchedRuntime(s, config, engine=self.engine)
        self.rt.clocks.observe(self.reqs, [], 0.0)
        monkeypatch.setattr(hooks_mod, "_RUNTIME", self.rt)
        hook = next(h for target, h, _ in hooks_mod.hooks(config) if target.endswith("ScheduleBatch.retract_decode"))
        original = ScheduleBatch.retract_decode
        monkeypatch.setattr(ScheduleBatch, "retract_decode", lambda batch: hook(original, batch))
        self.update_running_batch = lambda: Scheduler.update_running_batch(s, self.batch)

    def slots(self, req: Any, n: int | None = None) -> torch.Tensor:
        n = req.seqlen - 1 if n is None else n  # restorable: all but the last output token
        return self.pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)

    def device_kv(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return [b[slots].clone() for b in (*self.kv.k_buffer, *self.kv.v_buffer)]

    def req(self, rid: str) -> Any:
        return next(r for r in self.reqs if r.rid == rid)

    def lose(self, rid: str) -> None:
        """The request missed its TTFT: the goodput policy's lost (best-effort) request."""
        clk = self.rt.clocks.by_rid[rid]
        clk.first_token = clk.arrival + 2 * clk.slo.ttft_ms / 1000.0

    def scribble_free(self) -> None:
        """Every free slot goes to someone else and gets other bytes."""
        slots = self.alloc.alloc(self.alloc.available_size())
        for buf in (*self.kv.k_buffer, *self.kv.v_buffer):
            buf[slots] = torch.randn((len(slots), *buf.shape[1:]))
        self.alloc.free(slots)

    def resume(self, rid: str) -> None:
        """The runtime's own step with LVF's decision scripted: resume `rid` (admits nobody)."""
        self.rt._decide = lambda *a: Decision(resume=(rid,))  # type: ignore[method-assign]
        self.sched.last_batch = None
        self.rt.around_prefill(lambda sched, batch: None, self.sched, self.batch)

    def finish_all(self) -> None:
        """Every request leaves: SGLang releases the running ones, a resumed one's restored prefix
        is unlocked (admission) and dropped with the tree; the runtime forgets them."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        from superinfer_sgl.integration import rotation

        for req in self.batch.reqs:
            rotation.release(self.sched, req)
        self.rt.store.unlock_admitted(list(self.sched.waiting_queue))
        for req in self.reqs:
            self.rt.store.forget(req.rid)
        self.tree.evict(EvictParams(num_tokens=SIZE))


def _host_used(rig: Rig) -> int:
    return rig.engine.host_pool.allocator.num_used


def test_a_decode_shortage_is_answered_by_rotation_and_the_kv_comes_back_bit_exact(
        monkeypatch: pytest.MonkeyPatch, sglang_config: None) -> None:
    rig = Rig(monkeypatch, host_blocks=16)
    assert not rig.batch.check_decode_mem()  # the next step's 3 tokens do not fit
    rig.lose("c")  # SGLang's order would take b; the policy's lost request goes first
    c = rig.req("c")
    out = rig.update_running_batch()
    assert out is rig.batch and [r.rid for r in out.reqs] == ["a", "b"]
    assert rig.requeued == [] and rig.sched.waiting_queue == []  # nothing retracted or requeued
    st = rig.rt.stats
    assert st.sglang_retractions == 0 and st.recompute_fallbacks == 0
    assert st.shortages == {"rotated_requests": 1, "rotation": 1}
    assert rig.rt.store.entries.keys() == {"c"} and st.rotations_out == 1
    clk = rig.rt.clocks.by_rid["c"]
    assert clk.state is ReqState.ROTARY and clk.rotations == 1
    assert c.is_retracted and not c.kv.holds_kv  # an in-flight decode result skips it
    assert rig.batch.check_decode_mem()  # what SGLang's path expects of the batch it decodes
    assert rig.sched.new_token_ratio_tracker.current == pytest.approx((3 + 2 + 20 * 2) / 81)  # SGLang's rule
    assert _host_used(rig) == 5  # 18 restorable tokens in blocks of 4

    rig.scribble_free()  # c's old slots get other bytes
    rig.resume("c")
    assert "c" not in rig.rt.store.entries and rig.sched.waiting_queue == [c]
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    tokens = (c.origin_input_ids + c.output_ids)[:18]
    match = rig.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    assert match.device_prefix_len == 18  # admission takes the whole restored prefix
    restored = rig.tree.path_device_indices(match.last_device_node).to(torch.int64)
    got = rig.device_kv(restored)
    assert all(torch.equal(x, y) for x, y in zip(got, rig.kv_before["c"], strict=True))
    # admitted: its row starts with the matched prefix; the KV byte check reads it back
    c.kv.req_pool_idx = rig.pool.alloc([c])[0]
    rig.pool.req_to_token[c.kv.req_pool_idx, :18] = restored.to(torch.int32)
    c.prefix_len = 18
    rig.rt.store.unlock_admitted([c])
    assert (st.kv_verified, st.kv_mismatches) == (1, 0)
    rig.pool.free(c)
    c.kv.kv_allocated_len = 0
    rig.sched.waiting_queue.clear()

    rig.finish_all()
    assert rig.alloc.available_size() == SIZE and rig.pool.available_size() == 8  # no slot, no row left
    assert _host_used(rig) == 0 and not rig.rt.store.has_work()  # no host block left


def test_a_full_host_pool_falls_back_to_sglangs_own_retraction(monkeypatch: pytest.MonkeyPatch,
                                                               sglang_config: None) -> None:
    rig = Rig(monkeypatch, host_blocks=2)  # 8 tokens: no request's KV fits
    rig.lose("c")
    out = rig.update_running_batch()
    assert [r.rid for r in out.reqs] == ["a", "c"]  # SGLang's own victim: b
    assert [(r.rid, retracted) for r, retracted in rig.requeued] == [("b", True)]
    st = rig.rt.stats
    assert st.sglang_retractions == 1 and st.shortages == {"retraction": 1}
    assert not rig.rt.store.entries and _host_used(rig) == 0 and not rig.rt.store.digests
    assert rig.batch.check_decode_mem()


def test_retract_mode_keeps_sglangs_retraction(monkeypatch: pytest.MonkeyPatch, sglang_config: None) -> None:
    rig = Rig(monkeypatch, host_blocks=16, decode_shortage="retract")
    out = rig.update_running_batch()
    assert [r.rid for r in out.reqs] == ["a", "c"] and [r.rid for r, _ in rig.requeued] == ["b"]
    assert rig.rt.stats.sglang_retractions == 1 and not rig.rt.store.entries and _host_used(rig) == 0


def test_sglangs_forced_test_retraction_rotates_one_request(monkeypatch: pytest.MonkeyPatch,
                                                            sglang_config: None) -> None:
    """SGLANG_TEST_RETRACT (what the e2e exactness test drives): memory is not short, SGLang's switch
    still calls retract_decode, which takes one request: rotated, not retracted."""
    import sglang.srt.managers.scheduler as scheduler

    from superinfer_sgl.integration import rotation

    rig = Rig(monkeypatch, host_blocks=16)
    a = rig.req("a")
    rotation.release(rig.sched, a)  # a finished: 23 free slots, the next step fits
    rig.batch.filter_batch(keep_indices=[1, 2])
    assert rig.batch.check_decode_mem()
    monkeypatch.setattr(scheduler, "TEST_RETRACT", True)
    monkeypatch.setattr(scheduler, "TEST_RETRACT_INTERVAL", 1)
    out = rig.update_running_batch()
    assert [r.rid for r in out.reqs] == ["c"] and rig.requeued == []  # SGLang's first victim, b, rotated
    st = rig.rt.stats
    assert st.shortages == {"rotated_requests": 1, "rotation": 1} and st.sglang_retractions == 0
    assert rig.rt.store.entries.keys() == {"b"}


@pytest.mark.parametrize("mode, decoding, rotated", [
    ("MIXED", ("a", "c"), "c"),  # b is a prefill row (a resume's extend, say): c goes, rotated
    ("MIXED", (), None),  # every row a prefill row: nothing rotatable, SGLang retracts b
    ("EXTEND", ("a", "b", "c"), None),  # a prefill batch in flight: its KV is still being written
])
def test_decode_rows_of_an_in_flight_mixed_batch_may_rotate(monkeypatch: pytest.MonkeyPatch, sglang_config: None,
                                                           mode: str, decoding: tuple[str, ...],
                                                           rotated: str | None) -> None:
    """Under the overlap scheduler the batch in flight is SGLang's last_batch: after a mixed step its
    decode rows write only their last output token's KV (never copied) and may be rotated out; its
    prefill rows may not (views.rotatable refuses them all)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    rig = Rig(monkeypatch, host_blocks=16)
    rig.sched.last_batch = SimpleNamespace(forward_mode=getattr(ForwardMode, mode), reqs=list(rig.reqs),
                                           decoding_reqs=[rig.req(r) for r in decoding])
    out = rig.update_running_batch()
    st = rig.rt.stats
    if rotated is None:
        assert [r.rid for r, _ in rig.requeued] == ["b"] and not rig.rt.store.entries
        assert st.shortages == {"retraction": 1}
    else:
        assert rig.requeued == [] and rig.rt.store.entries.keys() == {rotated}
        assert rotated not in [r.rid for r in out.reqs] and st.shortages == {"rotated_requests": 1, "rotation": 1}
    assert rig.sched.last_batch.forward_mode == getattr(ForwardMode, mode)  # set back after the check


def test_what_rotation_cannot_take_goes_to_sglangs_retraction(monkeypatch: pytest.MonkeyPatch,
                                                             sglang_config: None) -> None:
    """The next step needs 30 tokens (as a larger page or speculative decoding would): rotating c
    frees 19, the host pool (5 blocks) then takes nobody else, and SGLang's own retract_decode runs on
    what is left: it retracts its victim, b, and the two answers are returned as one."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    rig = Rig(monkeypatch, host_blocks=5)
    monkeypatch.setattr(ScheduleBatch, "new_tokens_required_next_decode", lambda self, selected_indices=None: 30)
    rig.lose("c")
    out = rig.update_running_batch()
    assert [r.rid for r in out.reqs] == ["a"]
    assert rig.rt.store.entries.keys() == {"c"} and [(r.rid, back) for r, back in rig.requeued] == [("b", True)]
    st = rig.rt.stats
    assert st.shortages == {"rotated_requests": 1, "rotation_and_retraction": 1} and st.sglang_retractions == 1
    assert rig.alloc.available_size() == 19 + 22 and _host_used(rig) == 5


def test_a_split_prompt_s_next_chunk_gets_room_by_rotation(monkeypatch: pytest.MonkeyPatch,
                                                           sglang_config: None) -> None:
    """integration/chunk_room.py on the same real objects: the pool is full and a 30-token prompt is
    mid chunked prefill (SGLang's `chunked_req`, none of it computed yet), so its next chunk would
    fail SGLang's allocation (the scheduler dies). The runtime's own step rotates out running requests
    in the shortage's victim order until 30 + a page fit (b 22 tokens, then c 19), and SGLang's
    prefill then runs with the step's chunk cut to what is free; the victims' KV is parked, not lost."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    rig = Rig(monkeypatch, host_blocks=16)
    chunked = Req("d", "", array("q", range(900, 930)), SamplingParams(max_new_tokens=8, ignore_eos=True))
    rig.sched.chunked_req = chunked
    seen: dict[str, int] = {}

    def prefill(sched: Any, batch: Any) -> None:
        seen.update(chunk=sched.chunked_prefill_size, free=rig.alloc.available_size())

    rig.rt._decide = lambda *a: Decision()  # type: ignore[method-assign]  # LVF: nothing to do
    rig.rt.around_prefill(prefill, rig.sched, rig.batch)
    assert [r.rid for r in rig.batch.reqs] == ["a"] and rig.rt.store.entries.keys() == {"b", "c"}
    assert rig.rt.stats.chunk_room_rotations == 2 and rig.requeued == []
    assert seen == {"chunk": 22 + 19 - 1, "free": 22 + 19}  # cut to what is free, less a page of rounding
    assert rig.sched.chunked_prefill_size == 64  # the configured size back after the step
    # with room for it nobody moves (the step's chunk stays within what is free)
    rig.rt.around_prefill(prefill, rig.sched, rig.batch)
    assert rig.rt.stats.chunk_room_rotations == 2 and [r.rid for r in rig.batch.reqs] == ["a"]
    assert seen == {"chunk": 40, "free": 41}


def test_a_request_sglang_aborts_in_its_retraction_leaves_no_mirror_or_clock(
        monkeypatch: pytest.MonkeyPatch, sglang_config: None) -> None:
    """retract_decode may abort instead of retracting (a beam group; a lone request that cannot
    fit): SGLang reports it through its abort output, never the stream that calls `on_finished`,
    so the shortage hook itself lets go of its host mirror and its clock."""
    from superinfer_sgl.integration import decode_shortage, rotation

    rig = Rig(monkeypatch, host_blocks=16)
    a, b = rig.req("a"), rig.req("b")
    for req in (a, b):
        rotation.eager_sync(rig.sched, req, rig.engine, max_bytes=None)
    assert rig.engine.synced_tokens("a") > 0 and _host_used(rig) > 0
    decode_shortage.sglang_retraction(rig.rt, ([b], 0.5, [a]))
    assert "a" not in rig.engine.mirror and "b" not in rig.engine.mirror and _host_used(rig) == 0
    assert "a" not in rig.rt.clocks.by_rid and "b" in rig.rt.clocks.by_rid  # b is requeued, a is gone
    assert rig.rt.stats.sglang_retractions == 1
