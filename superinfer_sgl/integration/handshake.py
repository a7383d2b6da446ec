"""Startup handshake: prove that our hooks are live inside every scheduler process.

SGLang logs and swallows plugin errors, so a broken plugin would silently serve stock SGLang.
Each scheduler rank adds a `superinfer` entry to the init info it already sends to the launcher;
the launcher process checks every rank's entry before the HTTP server starts and refuses to serve
otherwise. With `--dp-size N` the launcher hears only from SGLang's data-parallel controller, whose
init info keeps none of the ranks' keys: the controller hands on every rank's entry under
`dp_ranks`, and each is checked like a rank of its own.

Each entry also names the rank's KV pool class (`kv_pool`) and its rotation status: "on (<transfer>)"
or why rotation is off, e.g. a pool DuplexKV refuses (duplexkv/pool_layout.py), named by its class;
the launcher logs both per rank.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator

from ..config import SuperInferConfig
from .kv_adapter import kv_pool_name

logger = logging.getLogger(__name__)

INIT_INFO_KEY = "superinfer"
SCHEDULER_INFO = "sglang.srt.managers.scheduler.Scheduler.get_init_info"
LAUNCH = "sglang.srt.entrypoints.engine.Engine._launch_subprocesses"
DP_CONTROLLER_INFO = "sglang.srt.managers.data_parallel_controller.DataParallelController.get_init_info"
DP_RANKS = "dp_ranks"


class HooksNotLiveError(RuntimeError):
    """A scheduler process started without our hooks."""


def hooks(cfg: SuperInferConfig, installed: list[str]) -> Iterator[tuple[str, Callable[..., Any], Any]]:
    from sglang.srt.plugins.hook_registry import HookType

    def report(result: dict[str, Any], scheduler: Any) -> dict[str, Any]:
        result[INIT_INFO_KEY] = {
            "pid": os.getpid(),
            "scheduler": cfg.scheduler,
            "hooks": list(installed),
            "tp_rank": getattr(scheduler, "tp_rank", None),
            "dp_rank": _dp_rank(),
            "kv_pool": _kv_pool(scheduler),
            "rotation": _rotation_status(scheduler),
        }
        return result

    def verify(result: tuple, *args: Any, **kwargs: Any) -> None:
        init_result = result[3]
        verify_scheduler_infos(init_result.scheduler_infos, cfg)

    def collect_dp_ranks(result: dict[str, Any], controller: Any) -> dict[str, Any]:
        infos = getattr(controller, "_scheduler_init_infos", None) or []
        result[INIT_INFO_KEY] = {DP_RANKS: [info.get(INIT_INFO_KEY) for info in infos]}
        return result

    yield SCHEDULER_INFO, report, HookType.AFTER
    yield LAUNCH, verify, HookType.AFTER
    yield DP_CONTROLLER_INFO, collect_dp_ranks, HookType.AFTER


def _dp_rank() -> str:
    from .metrics import _dp_rank as rank  # the one place that asks SGLang for it

    return rank()


def _rotation_status(scheduler: Any) -> str:
    rt = getattr(scheduler, "_superinfer", None)
    if rt is None:
        return "missing runtime"
    if rt.engine is not None:
        return f"on ({rt.engine.transfer})"
    return rt.disabled_reason or "off"


def _kv_pool(scheduler: Any) -> str:
    try:
        return kv_pool_name(scheduler.token_to_kv_pool_allocator.get_kvcache())
    except AttributeError:  # a scheduler without a token pool (e.g. a test double)
        return "unknown"


def verify_scheduler_infos(infos: list[dict[str, Any]], cfg: SuperInferConfig) -> None:
    if not infos:
        raise HooksNotLiveError("no scheduler reported in; cannot verify superinfer hooks")
    for i, ours in enumerate(_rank_entries(infos)):
        if not ours:
            raise HooksNotLiveError(
                f"scheduler {i} runs without superinfer_sgl hooks (is the plugin installed in this "
                "venv and allowed by SGLANG_PLUGINS?)"
            )
        if ours.get("rotation") == "missing runtime":
            raise HooksNotLiveError(f"scheduler {i} has our plugin but no RotaSched runtime attached")
        if ours.get("scheduler") != cfg.scheduler:
            raise HooksNotLiveError(f"scheduler {i} runs {ours.get('scheduler')!r}, expected {cfg.scheduler!r}")
        logger.info("superinfer: scheduler %d: KV pool %s, rotation %s", i, ours.get("kv_pool", "unknown"),
                    ours.get("rotation"))


def _rank_entries(infos: list[dict[str, Any]]) -> Iterator[Any]:
    """Our entry of every scheduler rank, the DP controller's list unpacked (an empty list: one
    missing entry, so a controller whose ranks never reported in fails too)."""
    for info in infos:
        ours = info.get(INIT_INFO_KEY)
        if isinstance(ours, dict) and DP_RANKS in ours:
            yield from ours[DP_RANKS] or [None]
        else:
            yield ours
