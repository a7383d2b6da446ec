"""The headroom gauges of /metrics, from the figures the runtime hands them after a step
(RotaSchedMetrics.update, integration/step_figures.py)."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from fakes import FakeReq, sampling
from prometheus_client import CollectorRegistry

from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.duplexkv.engine import HostKV
from superinfer_sgl.integration.clocks import Clocks
from superinfer_sgl.integration.metrics import RotaSchedMetrics
from superinfer_sgl.integration.rotary_store import RotaryStore
from superinfer_sgl.integration.rotation import RotaryEntry, RotationStats
from superinfer_sgl.integration.step_figures import StepFigures, step_figures
from superinfer_sgl.rotasched import ReqState, Slo, VltParams
from superinfer_sgl.rotasched.clock import ReqClock
from superinfer_sgl.rotasched.goodput import StepCosts


class Queue:
    """The requests as a step leaves them, in the runtime's own collaborators (Clocks, RotaryStore)
    on a fake scheduler; `figures()` is what the runtime hands the metrics."""

    def __init__(self, now: float) -> None:
        slo = Slo(1000.0, 50.0)  # 1 s TTFT, 50 ms TBT
        fresh, stale = FakeReq("fresh", output_ids=[]), FakeReq("stale", output_ids=[])
        parked = FakeReq("parked", output_ids=[1, 2, 3], sampling_params=sampling(max_new_tokens=40))
        run = FakeReq("run", output_ids=[1] * 30, sampling_params=sampling(max_new_tokens=40))
        self.sched = SimpleNamespace(waiting_queue=[fresh, stale], running_batch=SimpleNamespace(reqs=[run]))
        self.clocks = Clocks(SuperInferConfig(), StepCosts(1e-3, 0.0, 0.02, 0.0))
        self.clocks.by_rid.update({
            "fresh": ReqClock("fresh", now - 0.1, slo),
            "stale": ReqClock("stale", now - 3.0, slo, slo_class="interactive"),  # TTFT already gone
            "parked": ReqClock("parked", now - 2.0, slo, state=ReqState.ROTARY, first_token=now - 1.9,
                               last_token=now - 1.0, outputs_seen=3, gaps=2),
            "run": ReqClock("run", now - 5.0, slo, state=ReqState.RUNNING, run_start=now - 1.0,
                            first_token=now - 4.9, last_token=now - 0.01, outputs_seen=30, gaps=29,
                            gaps_missed=10),  # 10 of 29 gaps missed: its TBT SLO is lost
        })
        self.store = RotaryStore(self.sched, None, RotationStats())
        self.store.entries["parked"] = RotaryEntry(parked, HostKV((0,), 2, 16), now - 1.0)

    def figures(self) -> StepFigures:
        return step_figures(self.sched, None, self.clocks, self.store, self.store.stats, 8, VltParams(3.0, 0.5, 0.0),
                            60.0, 4096)


def _v(reg: CollectorRegistry, name: str, **labels: str) -> float | None:
    return reg.get_sample_value(name, {"dp_rank": "0", **labels})


def test_headroom_gauges_from_the_runtime() -> None:
    reg = CollectorRegistry()
    m = RotaSchedMetrics(registry=reg)
    assert _v(reg, "superinfer_queue_vlt_max_seconds") == 0.0  # present before any request
    assert _v(reg, "superinfer_requests_at_risk", state="waiting") == 0.0
    now = time.monotonic()
    m.update(Queue(now).figures())
    # the largest time past its slack: "stale" waited 3 s against 0.5 x 1 s of TTFT slack (2.5 s);
    # "parked" is 1 s past its last token (scheduled by alpha 3 x 1 s, exported unweighted)
    vlt = _v(reg, "superinfer_queue_vlt_max_seconds")
    assert vlt is not None and 2.5 <= vlt < 2.7
    assert _v(reg, "superinfer_waiting_requests") == 2.0
    assert _v(reg, "superinfer_requests_at_risk", state="waiting") == 1.0  # "stale" only
    # "parked" met its TTFT and missed none of its 2 gaps: 39 gaps in all may miss 3; still viable
    assert _v(reg, "superinfer_requests_at_risk", state="rotary") == 0.0
    assert _v(reg, "superinfer_running_requests_slo_lost") == 1.0
    # rotation off: no engine bytes, and the host pool reads empty
    assert reg.get_sample_value("superinfer_rotation_bytes_total", {"direction": "out"}) is None
    assert reg.get_sample_value("superinfer_host_pool_blocks_total") == 0.0
    assert reg.get_sample_value("superinfer_rotary_requests") == 1.0
    assert reg.get_sample_value("superinfer_eos_output_share") == 0.0  # nothing of unknown length finished


def test_the_learned_eos_output_share_is_published() -> None:
    from superinfer_sgl.rotasched.output_share import MIN_FINISHED

    reg = CollectorRegistry()
    m = RotaSchedMetrics(registry=reg)
    q = Queue(time.monotonic())
    for i in range(MIN_FINISHED):
        q.clocks.finish(FakeReq(f"done{i}", output_ids=[1] * 10, sampling_params=sampling(40, ignore_eos=False)),
                        time.monotonic())
    m.update(q.figures())
    assert reg.get_sample_value("superinfer_eos_output_share") == 0.25


def test_recent_attainment_per_class_window() -> None:
    reg = CollectorRegistry()
    m = RotaSchedMetrics(registry=reg, window=2)
    m.finished("interactive", True, False)
    assert _v(reg, "superinfer_slo_attainment_recent", slo_class="interactive", slo="ttft") == 1.0
    assert _v(reg, "superinfer_slo_attainment_recent", slo_class="interactive", slo="joint") == 0.0
    m.finished("interactive", False, True)
    m.finished("interactive", True, True)  # the first request slides out of the 2-request window
    assert _v(reg, "superinfer_slo_attainment_recent", slo_class="interactive", slo="joint") == 0.5
    assert _v(reg, "superinfer_slo_recent_requests", slo_class="interactive", slo="joint") == 2.0
    m.finished(None, True, None)
    assert _v(reg, "superinfer_slo_attainment_recent", slo_class="default", slo="ttft") == 1.0
    assert _v(reg, "superinfer_slo_attainment_recent", slo_class="default", slo="joint") is None
    # the cumulative counters keep counting everything
    assert reg.get_sample_value("superinfer_slo_requests_total",
                                {"slo_class": "interactive", "slo": "joint", "outcome": "met"}) == 1.0


def test_broken_headroom_does_not_break_update(caplog) -> None:  # type: ignore[no-untyped-def]
    reg = CollectorRegistry()
    m = RotaSchedMetrics(registry=reg)

    def broken() -> list:
        raise AttributeError("no views")

    fig = replace(Queue(time.monotonic()).figures(), queue_views=broken)
    m.update(fig)  # headroom cannot be computed; the rest of update still runs, once logged
    m.update(fig)
    assert reg.get_sample_value("superinfer_rotation_budget_blocks") == 8.0
    assert sum("headroom gauges not updated" in r.message for r in caplog.records) == 1



def test_headroom_under_a_backlog_refreshes_at_most_every_interval(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from fakes import FakeReq

    from superinfer_sgl.integration import metrics as metrics_mod

    clock = [1000.0]
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: clock[0])
    reg = CollectorRegistry()
    m = RotaSchedMetrics(registry=reg)
    q = Queue(clock[0])
    m.update(q.figures())  # a short queue: every step
    assert _v(reg, "superinfer_waiting_requests") == 2.0
    q.sched.waiting_queue.pop()
    clock[0] += 0.001
    m.update(q.figures())
    assert _v(reg, "superinfer_waiting_requests") == 1.0
    n = metrics_mod.HEADROOM_EVERY_STEP + 1
    extra = [FakeReq(f"q{i}", output_ids=[]) for i in range(n)]
    for req in extra:
        q.clocks.by_rid[req.rid] = ReqClock(req.rid, clock[0], Slo(1000.0, 50.0))
    q.sched.waiting_queue.extend(extra)  # a backlog forms: shown at once
    clock[0] += 0.001
    m.update(q.figures())
    assert _v(reg, "superinfer_waiting_requests") == n + 1
    q.sched.waiting_queue.pop()  # within the interval the gauges keep their values
    clock[0] += metrics_mod.HEADROOM_INTERVAL_S / 2
    m.update(q.figures())
    assert _v(reg, "superinfer_waiting_requests") == n + 1
    clock[0] += metrics_mod.HEADROOM_INTERVAL_S
    m.update(q.figures())
    assert _v(reg, "superinfer_waiting_requests") == n
    q.sched.waiting_queue.clear()  # the backlog drains: refreshed at once, idle reads 0
    q.store.entries.clear()
    clock[0] += 0.001
    m.update(q.figures())
    assert _v(reg, "superinfer_waiting_requests") == 0.0
    assert _v(reg, "superinfer_queue_vlt_max_seconds") == 0.0


def test_headroom_with_a_few_requests_refreshes_when_a_count_moves(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Every step cost a CPU server ~0.07 ms of a ~35 ms decode step: with a few requests the gauges
    refresh when a request comes or goes, else at most every interval (their VLT ages meanwhile)."""
    from superinfer_sgl.integration import metrics as metrics_mod

    clock = [1000.0]
    monkeypatch.setattr(metrics_mod.time, "monotonic", lambda: clock[0])
    reg = CollectorRegistry()
    m = RotaSchedMetrics(registry=reg)
    q = Queue(clock[0])
    m.update(q.figures())
    vlt = _v(reg, "superinfer_queue_vlt_max_seconds")
    clock[0] += metrics_mod.HEADROOM_INTERVAL_S / 2  # the same requests: the gauges keep their values
    m.update(q.figures())
    assert _v(reg, "superinfer_queue_vlt_max_seconds") == vlt
    q.sched.running_batch.reqs.clear()  # the running request left: at once
    m.update(q.figures())
    assert _v(reg, "superinfer_running_requests_slo_lost") == 0.0
    assert _v(reg, "superinfer_queue_vlt_max_seconds") > vlt  # aged by half an interval
    vlt = _v(reg, "superinfer_queue_vlt_max_seconds")
    clock[0] += metrics_mod.HEADROOM_INTERVAL_S  # the interval passed: refreshed
    m.update(q.figures())
    assert _v(reg, "superinfer_queue_vlt_max_seconds") > vlt


def test_only_the_first_rank_of_an_attention_tp_group_exports(monkeypatch: pytest.MonkeyPatch) -> None:
    """TP ranks take the same decisions: counted on each, counters and summed gauges would read N
    times the truth. SGLang's own rule (review of 2026-12-03)."""
    import sglang.srt.runtime_context as ctx

    from superinfer_sgl.integration.metrics_rank import is_metrics_rank

    obs = SimpleNamespace(enable_metrics=True, enable_metrics_for_all_schedulers=False)
    monkeypatch.setattr(ctx, "get_observability", lambda: obs)
    for rank, exports in ((0, True), (1, False)):
        monkeypatch.setattr(ctx, "get_parallel", lambda rank=rank: SimpleNamespace(attn_tp_rank=rank, attn_cp_rank=0))
        assert is_metrics_rank() is exports
    obs.enable_metrics_for_all_schedulers = True
    assert is_metrics_rank()
    from superinfer_sgl.integration.startup import open_metrics

    obs.enable_metrics_for_all_schedulers = False
    assert open_metrics() is None  # rank 1
