"""The runtime's I/O, done once when a scheduler starts: `create_runtime` opens the rotation engine
(host pool, KV link probe), the metrics and the TP broadcast, and hands them to `RotaSchedRuntime`,
whose constructor does none of it (tests build it with fakes directly, as vLLM's create_scheduler).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..config import SuperInferConfig
from ..duplexkv.engine import RotationEngine
from ..duplexkv.by_format import EnginesByFormat
from ..duplexkv.host_pool import HostKVPool
from ..host_memory import available_ram_bytes
from ..duplexkv.link_probe import measure_link
from .kv_adapter import UnsupportedKVPool, scheduler_pool_view
from .runtime import RotaSchedRuntime
from .views import clip_max_new_tokens

logger = logging.getLogger(__name__)

DEFAULT_HOST_RAM_FRACTION = 0.25


@dataclass(frozen=True)
class EngineSetup:
    engine: RotationEngine | None
    disabled_reason: str | None = None  # why rotation is off (engine None), for the handshake
    link_bytes_per_s: float | None = None  # measured at startup when the budget is auto


def create_runtime(sched: Any, cfg: SuperInferConfig) -> RotaSchedRuntime:
    """The runtime of one scheduler (rank), with everything it needs from outside opened."""
    broadcast = broadcaster(sched)
    setup = open_engine(sched, cfg, broadcast) if cfg.scheduler == "rotasched" else EngineSetup(None)
    rt = RotaSchedRuntime(sched, cfg, engine=setup.engine, metrics=open_metrics(),
                          broadcast=broadcast, link_bytes_per_s=setup.link_bytes_per_s,
                          disabled_reason=setup.disabled_reason, clip=clip_max_new_tokens())
    if rt.engine is not None:
        host = rt.engine.host_pool
        logger.info("superinfer: host rotary pool %d blocks x %d tokens of %s (%.2f GiB), transfer=%s, "
                    "rotation budget %d blocks/iteration%s", host.num_blocks, cfg.rotary_block_tokens,
                    host.store_dtype, host.num_blocks * host.bytes_per_block / 2**30, rt.engine.transfer,
                    rt.budget, "" if rt.clocks.link_bytes_per_s is None else " until a decode step is measured (auto)")
    return rt


def open_engine(sched: Any, cfg: SuperInferConfig,
                broadcast: Callable[[object], object] = lambda obj: obj) -> EngineSetup:
    """The rotation engine over SGLang's device KV pool and a new host pool, or why there is none
    (`broadcast`: rank 0's object to every TP rank, for the host pool's size)."""
    tree = sched.tree_cache
    if getattr(tree, "disable", False) or not tree.supports_prefix_sharing():
        reason = "radix cache disabled: rotation needs it; using recompute only"
        logger.warning("superinfer: %s", reason)
        return EngineSetup(None, reason)
    try:  # an SWAKVPool: its full-attention sub-pool (the window side: kv_adapter.window_rotation)
        dev = scheduler_pool_view(sched)
    except UnsupportedKVPool as exc:
        logger.warning("superinfer: rotation disabled: %s", exc)
        return EngineSetup(None, str(exc))
    formats = cfg.rotary_kv_formats()  # --rotary-kv-dtype first, then the classes' own precisions
    if formats != ("auto",) and dev.dtype.itemsize < 2:
        # SGLang chose a 1-byte KV cache itself (the checkpoint's kv_cache_quant_algo under
        # --kv-cache-dtype auto, which the launch check passed): it cannot be quantized further
        logger.warning("superinfer: the device KV cache is %s already (SGLang's choice for this checkpoint); "
                       "rotating it exactly, not as %s", dev.dtype, ", ".join(f for f in formats if f != "auto"))
        formats = ("auto",)
    gb = host_pool_gib(sched, cfg, broadcast)
    if len(formats) == 1:
        host = HostKVPool.for_device(dev, cfg.rotary_block_tokens, formats[0],
                                     free_ram_fraction=DEFAULT_HOST_RAM_FRACTION, gb=gb)
        engine = RotationEngine(dev, host, cfg.kv_transfer)
    else:  # a host pool and an engine per precision; requests routed by class (duplexkv/by_format.py)
        pools = HostKVPool.for_formats(dev, cfg.rotary_block_tokens, formats,
                                       free_ram_fraction=DEFAULT_HOST_RAM_FRACTION, gb=gb)
        engine = EnginesByFormat(dev, pools, cfg.rotary_kv_dtype, cfg.kv_transfer,
                                 class_formats=cfg.class_rotary_kv_dtypes())
    link = None
    if cfg.rotation_budget_blocks is None:  # auto: from the link's measured speed
        link = measure_link(engine.primary if isinstance(engine, EnginesByFormat) else engine)  # it resets counters
        logger.info("superinfer: KV link %.2f GB/s (one direction, measured)", link / 1e9)
    return EngineSetup(engine, None, link)


def host_pool_gib(sched: Any, cfg: SuperInferConfig, broadcast: Callable[[object], object]) -> float | None:
    """The host pool's GiB on this rank: `--rotary-pool-gb`; else None (DEFAULT_HOST_RAM_FRACTION
    of the RAM free now) for a lone scheduler; else that share split among this server's scheduler
    processes on the node (each holds its own pool), rank 0's figure for every TP rank: measured
    apart, their pools would differ, and a rank with fewer blocks would refuse a rotation that
    the others take (TP ranks must act alike)."""
    if cfg.rotary_pool_gb is not None:
        return cfg.rotary_pool_gb
    procs, tp = local_schedulers(sched)
    if procs <= 1 and tp <= 1:
        return None
    own = DEFAULT_HOST_RAM_FRACTION * available_ram_bytes() / procs / 2**30
    return float(broadcast(own)) if tp > 1 else own  # type: ignore[arg-type]


def local_schedulers(sched: Any) -> tuple[int, int]:
    """(this server's scheduler processes on this node, TP ranks of this scheduler's group), from
    SGLang's parallel configuration (the scheduler's own `tp_size` where none is published)."""
    tp = int(getattr(sched, "tp_size", 1) or 1)
    try:
        from sglang.srt.runtime_context import get_parallel

        par = get_parallel()
        tp = int(par.tp_size)
        dp = 1 if par.enable_dp_attention else int(par.dp_size)  # DP attention runs inside the TP ranks
        total = tp * int(par.pp_size) * dp
        return max(1, total // max(1, int(par.nnodes))), tp
    except (ImportError, AttributeError, RuntimeError, ValueError, TypeError):
        return tp, tp


def open_metrics() -> Any:
    """The Prometheus series, when SGLang runs with --enable-metrics and this rank exports; else None."""
    from sglang.srt.runtime_context import get_observability

    from .metrics import RotaSchedMetrics
    from .metrics_rank import is_metrics_rank

    if not get_observability().enable_metrics or not is_metrics_rank():
        return None

    return RotaSchedMetrics()


def broadcaster(sched: Any) -> Callable[[object], object]:
    """Rank 0's object to every TP rank (`rotasched.DecisionSync`); the identity without TP."""
    tp_size = getattr(sched, "tp_size", 1)
    if tp_size <= 1:
        return lambda obj: obj
    from sglang.srt.utils import broadcast_pyobj

    def broadcast(obj: object) -> object:
        data = broadcast_pyobj([obj], sched.tp_rank, sched.tp_cpu_group, src=0)
        return data[0]

    return broadcast
