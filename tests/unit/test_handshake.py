"""Startup handshake: the launcher refuses to serve unless every scheduler rank reports our hooks."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.integration.handshake import (
    INIT_INFO_KEY,
    HooksNotLiveError,
    _rotation_status,
    verify_scheduler_infos,
)

CFG = SuperInferConfig()


def _info(**ours: Any) -> dict[str, Any]:
    entry = {"pid": 1, "scheduler": CFG.scheduler, "hooks": ["x"], "tp_rank": 0, "rotation": "off"}
    entry.update(ours)
    return {"max_total_num_tokens": 1024, INIT_INFO_KEY: entry}


def test_well_formed_infos_pass() -> None:
    verify_scheduler_infos([_info()], CFG)
    verify_scheduler_infos([_info(tp_rank=0), _info(tp_rank=1, rotation="on (triton-dma)")], CFG)
    sglang_cfg = SuperInferConfig(scheduler="sglang")
    verify_scheduler_infos([_info(scheduler="sglang", rotation="rotation disabled: tp>1")], sglang_cfg)


def test_empty_list_fails() -> None:
    with pytest.raises(HooksNotLiveError, match="no scheduler reported"):
        verify_scheduler_infos([], CFG)


@pytest.mark.parametrize("bad", [{"max_total_num_tokens": 1024}, {INIT_INFO_KEY: {}}, {INIT_INFO_KEY: None}])
def test_info_without_our_entry_fails(bad: dict[str, Any]) -> None:
    with pytest.raises(HooksNotLiveError, match="scheduler 1 runs without superinfer_sgl hooks"):
        verify_scheduler_infos([_info(), bad], CFG)


def test_mismatched_scheduler_fails() -> None:
    with pytest.raises(HooksNotLiveError, match="scheduler 0 runs 'sglang', expected 'rotasched'"):
        verify_scheduler_infos([_info(scheduler="sglang")], CFG)


def test_missing_runtime_fails() -> None:
    with pytest.raises(HooksNotLiveError, match="scheduler 1 has our plugin but no RotaSched runtime"):
        verify_scheduler_infos([_info(), _info(rotation="missing runtime")], CFG)


def test_rotation_status() -> None:
    assert _rotation_status(SimpleNamespace()) == "missing runtime"
    on = SimpleNamespace(_superinfer=SimpleNamespace(engine=SimpleNamespace(transfer="torch"), disabled_reason=None))
    assert _rotation_status(on) == "on (torch)"
    off = SimpleNamespace(_superinfer=SimpleNamespace(engine=None, disabled_reason="rotation off: tp>1"))
    assert _rotation_status(off) == "rotation off: tp>1"
    plain_off = SimpleNamespace(_superinfer=SimpleNamespace(engine=None, disabled_reason=None))
    assert _rotation_status(plain_off) == "off"


def test_report_and_verify_hooks_round_trip() -> None:
    """What `report` adds to a rank's init info is exactly what `verify` accepts."""
    from superinfer_sgl.integration import handshake

    installed = ["a.b.C.d"]
    (_, report, _), (_, verify, _), *_ = handshake.hooks(CFG, installed)
    runtime = SimpleNamespace(engine=None, disabled_reason=None)
    info = report({"max_total_num_tokens": 1}, SimpleNamespace(tp_rank=0, _superinfer=runtime))
    assert info[INIT_INFO_KEY]["hooks"] == installed and info[INIT_INFO_KEY]["tp_rank"] == 0
    assert info[INIT_INFO_KEY]["scheduler"] == "rotasched" and info[INIT_INFO_KEY]["rotation"] == "off"
    assert info[INIT_INFO_KEY]["kv_pool"] == "unknown"  # this scheduler double has no token pool
    init_result = SimpleNamespace(scheduler_infos=[info])
    verify((None, None, None, init_result, None, None), object())
    stock = SimpleNamespace(scheduler_infos=[{"max_total_num_tokens": 1}])
    with pytest.raises(HooksNotLiveError):
        verify((None, None, None, stock, None), object())
    no_runtime = report({}, SimpleNamespace(tp_rank=0))
    with pytest.raises(HooksNotLiveError, match="no RotaSched runtime"):
        verify((None, None, None, SimpleNamespace(scheduler_infos=[no_runtime]), None), object())


def test_each_rank_is_logged_with_its_kv_pool_and_rotation(caplog: pytest.LogCaptureFixture) -> None:
    """The launcher names every rank's KV pool and whether it rotates (refused pools: docs/duplexkv.md)."""
    why = "SWAKVPool: a sliding-window pool ...; rotation is off (...)"
    with caplog.at_level("INFO"):
        verify_scheduler_infos([_info(kv_pool="MLATokenToKVPool", rotation="on (torch)"),
                                _info(kv_pool="SWAKVPool", rotation=why)], CFG)
    assert "scheduler 0: KV pool MLATokenToKVPool, rotation on (torch)" in caplog.text
    assert f"scheduler 1: KV pool SWAKVPool, rotation {why}" in caplog.text
