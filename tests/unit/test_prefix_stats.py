"""The prefix A/B's statistics (bench/prefix_stats.py): SLOs from the control, and ours minus every
stock policy for each of our arms that ran (predictive, predictive+host), paired by request."""

from __future__ import annotations

import pytest

from superinfer_sgl.bench.prefix_stats import OURS, control_slos, markdown, summarize


def _run(kind: str, arm: str, cached: list[int], ttft: list[float]) -> dict:
    recs = [{"idx": i, "turn": 0, "ok": True, "ttft_s": t, "e2e_s": t + 0.7, "output_tokens": 8,
             "prompt_tokens": 100, "cached_tokens": c} for i, (c, t) in enumerate(zip(cached, ttft))]
    return {"kind": kind, "arm": arm, "rep": 0, "records": recs, "wall_s": 10.0, "peak_token_usage": 0.5}


def test_every_ours_arm_is_compared_with_every_stock_arm() -> None:
    n = 6
    runs = [_run("unique", arm, [0] * n, [0.1] * n) for arm in ("predictive+host", "lru", "tlru")]
    runs += [_run("tenants", "predictive+host", [80] * n, [0.1] * n),
             _run("tenants", "lru", [40] * n, [0.1] * 3 + [0.5] * 3),
             _run("tenants", "tlru", [60] * n, [0.1] * n)]
    ttft_ms, _ = control_slos(runs)
    assert ttft_ms == pytest.approx(200.0)  # 2x the control's median TTFT
    s = summarize(runs, None, None)
    diffs = {(d["workload"], d["ours"], d["baseline"]): d for d in s["ours_minus_stock"]}
    assert set(diffs) == {(k, "predictive+host", b) for k in ("tenants", "unique") for b in ("lru", "tlru")}
    assert diffs["tenants", "predictive+host", "lru"]["hit_share"] == pytest.approx(0.4)
    assert diffs["tenants", "predictive+host", "lru"]["ttft_attainment"] == pytest.approx(0.5)
    assert diffs["tenants", "predictive+host", "tlru"]["hit_share"] == pytest.approx(0.2)
    assert "predictive+host - lru" in markdown(s)
    assert {"predictive", "predictive+host"} <= set(OURS)


def test_paired_runs_compare_ours_with_the_stock_arm_it_ran_beside() -> None:
    """With --paired ours runs once beside each stock arm; each difference reads only the run made
    beside that arm (the same machine phase), not ours pooled over every pair."""
    n = 6

    def beside(run: dict, pair: str) -> dict:
        return {**run, "pair": pair}

    runs = [beside(_run("tenants", "predictive+host", [80] * n, [0.1] * n), "lru"),
            beside(_run("tenants", "lru", [40] * n, [0.1] * n), "lru"),
            # beside T-LRU ours ran in a slow phase: every TTFT missed, and so did T-LRU's half
            beside(_run("tenants", "predictive+host", [80] * n, [0.5] * n), "tlru"),
            beside(_run("tenants", "tlru", [60] * n, [0.1] * 3 + [0.5] * 3), "tlru")]
    s = summarize(runs, 200.0, 1000.0)
    assert s["paired"] is True
    diffs = {d["baseline"]: d for d in s["ours_minus_stock"]}
    assert diffs["lru"]["pairs"] == n and diffs["tlru"]["pairs"] == n
    assert diffs["lru"]["ttft_attainment"] == pytest.approx(0.0)
    assert diffs["tlru"]["ttft_attainment"] == pytest.approx(-0.5)
    ours = next(r for r in s["table"] if r["arm"] == "predictive+host")
    assert ours["requests"] == 2 * n and set(ours["per_repeat"]) == {"0 beside lru", "0 beside tlru"}


def test_with_two_of_our_arms_each_stock_run_pairs_with_the_arm_it_ran_beside() -> None:
    """Each stock arm runs twice per repeat (beside predictive, beside predictive+host): a difference
    reads the stock run made beside that arm of ours, never the other one."""
    n = 4

    def side(kind: str, arm: str, other: str, stock: str, ttft: list[float]) -> dict:
        return {**_run(kind, arm, [0] * n, ttft), "pair": stock, "beside": other}

    runs = [side("unique", "predictive", "lru", "lru", [0.1] * n),
            side("unique", "lru", "predictive", "lru", [0.5] * n),  # a slow phase for this pair
            side("unique", "predictive+host", "lru", "lru", [0.1] * n),
            side("unique", "lru", "predictive+host", "lru", [0.1] * n)]
    diffs = {d["ours"]: d for d in summarize(runs, 200.0, 1000.0)["ours_minus_stock"]}
    assert diffs["predictive"]["pairs"] == n and diffs["predictive"]["ttft_attainment"] == pytest.approx(1.0)
    assert diffs["predictive+host"]["ttft_attainment"] == pytest.approx(0.0)
    lru = next(r for r in summarize(runs, 200.0, 1000.0)["table"] if r["arm"] == "lru")
    assert set(lru["per_repeat"]) == {"0 beside predictive", "0 beside predictive+host"}


def test_the_repeat_interval_holds_the_spread_between_runs() -> None:
    """Three repeats whose differences disagree (+0.5, 0, -0.5 of TTFT attainment): the request
    bootstrap over 3 x 8 requests is narrower than the t interval over the three differences,
    which straddles zero; with one repeat there is no repeat interval (n/a)."""
    n = 8

    def rep(run: dict, r: int) -> dict:
        return {**run, "rep": r}

    runs = []
    for r, stock_ttft in enumerate(([0.5] * 4 + [0.1] * 4, [0.1] * n, [0.1] * n)):
        ours_ttft = [0.1] * 4 + [0.5] * 4 if r == 2 else [0.1] * n
        runs += [rep(_run("tenants", "predictive+host", [80] * n, ours_ttft), r),
                 rep(_run("tenants", "lru", [40] * n, stock_ttft), r)]
    d = summarize(runs, 200.0, 1000.0)["ours_minus_stock"][0]
    assert d["repeats"] == 3 and d["ttft_attainment_per_repeat"] == pytest.approx([0.5, 0.0, -0.5])
    lo, hi = d["ttft_attainment_repeat_ci"]
    assert lo < 0 < hi and hi - lo > d["ttft_attainment_ci"][1] - d["ttft_attainment_ci"][0]
    assert d["joint_attainment_repeat_ci"] == d["ttft_attainment_repeat_ci"]  # TBT met throughout
    assert d["hit_share"] == pytest.approx(0.4)
    one = summarize([x for x in runs if x["rep"] == 1], 200.0, 1000.0)
    assert one["ours_minus_stock"][0]["repeats"] == 1 and one["ours_minus_stock"][0]["ttft_attainment_repeat_ci"] is None
    assert "[n/a]" in markdown(one)
