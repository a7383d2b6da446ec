"""The recompute tax: the in-server tally (integration/metrics.RecomputeTally and its hooks) and
the harness's reading of SGLang's own counters (bench/recompute.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from superinfer_sgl.bench import recompute
from superinfer_sgl.integration.metrics import RecomputeTally, RotaSchedMetrics, recompute_hooks


def _req(rid: str, prompt: int, out: int, stained: bool = False) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, origin_input_ids=list(range(prompt)), output_ids=list(range(out)),
                           retracted_stain=stained)


def _batch(reqs: list, extend: list[int], computed: int, reprocessed: int) -> SimpleNamespace:
    stats = SimpleNamespace(log_input_tokens=computed, log_replay_tokens=0, reprocessed_log_input_tokens=reprocessed)
    return SimpleNamespace(reqs=reqs, extend_lens=extend, prefill_stats=stats)


def test_retraction_then_readmission_counts_the_recomputed_extend_only():
    t = RecomputeTally()
    a, b = _req("a", 100, 20), _req("b", 50, 0)
    t.prefill_batch(_batch([a, b], [100, 50], 150, 0))
    assert (t.prefill_tokens, t.recomputed_tokens, t.ratio) == (150, 0, 0.0)
    with t.retraction():  # SGLang retracted a (120 tokens of KV dropped) and requeued it
        t.requeued(a)
    assert t.released_tokens == {"retraction": 120, "recompute_fallback": 0} and not t.in_retraction
    a.retracted_stain = True
    # re-admitted: the radix cache still held 64 tokens, so 56 are computed again
    assert t.prefill_batch(_batch([a], [56], 56, 56)) == 56
    assert t.recomputed == {"retraction": 56, "recompute_fallback": 0, "rotation": 0}
    assert t.prefill_tokens == 206 and t.ratio == pytest.approx(56 / 206)


def test_a_requeue_without_retraction_is_a_recompute_fallback():
    t = RecomputeTally()
    c = _req("c", 30, 10, stained=True)
    t.requeued(c)
    assert t.released_tokens["recompute_fallback"] == 40
    t.prefill_batch(_batch([c], [40], 40, 40))
    assert t.recomputed["recompute_fallback"] == 40


def test_unexplained_reprocessed_tokens_go_to_rotation_and_causes_are_forgotten():
    t = RecomputeTally()
    r = _req("r", 30, 10, stained=True)  # rotated out (released by us, not requeued), resumed
    t.prefill_batch(_batch([r], [3], 3, 3))
    assert t.recomputed["rotation"] == 3
    a = _req("a", 10, 5)
    with t.retraction():
        t.requeued(a)
    a.retracted_stain = True
    chunk = _batch([a], [8], 8, 8)
    t.prefill_batch(chunk, chunked=a)  # first chunk: the cause is kept for the rest
    t.prefill_batch(_batch([a], [7], 7, 7))
    assert t.recomputed["retraction"] == 15
    t.prefill_batch(_batch([a], [2], 2, 2))  # a later resume of a: no recorded release any more
    assert t.recomputed["retraction"] == 15 and t.recomputed["rotation"] == 5


def test_the_hooks_feed_the_metrics_and_a_failure_stops_counting_quietly():
    reg = CollectorRegistry()
    m = RotaSchedMetrics(registry=reg)
    rt = SimpleNamespace(metrics=m)
    h = recompute_hooks(lambda: rt)
    tally = recompute_hooks.__globals__["recompute_tally"]()
    base_prefill, base_rec = tally.prefill_tokens, tally.recomputed_tokens
    a, b = _req("hook-a", 40, 8), _req("hook-b", 4, 0)
    sched = SimpleNamespace(chunked_req=None)
    running = SimpleNamespace()
    h["prefill"]((_batch([a], [40], 40, 0), running), sched)  # _get_new_batch_prefill_raw's (batch, running)
    h["prefill"]((None, running), sched)  # no prefill this step

    def update_running_batch(s, batch):  # SGLang's: retracts and requeues a
        h["requeued"](s, a, is_retracted=True)
        h["requeued"](s, b)  # a fresh request queued: not a release
        return batch

    assert h["decode_update"](update_running_batch, sched, running) is running
    h["requeued"](sched, _req("hook-c", 5, 5), is_retracted=True)  # outside it: our recompute fallback
    assert tally.released_tokens["retraction"] >= 48 and tally.released_tokens["recompute_fallback"] >= 10
    a.retracted_stain = True
    h["prefill"]((_batch([a], [48], 48, 48), running), sched)
    assert tally.prefill_tokens - base_prefill == 88 and tally.recomputed_tokens - base_rec == 48
    text = generate_latest(reg).decode()
    assert 'superinfer_recomputed_tokens_total{cause="retraction"}' in text
    assert reg.get_sample_value("superinfer_prefill_tokens_total") == tally.prefill_tokens
    assert reg.get_sample_value("superinfer_recomputed_tokens_total", {"cause": "retraction"}) == \
        tally.recomputed["retraction"]
    assert reg.get_sample_value("superinfer_recompute_ratio", {"dp_rank": m.rank}) == pytest.approx(tally.ratio)
    h["prefill"]((SimpleNamespace(prefill_stats=SimpleNamespace()), running), sched)  # malformed: logged
    h["prefill"]((_batch([a], [5], 5, 0), running), sched)  # counting has stopped
    assert tally.prefill_tokens - base_prefill == 88


EXPOSITION = """# TYPE sglang:realtime_tokens_total counter
sglang:realtime_tokens_total{engine_type="unified",mode="prefill_compute",model_name="m"} %d
sglang:realtime_tokens_total{engine_type="unified",mode="prefill_cache",model_name="m"} 999.0
sglang:realtime_tokens_total{engine_type="unified",mode="decode",model_name="m"} %d
sglang:prefill_effective_tokens_total{engine_type="unified",mode="input",model_name="m"} %d
sglang:prefill_effective_tokens_total{engine_type="unified",mode="device_hit",model_name="m"} 7.0
"""


def test_the_harness_reads_the_tax_from_sglangs_counters():
    before = recompute.labelled(EXPOSITION % (1000, 50, 1000))
    after = recompute.labelled(EXPOSITION % (1600, 90, 1450))
    d = recompute.deltas(before, after)
    assert d["prefill_tokens"] == 600 and d["first_pass_tokens"] == 450 and d["decode_tokens"] == 40
    assert d["recomputed_tokens"] == 150 and d["tax"] == pytest.approx(0.25)
    assert d["ours_recomputed_tokens"] is None  # stock: no superinfer_ series


def test_missing_series_are_unknown_not_zero_and_pooling_sums_tokens():
    assert recompute.deltas({}, {})["tax"] is None
    pts = [{"rate": 1.0, "recompute": {"recomputed_tokens": 10.0, "prefill_tokens": 100.0}},
           {"rate": 2.0, "recompute": {"recomputed_tokens": 30.0, "prefill_tokens": 100.0}},
           {"rate": 2.0, "recompute": None}]
    pooled = recompute.pooled_tax(pts)
    assert pooled["tax"] == pytest.approx(0.2) and pooled["runs"] == 2 and pooled["runs_without"] == 1
    table = recompute.tax_markdown({"sglang": pts})
    assert "10.00% (10 / 100)" in table and "30.00%" in table and "20.00%" in table
