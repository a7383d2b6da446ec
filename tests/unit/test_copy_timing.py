"""Copy timing of rotations (duplexkv/copy_timing.py) and its Prometheus series (integration/copy_metrics.py).

On a CPU the spans are wall clock and the two directions of a rotate() call run one after the other,
so their overlap is 0; the overlap arithmetic itself is checked on hand-made spans. The CUDA test
(skipped here) checks that events bracket the copies on their own lanes.
"""

from __future__ import annotations

import pytest
import torch

from superinfer_sgl.duplexkv import DevicePoolView, HostKVPool, RotationEngine
from superinfer_sgl.duplexkv.copy_timing import CopyTimer, Span, TimedCall

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def engine(rows: int = 256, blocks: int = 64) -> RotationEngine:
    dev = DevicePoolView.synthetic(rows, 4, 2, 16, torch.float16, DEVICE)
    for buf in dev.k_buffers + dev.v_buffers:
        buf.copy_(torch.randn_like(buf, dtype=torch.float32).to(buf.dtype))
    host = HostKVPool(blocks, 4, 2, 16, 4, torch.float16, pin=None)
    return RotationEngine(dev, host, transfer="torch")


def test_a_duplex_rotate_call_times_both_directions() -> None:
    e = engine()
    saved = e.save(torch.arange(0, 40))
    t0 = e.copy_timer.totals()
    assert t0["out_calls"] == 1 and t0["out_s"] > 0 and t0["in_calls"] == 0
    handle = e.rotate(out=[(None, torch.arange(40, 80), 40)], inn=[(saved, torch.arange(100, 140))])
    handle.synchronize()
    e.quiesce()
    t = e.copy_timer.totals()
    assert (t["out_calls"], t["in_calls"], t["duplex_calls"]) == (2, 1, 1)
    assert t["out_s"] > t0["out_s"] and t["in_s"] > 0
    assert set(e.copy_timer.last) == {"out", "in", "overlap"}
    if DEVICE == "cpu":  # synchronous lanes: one direction after the other
        assert t["overlap_s"] == 0.0


def test_prefetch_is_timed_as_an_in_copy_and_an_empty_call_is_not() -> None:
    e = engine()
    saved = e.save(torch.arange(0, 12))
    e.prefetch(saved, torch.arange(50, 62)).synchronize()
    e.quiesce()
    assert e.copy_timer.totals()["in_calls"] == 1
    e.rotate()  # nothing to move: no span
    assert e.copy_timer.totals()["in_calls"] == 1 and e.copy_timer.totals()["out_calls"] == 1


@pytest.mark.parametrize("out_span,in_span,overlap", [
    ((0.0, 1.0), (0.5, 2.0), 0.5),   # in starts while out runs
    ((1.0, 2.0), (0.0, 3.0), 1.0),   # out entirely inside in
    ((0.0, 1.0), (1.5, 2.0), 0.0),   # one after the other
])
def test_overlap_is_the_time_both_spans_ran(out_span, in_span, overlap) -> None:
    timer = CopyTimer()
    call = TimedCall({"out": Span(*out_span), "in": Span(*in_span)})
    timer.add(call)
    t = timer.totals()
    assert t["overlap_s"] == pytest.approx(overlap)
    assert t["out_s"] == pytest.approx(out_span[1] - out_span[0]) and t["in_s"] == pytest.approx(in_span[1] - in_span[0])


def test_copy_metrics_advance_by_what_was_read() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from superinfer_sgl.integration.copy_metrics import CopyMetrics

    registry = prometheus_client.CollectorRegistry()
    metrics, timer = CopyMetrics(registry), CopyTimer()
    timer.add(TimedCall({"out": Span(0.0, 0.25), "in": Span(0.125, 0.5)}))
    metrics.update(timer)
    metrics.update(timer)  # nothing new: no double count
    timer.add(TimedCall({"out": Span(0.0, 0.5)}))
    metrics.update(timer)
    get = registry.get_sample_value
    assert get("superinfer_kv_copy_out_seconds_total") == pytest.approx(0.75)
    assert get("superinfer_kv_copy_in_seconds_total") == pytest.approx(0.375)
    assert get("superinfer_kv_copy_overlap_seconds_total") == pytest.approx(0.125)
    assert get("superinfer_kv_copies_total", {"direction": "out"}) == 2
    assert get("superinfer_kv_copies_total", {"direction": "in"}) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_time_each_lane_and_are_read_only_once_done() -> None:
    e = engine(rows=1 << 16, blocks=1 << 12)
    saved = e.save(torch.arange(0, 8192, device=DEVICE))
    handle = e.rotate(out=[(None, torch.arange(8192, 16384, device=DEVICE), 8192)],
                      inn=[(saved, torch.arange(20000, 28192, device=DEVICE))])
    handle.synchronize()
    e.quiesce()
    t = e.copy_timer.totals()
    assert t["duplex_calls"] == 1 and t["out_s"] > 0 and t["in_s"] > 0
    assert 0.0 <= t["overlap_s"] <= min(e.copy_timer.last["out"], e.copy_timer.last["in"]) + 1e-6
