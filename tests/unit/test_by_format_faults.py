"""A pool per KV precision (EnginesByFormat) under faults: a full pool of one format, a bad resume,
the eager-sync budget, copy-time metrics and the host-bytes gauge (a review of 2026-12-03 found
each of these wrong; each test fails on the code before its fix)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fakes import FakeReq, sampling
from superinfer_sgl.config import ConfigError, SuperInferConfig
from superinfer_sgl.duplexkv import DevicePoolView, HostKVPool, RotationEngine
from superinfer_sgl.duplexkv.by_format import EnginesByFormat
from superinfer_sgl.duplexkv.engine import RotateIn, RotateOut
from superinfer_sgl.duplexkv.host_pool import HostKV, HostPoolFull
from superinfer_sgl.integration import rotation
from superinfer_sgl.integration import runtime as rtmod
from superinfer_sgl.integration.rotary_store import RotaryStore
from superinfer_sgl.integration.rotation import RotaryEntry, RotationStats
from superinfer_sgl.integration.step_figures import host_bytes

L, H, D, BT = 2, 2, 64, 4


def _device(dtype: torch.dtype = torch.bfloat16) -> DevicePoolView:
    gen = torch.Generator().manual_seed(1)
    dev = DevicePoolView.synthetic(128, L, H, D, dtype, "cpu")
    for b in dev.k_buffers + dev.v_buffers:
        b.copy_((torch.randn(b.shape, generator=gen) * 2).to(dtype))
    return dev


def _engines(auto_blocks: int = 32, int4_blocks: int = 32) -> EnginesByFormat:
    pools = {fmt: HostKVPool(n, L, H, D, BT, torch.bfloat16, pin=False, kv_format=fmt)
             for fmt, n in (("auto", auto_blocks), ("int4", int4_blocks))}
    return EnginesByFormat(_device(), pools, "auto", "torch", class_formats={"gold": "auto", "batch": "int4"})


def test_a_full_pool_of_one_format_drops_only_that_formats_outs() -> None:
    eng = _engines(int4_blocks=2)
    eng.track_class("b", "batch")  # int4: 3 blocks, its pool has 2
    eng.track_class("g", "gold")  # auto: 2 blocks, its pool has 32
    outs = [RotateOut("b", torch.arange(0, 12), 12), RotateOut("g", torch.arange(20, 28), 8)]
    with pytest.raises(HostPoolFull) as full:
        eng.rotate(out=outs)
    assert full.value.kv_format == "int4"
    handle, went = rotation._rotate(eng, outs, [], [], False)
    assert [o.rid for o in went] == ["g"] and [hk.kv_format for hk in handle.saved] == ["auto"]
    eng.quiesce()
    assert eng.rotations_out == 1 and eng.bytes_out == 8 * eng.engines["auto"].host_pool.bytes_per_token
    eng.free(handle.saved[0])
    eng.check_invariants()


def test_a_refused_call_across_formats_changes_nothing() -> None:
    eng = _engines(int4_blocks=2)
    eng.track_class("g", "gold")
    eng.track_class("b", "batch")
    g_slots = torch.arange(20, 36)
    assert eng.sync_full_blocks("g", g_slots, 16) == 4
    eng.quiesce()
    before = (eng.counters(), eng.engines["auto"].host_pool.allocator.num_used)
    with pytest.raises(HostPoolFull):
        eng.rotate(out=[RotateOut("g", g_slots, 16), RotateOut("b", torch.arange(0, 12), 12)])
    assert (eng.counters(), eng.engines["auto"].host_pool.allocator.num_used) == before
    assert eng.synced_tokens("g") == 16  # the mirror survives: nothing is copied twice


def test_a_bad_resume_across_formats_leaks_no_host_block() -> None:
    eng = _engines()
    eng.track_class("g", "gold")
    never_allocated = RotateIn(HostKV((0,), 4, BT, "int4"), torch.arange(60, 64))
    with pytest.raises(ValueError):
        eng.rotate(out=[RotateOut("g", torch.arange(20, 28), 8)], inn=[never_allocated])
    eng.quiesce()
    assert eng.engines["auto"].host_pool.allocator.num_used == 0 and eng.rotations_out == 0


def test_eager_sync_spends_the_budget_in_link_bytes_across_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget is in the default format's blocks (int4 here); an exact class's blocks are ~3.8x
    their bytes, so counting them as blocks of their own pool overspent the link."""
    pools = {fmt: HostKVPool(64, L, H, D, BT, torch.bfloat16, pin=False, kv_format=fmt) for fmt in ("int4", "auto")}
    eng = EnginesByFormat(_device(), pools, "int4", "torch", class_formats={"gold": "auto"})
    rows = torch.zeros((8, 64), dtype=torch.int32)
    reqs = []
    for i in range(4):
        rows[i, :17] = torch.arange(i * 20, i * 20 + 17)
        req = FakeReq(f"g{i}", list(range(10)), list(range(7)),
                      sampling_params=sampling(custom_params={"slo_class": "gold"}))
        req.kv = SimpleNamespace(req_pool_idx=i, holds_kv=True, kv_allocated_len=17)
        reqs.append(req)
    sched = SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=rows))
    monkeypatch.setattr(rtmod.req_views, "rotatable", lambda s, r: True)
    budget = 4  # int4 blocks per step
    rtmod.RotaSchedRuntime._eager_sync(SimpleNamespace(budget=budget, engine=eng, sched=sched), reqs)  # type: ignore[arg-type]
    eng.quiesce()
    copied = eng.engines["auto"].host_pool.allocator.num_used * pools["auto"].bytes_per_block
    assert copied == eng.bytes_eager_out and 0 < copied <= budget * pools["int4"].bytes_per_block


def test_copy_time_covers_every_formats_engine() -> None:
    eng = _engines()
    eng.track_class("b", "batch")
    eng.rotate(out=[RotateOut("b", torch.arange(0, 12), 12)]).synchronize()
    eng.quiesce()
    assert eng.engines["int4"].copy_timer.totals()["out_calls"] == 1
    assert eng.copy_timer.totals()["out_calls"] == 1


def test_host_bytes_gauge_counts_paused_kv_alike_with_one_format_or_several() -> None:
    """Eager mirrors of running requests are not "host bytes rotary KV holds" either way."""
    single = RotationEngine(_device(), HostKVPool(32, L, H, D, BT, torch.bfloat16, pin=False), "torch")
    multi = _engines()
    seen = []
    for engine in (single, multi):
        store = RotaryStore(None, engine, RotationStats())
        rotation.track(engine, FakeReq("m", [1], [2]))
        engine.sync_full_blocks("m", torch.arange(0, 16), 16)  # a running request's mirror: not counted
        engine.track("p")
        hk = engine.save_request("p", torch.arange(20, 30), 10)
        store.park(RotaryEntry(req=FakeReq("p", [1], [2]), host_kv=hk, paused_at=0.0), 1)
        seen.append(sum(n for *_, n in host_bytes(engine, store)))
        store._release("p")
        assert sum(n for *_, n in host_bytes(engine, store)) == 0 and store.host_blocks == 0
    assert seen[0] == seen[1] == 3 * single.host_pool.bytes_per_block


@pytest.mark.parametrize("flag", ["ttft_slo_ms", "tbt_slo_ms"])
def test_an_slo_flag_below_the_floor_is_a_config_error_naming_it(flag: str) -> None:
    with pytest.raises(ConfigError, match=flag.replace("_", "-")):
        SuperInferConfig(**{flag: 1e-4})
