"""A contended scheduler state at a chosen request count, on SGLang's real objects on a CPU: `Req`s,
its token allocator, radix tree and request pool, a `Scheduler` whose `get_new_batch_prefill` is
stock SGLang's, and a `RotaSchedRuntime` attached to it (`sched_overhead.py` times them).

The mix (`build`): a quarter of the requests running (at most `max_running`), a tenth rotary
(KV on host), the rest waiting; arrivals spread over the last 30 s; the three default SLO classes;
requests may stop at EOS (SGLang's new-token ratio sizes every reserve, ours and stock's alike).
The device pool holds the running requests' KV and a little more, so their decode reserves leave
no free memory: nobody fits, every step is contended, and the state stays the same step after
step but for what `decode` moves (one output token per running request, and the clock).
"""

from __future__ import annotations

import random
import time
from array import array
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch

from ..config import SuperInferConfig
from ..duplexkv.host_pool import HostKV
from ..integration import rotation
from ..integration.runtime import RotaSchedRuntime
from ..rotasched import ReqState, resolve_slo
from ..rotasched.clock import ReqClock

CLASSES = ("interactive", "standard", "batch")
BLOCK_TOKENS = 16
SLACK_TOKENS = 64  # free device slots beyond the running requests' KV: far below their reserves
RATIO = 0.7  # SGLang's new-token ratio (its tracker's estimate) for every reserve


@dataclass
class Rig:
    sched: Any  # an SGLang Scheduler, built without __init__ (see `_scheduler`)
    batch: Any  # its running ScheduleBatch
    rt: RotaSchedRuntime
    counts: dict[str, int]
    context: ExitStack  # SGLang's published config, active while the rig is used
    arrived: int = 0

    def decode(self) -> None:
        """What one decode iteration changes: one output token per running request. The batch may
        admit again (SGLang clears `batch_is_full` when a request leaves; here every step)."""
        for req in self.batch.reqs:
            req.output_ids.append(7)
        self.batch.batch_is_full = False

    def arrive(self, k: int) -> None:
        """`k` new requests appended to the waiting queue (a server's arrivals between two steps;
        their clocks start when the hook first sees them)."""
        from sglang.srt.managers.schedule_batch import Req

        for _ in range(k):
            self.arrived += 1
            rid, cls = f"new-{self.arrived}", CLASSES[self.arrived % 3]
            self.sched.waiting_queue.append(Req(rid, "", array("q", range(256)), _sampling(512, cls)))

    def stock(self) -> Any:
        from sglang.srt.managers.scheduler import Scheduler

        return Scheduler.get_new_batch_prefill(self.sched, self.batch)

    def ours(self) -> Any:
        from sglang.srt.managers.scheduler import Scheduler

        return self.rt.around_prefill(Scheduler.get_new_batch_prefill, self.sched, self.batch)


