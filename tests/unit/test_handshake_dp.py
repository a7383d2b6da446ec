"""Startup handshake with --dp-size N: the DP controller hands on every rank's entry, each checked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.integration import handshake
from superinfer_sgl.integration.handshake import INIT_INFO_KEY, HooksNotLiveError, verify_scheduler_infos

CFG = SuperInferConfig()


def _rank(dp_rank: int, **over: object) -> dict:
    entry = {"pid": 1, "scheduler": CFG.scheduler, "hooks": ["x"], "tp_rank": 0, "dp_rank": dp_rank,
             "rotation": "on (torch)", **over}
    return {"max_total_num_tokens": 4096, INIT_INFO_KEY: entry}


def _controller_info(ranks: list[dict]) -> dict:
    hooks = {target: hook for target, hook, _ in handshake.hooks(CFG, ["x"])}
    controller = SimpleNamespace(_scheduler_init_infos=ranks)
    return hooks[handshake.DP_CONTROLLER_INFO]({"max_total_num_tokens": 4096}, controller)


def test_every_dp_rank_is_checked() -> None:
    verify_scheduler_infos([_controller_info([_rank(0), _rank(1)])], CFG)
    with pytest.raises(HooksNotLiveError, match="scheduler 1 runs without superinfer_sgl hooks"):
        verify_scheduler_infos([_controller_info([_rank(0), {"max_total_num_tokens": 4096}])], CFG)
    with pytest.raises(HooksNotLiveError, match="scheduler 1 has our plugin but no RotaSched runtime"):
        verify_scheduler_infos([_controller_info([_rank(0), _rank(1, rotation="missing runtime")])], CFG)


def test_a_controller_with_no_ranks_fails() -> None:
    with pytest.raises(HooksNotLiveError, match="scheduler 0 runs without"):
        verify_scheduler_infos([_controller_info([])], CFG)


def test_report_carries_the_dp_rank() -> None:
    hooks = {target: hook for target, hook, _ in handshake.hooks(CFG, ["x"])}
    rt = SimpleNamespace(engine=None, disabled_reason=None)
    info = hooks[handshake.SCHEDULER_INFO]({}, SimpleNamespace(tp_rank=0, _superinfer=rt))
    assert info[INIT_INFO_KEY]["dp_rank"] == "0"  # outside a DP server: rank 0
