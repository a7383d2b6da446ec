"""The arrival probe's summary: matched prompts per arrival state and core assignment."""

from __future__ import annotations

import pytest

from superinfer_sgl.bench.arrival_probe import KINDS, SYSTEMS, summarize, table


def _rec(system: str, swap: int, kind: str, prompt: int, ms: float) -> dict:
    return {"system": system, "swap": swap, "kind": kind, "prompt": prompt, "ttft_s": ms / 1e3}


def test_summary_splits_states_and_pairs_the_same_prompts() -> None:
    recs = []
    for swap in (0, 1):
        for p in range(8):
            base = 200.0 + 10 * p
            recs.append(_rec("sglang", swap, "idle", p, base))
            recs.append(_rec("superinfer", swap, "idle", p, base))
            recs.append(_rec("sglang", swap, "busy", p, base + 20))
            recs.append(_rec("superinfer", swap, "busy", p, (base + 20) * 1.05))
    recs.append(_rec("superinfer", 0, "busy", 99, 5000.0))  # no stock twin: left out on both sides
    s = summarize(recs)
    assert set(s) == set(KINDS)
    assert s["idle"]["n"] == 16 and s["busy"]["n"] == 16
    assert s["idle"]["ratio"]["median"] == pytest.approx(1.0) and s["idle"]["diff_ms"]["mean"] == pytest.approx(0.0)
    assert s["busy"]["ratio"]["median"] == pytest.approx(1.05) and s["busy"]["ratio"]["ci"] == pytest.approx([1.05, 1.05])
    assert s["busy"]["sglang_median_ms"] == pytest.approx(255.0)
    lo, hi = s["busy"]["diff_ms"]["ci"]
    assert s["busy"]["diff_ms"]["mean"] == pytest.approx(12.75)  # 5% of 220..290 ms
    assert 0 < lo < 12.75 < hi
    md = table(s)
    assert "| busy | 16 | 255.0 | 267.8 | +12.8 (" in md and "1.050 (1.050..1.050)" in md


def test_a_state_nobody_probed_is_not_reported() -> None:
    recs = [_rec(system, 0, "idle", p, 100.0 + p) for system in SYSTEMS for p in range(3)]
    recs.append(_rec("sglang", 0, "busy", 0, 100.0))  # one side only: nothing to compare
    assert set(summarize(recs)) == {"idle"}