def sglang_context(model_path: str) -> ExitStack:
    """SGLang's process-wide config (schedule, disagg and parallel bags) as a scheduler process has
    it, from a ServerArgs of the embedded model, without touching the GPU or the network."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs

    stack = ExitStack()
    ctx = rc.create_context(ServerArgs(model_path=model_path, device="cpu"), role="scheduler")
    stack.enter_context(rc.use_context(ctx))
    stack.enter_context(rc.get_parallel().override(pp_max_micro_batch_size=1 << 30))
    return stack


def build(n: int, policy: str, max_running: int, model_path: str, seed: int = 0, ttft_shedding: bool = True,
          metrics: bool = False) -> Rig:
    """`metrics`: the runtime updates its Prometheus series every step, as a server with
    --enable-metrics does (in a registry of its own, not multiprocess)."""
    from sglang.srt.managers.schedule_batch import Req

    rng = random.Random(seed)
    n_run = min(n // 4, max_running)
    n_rot = n // 10
    n_wait = n - n_run - n_rot
    reqs = []
    for i in range(n):
        prompt, base = rng.randint(64, 1024), 1000 * i
        sp = _sampling(max_new=rng.randint(256, 2048), cls=CLASSES[i % 3])
        reqs.append(Req(f"req-{i}", "", array("q", range(base, base + prompt)), sp))
    running, rotary, waiting = reqs[:n_run], reqs[n_run:n_run + n_rot], reqs[n_run + n_rot:]
    for req in running + rotary:
        req.output_ids.extend([7] * rng.randint(1, 200))
    sched, batch, stack = _scheduler(running, waiting, model_path)
    cfg = SuperInferConfig(policy=policy, rotary_block_tokens=BLOCK_TOKENS, eager_sync=False,
                           min_stint_ms=1e9, ttft_shedding=ttft_shedding)  # no running request may be rotated out: a steady state
    series = None
    if metrics:
        from prometheus_client import CollectorRegistry

        from ..integration.metrics import RotaSchedMetrics

        series = RotaSchedMetrics(registry=CollectorRegistry())
    rt = RotaSchedRuntime(sched, cfg, engine=_idle_engine(), metrics=series)  # type: ignore[arg-type]
    now = time.monotonic()
    for req in reqs:
        cls = req.sampling_params.custom_params["slo_class"]
        clk = ReqClock(req.rid, now - rng.uniform(0.0, 30.0), resolve_slo({"slo_class": cls}, rt.clocks.default_slo,
                                                                             rt.clocks.classes), cls)
        if req.output_ids:
            clk.observe_outputs(len(req.output_ids), rng.uniform(clk.arrival, now))
        rt.clocks.by_rid[req.rid] = clk
    for req in running:
        rt.clocks.by_rid[req.rid].set_state(ReqState.RUNNING, now - 1.0)
    for req in rotary:
        rt.clocks.by_rid[req.rid].set_state(ReqState.ROTARY, now)
        tokens = rotation.restorable_tokens(req)
        host = HostKV(tuple(range(-(-tokens // BLOCK_TOKENS))), tokens, BLOCK_TOKENS)
        rt.store.entries[req.rid] = rotation.RotaryEntry(req, host, now)
    return Rig(sched, batch, rt, {"running": n_run, "rotary": n_rot, "waiting": n_wait}, stack)


def _sampling(max_new: int, cls: str) -> Any:
    from sglang.srt.sampling.sampling_params import SamplingParams

    return SamplingParams(max_new_tokens=max_new, ignore_eos=False, custom_params={"slo_class": cls})


def _scheduler(running: list[Any], waiting: list[Any], model_path: str) -> tuple[Any, Any, ExitStack]:
    """Stock SGLang's scheduler over the allocator, radix tree and request pool, its running batch
    holding `running`' KV (the pool a little larger than that)."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import SchedulePolicy
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache

    stack = sglang_context(model_path)
    held = sum(r.seqlen for r in running)
    alloc = TokenToKVPoolAllocator(held + SLACK_TOKENS, torch.float32, "cpu", None, False)
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                      page_size=1))
    pool = ReqToTokenPool(size=len(running) + len(waiting) + 8, max_context_len=4096, device="cpu",
                          enable_memory_saver=False)
    for req in running:
        slots = alloc.alloc(req.seqlen)
        row = pool.alloc([req])[0]  # sets req.kv.req_pool_idx
        pool.req_to_token[row, : req.seqlen] = slots.to(torch.int32)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = req.seqlen
    batch = object.__new__(ScheduleBatch)
    batch.reqs, batch.batch_is_full = list(running), False
    s = object.__new__(Scheduler)
    fields = dict(
        prefill_delayer=None, grammar_manager=SimpleNamespace(has_waiting_grammars=lambda: False),
        enable_priority_preemption=False, is_hybrid_swa=False, waiting_queue=list(waiting), chunked_req=None,
        min_free_slots_delayer=None, req_to_token_pool=pool, running_batch=batch,
        beam_coordinator=SimpleNamespace(pending_member_rows=lambda b: 0),
        policy=SchedulePolicy("fcfs", tree, False, False, False), processed_tokens_counter=None,
        dynamic_chunk_sizer=None, tp_worker=SimpleNamespace(model_runner=SimpleNamespace(attn_backend=None)),
        page_size=1, tree_cache=tree, token_to_kv_pool_allocator=alloc,
        new_token_ratio_tracker=SimpleNamespace(current=RATIO), max_prefill_tokens=16384,
        # mixed chunk on, as our launcher starts RotaSched: the goodput policy's TBT cap is planned
        chunked_prefill_size=8192, is_mixed_chunk=True, priority_scheduling_preemption_threshold=10,
        max_prefill_bs=1 << 30, max_running_requests=1 << 20, dllm_config=None, enable_lora=False,
        enable_hicache_storage=False, enable_lmcache=False, truncation_align_size=None,
        max_total_num_tokens=held + SLACK_TOKENS, last_batch=None, tp_rank=0, tp_size=1, enable_overlap=False,
    )
    for k, v in fields.items():
        setattr(s, k, v)
    return s, batch, stack


def _idle_engine() -> Any:
    """The runtime's engine where no rotation happens (the steady state moves nobody): what the
    step reads of it, and an error if anything tries to move KV."""
    from types import SimpleNamespace

    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("the overhead rig's steady state moved KV")

    host = SimpleNamespace(bytes_per_block=1 << 20, num_blocks=1 << 20, allocator=SimpleNamespace(num_used=0),
                           kv_format="auto")
    return SimpleNamespace(host_pool=host, rotate=refuse, free=refuse, track=refuse, untrack=lambda rid: None,
                           bytes_out=0, bytes_eager_out=0, bytes_in=0, bytes_prefetched=0,
                           room_blocks=lambda enough: host.num_blocks)
