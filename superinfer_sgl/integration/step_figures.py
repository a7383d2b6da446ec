"""What the metrics are handed after each scheduler step (`StepFigures`), read off the runtime's
collaborators so that `metrics.py` reads nothing of the runtime: the counters, the rotation budget,
the host pool's use, the engine's bytes moved, and for the headroom gauges (`rotasched/headroom.py`)
the queue's views, built only when the gauges refresh.

Those views are of the queue as the step left it (admitted requests gone, rotated-out ones rotary,
the running batch's views current), not the step's own views, which are taken before its decision
and keep older gap counts for running requests a policy does not read them of.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..duplexkv.engine import RotationEngine
from ..rotasched import ReqState, ReqView, VltParams
from ..rotasched.goodput import GoodputParams
from . import views as req_views
from .clocks import Clocks
from .rotary_store import RotaryStore
from .rotation import RotationStats


@dataclass(frozen=True, slots=True)
class KvBytes:
    """The rotation engine's byte counters (`RotationEngine.bytes_*`)."""

    out: int
    eager_out: int
    into: int
    prefetched: int


@dataclass(frozen=True, slots=True)
class StepFigures:
    stats: RotationStats
    budget: int
    link_bytes_per_s: float | None
    rotary: int
    host_blocks_used: int
    host_blocks_total: int
    kv_bytes: KvBytes | None  # None: rotation off
    # Host bytes rotary KV holds now, by (SLO class, host format): per class with a precision per
    # class (EnginesByFormat), else one row ("all", the pool's format)
    host_bytes: tuple[tuple[str, str, int], ...]
    queued: int  # waiting and rotary requests: under a backlog the headroom gauges refresh less often
    running: int  # the running batch's requests (the headroom gauges refresh when a count moves)
    queue_views: Callable[[], list[ReqView]]
    vlt: VltParams
    goodput: GoodputParams


def step_figures(sched: Any, engine: RotationEngine | None, clocks: Clocks, store: RotaryStore,
                 stats: RotationStats, budget: int, vlt: VltParams, best_effort_wait_s: float,
                 clip: int) -> StepFigures:
    used, total = store.pool_usage()
    kv = None if engine is None else KvBytes(engine.bytes_out, engine.bytes_eager_out, engine.bytes_in,
                                             engine.bytes_prefetched)
    queued = len(sched.waiting_queue) + len(store.entries)
    running = getattr(getattr(sched, "running_batch", None), "reqs", None) or ()
    return StepFigures(stats, budget, clocks.link_bytes_per_s, len(store.entries), used, total, kv,
                       host_bytes(engine, store), queued, len(running),
                       lambda: queue_views(sched, clocks, store, clip), vlt,
                       GoodputParams(clocks.meter.costs, best_effort_wait_s, eos_output_share=clocks.outputs.share))


def host_bytes(engine: Any, store: RotaryStore) -> tuple[tuple[str, str, int], ...]:
    """(SLO class, host format, bytes held) rows for the host-bytes gauge: what paused requests'
    KV holds (not eager mirrors nor copies in flight: the pool's used blocks count those), with one
    format or a pool per format alike."""
    if engine is None:
        return ()
    by_class = getattr(engine, "host_bytes_held", None)  # EnginesByFormat: a pool per format
    if by_class is not None:
        return tuple((cls, fmt, int(n)) for (cls, fmt), n in sorted(by_class.items()))
    pool = engine.host_pool
    return (("all", pool.kv_format, store.host_blocks * pool.bytes_per_block),)


def queue_views(sched: Any, clocks: Clocks, store: RotaryStore, clip: int) -> list[ReqView]:
    """Views of the running, waiting and rotary requests (block counts left at 0: headroom does not
    read them). Requests without a clock yet (arrived after the step's observation) are skipped."""
    by_rid = clocks.by_rid
    out = []
    for req in getattr(getattr(sched, "running_batch", None), "reqs", None) or []:
        clk = by_rid.get(req.rid)
        if clk is not None and clk.run_start is not None and not req.finished():
            out.append(req_views.view(clk, req, ReqState.RUNNING, 0, 0, False, clip=clip))
    for req in sched.waiting_queue:
        clk = by_rid.get(req.rid)
        if clk is not None:
            compute = req_views.extend_tokens(req, req.rid in store.resume_locks)  # the one rule (views.py)
            out.append(req_views.view(clk, req, ReqState.WAITING, 0, 0, True, compute, clip))
    for rid, entry in store.entries.items():
        clk = by_rid.get(rid)
        if clk is not None and clk.last_token is not None:
            out.append(req_views.view(clk, entry.req, ReqState.ROTARY, 0, 0, True, clip=clip))
    return out
