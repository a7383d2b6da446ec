"""Differences between two systems with confidence intervals (scipy), pooled over repeats.

A comparison is always between *matched* runs: the same requests, SLOs and arrival schedule (one
repeat of one rate), ideally run at the same time (`--paired`). Two intervals per difference:
  request level  scipy.stats.bootstrap over the matched request pairs of all repeats (paired
                 resampling: request i of A and request i of B stay together), percentile method;
  repeat level   Student-t interval of the per-repeat differences (scipy.stats.ttest_1samp), which
                 carries the run-to-run noise the request-level interval cannot see (K >= 2).
A difference "excludes zero" only when every interval that exists does, on the same side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import stats

from ..rotasched.clock import TBT_MET_SHARE

LEVEL = 0.95
N_RESAMPLES = 4000


# ---- per-request indicators of one run (the runner's point["requests"]) ------------------------
def ttft_met(req: Mapping[str, Sequence[Any]]) -> np.ndarray:
    return np.array([bool(ok) and t <= slo for ok, t, slo in zip(req["success"], req["ttft_ms"], req["ttft_slo_ms"])])


def tbt_share(req: Mapping[str, Sequence[Any]]) -> np.ndarray:
    return np.array([(m / g if g else 1.0) if ok else 0.0
                     for ok, m, g in zip(req["success"], req["gaps_met"], req["n_gaps"])])


def tpot_met(req: Mapping[str, Sequence[Any]]) -> np.ndarray:
    """Mean time per output token after the first, (e2e - TTFT) / (outputs - 1), within the TBT
    SLO: DistServe's rule and SGLang bench_serving's TPOT (a failed request misses)."""
    return np.array([bool(ok) and (n <= 1 or (e2e - t) / (n - 1) <= slo)
                     for ok, t, e2e, n, slo in zip(req["success"], req["ttft_ms"], req["e2e_ms"], req["output_len"],
                                                   req["tbt_slo_ms"])])


def joint_met(req: Mapping[str, Sequence[Any]], rule: str = "gaps") -> np.ndarray:
    """TTFT met and the TBT SLO met by `rule`: "gaps" (>= TBT_MET_SHARE of the gaps, the server's
    rule) or "tpot" (`tpot_met`)."""
    if rule == "tpot":
        return ttft_met(req) & tpot_met(req)
    assert rule == "gaps", rule
    return ttft_met(req) & (tbt_share(req) >= TBT_MET_SHARE)


def gaps(req: Mapping[str, Sequence[Any]]) -> tuple[np.ndarray, np.ndarray]:
    """(gaps met, gaps) per request; a failed request's gaps all count as missed."""
    met = np.array([m if ok else 0 for ok, m in zip(req["success"], req["gaps_met"])], dtype=float)
    return met, np.array(req["n_gaps"], dtype=float)


# ---- intervals -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Diff:
    """B - A (attainment in points, i.e. x100), or B / A for a ratio metric."""

    metric: str
    estimate: float
    request_ci: tuple[float, float] | None
    repeat_ci: tuple[float, float] | None
    per_repeat: tuple[float, ...]
    null: float  # 0 for differences, 1 for ratios

    @property
    def excludes_null(self) -> bool:
        cis = [ci for ci in (self.request_ci, self.repeat_ci) if ci is not None]
        if not cis or any(not np.isfinite(c).all() for c in cis):
            return False
        return all(lo > self.null for lo, _ in cis) or all(hi < self.null for _, hi in cis)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "excludes_null": self.excludes_null}


def _bootstrap(samples: tuple[np.ndarray, ...], statistic: Callable[..., np.ndarray],
               seed: int) -> tuple[float, float] | None:
    if len(samples[0]) < 2:
        return None
    flat = np.concatenate([s.astype(float) for s in samples])
    if np.all(flat == flat[0]):  # nothing varies: the interval is the point itself
        v = float(statistic(*samples, axis=-1))
        return (v, v)
    res = stats.bootstrap(samples, statistic, paired=True, vectorized=True, confidence_level=LEVEL,
                          n_resamples=N_RESAMPLES, method="percentile", rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _t_interval(values: Sequence[float]) -> tuple[float, float] | None:
    """None with fewer than two repeats, or when they agree exactly (a few repeats of 80 requests
    move in 1.25-point steps: equal differences say nothing about the spread)."""
    if len(values) < 2 or np.ptp(values) == 0:
        return None
    ci = stats.ttest_1samp(values, 0.0).confidence_interval(LEVEL)
    return float(ci.low), float(ci.high)


def mean_interval(values: Sequence[float]) -> tuple[float, float] | None:
    """Student-t 95% interval of the mean of per-repeat values (None: fewer than two, or all equal)."""
    return _t_interval(values)


def _mean_diff(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return 100.0 * (np.mean(b, axis=axis) - np.mean(a, axis=axis))


def _share_diff(am: np.ndarray, an: np.ndarray, bm: np.ndarray, bn: np.ndarray, axis: int = -1) -> np.ndarray:
    return 100.0 * (np.sum(bm, axis=axis) / np.maximum(np.sum(bn, axis=axis), 1)
                    - np.sum(am, axis=axis) / np.maximum(np.sum(an, axis=axis), 1))


def indicator_diff(metric: str, a_runs: Sequence[np.ndarray], b_runs: Sequence[np.ndarray], seed: int = 0) -> Diff:
    """A per-request yes/no metric (TTFT met, joint met): difference of shares, in points."""
    per = tuple(float(_mean_diff(a, b)) for a, b in zip(a_runs, b_runs))
    a, b = np.concatenate(a_runs), np.concatenate(b_runs)
    return Diff(metric, float(_mean_diff(a, b)), _bootstrap((a, b), _mean_diff, seed), _t_interval(per), per, 0.0)


def gap_diff(a_runs: Sequence[tuple[np.ndarray, np.ndarray]], b_runs: Sequence[tuple[np.ndarray, np.ndarray]],
             seed: int = 0) -> Diff:
    """TBT attainment over gaps (gaps met / gaps, pooled): requests resampled with their gaps."""
    per = tuple(float(_share_diff(am, an, bm, bn)) for (am, an), (bm, bn) in zip(a_runs, b_runs))
    cols = [np.concatenate([r[j] for r in runs]) for runs in (a_runs, b_runs) for j in (0, 1)]
    est = float(_share_diff(*cols))
    return Diff("tbt_gap_attainment", est, _bootstrap(tuple(cols), _share_diff, seed), _t_interval(per), per, 0.0)


def _median_ratio(a: np.ndarray, b: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.median(b, axis=axis) / np.median(a, axis=axis)


def median_ratio(metric: str, a_runs: Sequence[np.ndarray], b_runs: Sequence[np.ndarray], seed: int = 0) -> Diff:
    """A per-request time (TTFT, TPOT) of matched requests: B's median / A's median, pooled over
    repeats, with the paired bootstrap over requests and the t interval of the per-repeat ratios.
    NaN marks a request with no value on either side (failed, or one output token): such pairs
    are left out on both sides, so the two medians stay over the same requests."""
    keep = [~(np.isnan(a) | np.isnan(b)) for a, b in zip(a_runs, b_runs)]
    a_runs = [a[k] for a, k in zip(a_runs, keep)]
    b_runs = [b[k] for b, k in zip(b_runs, keep)]
    per = tuple(float(_median_ratio(a, b)) for a, b in zip(a_runs, b_runs) if a.size and np.median(a) > 0)
    a, b = np.concatenate(a_runs), np.concatenate(b_runs)
    if a.size == 0 or np.median(a) <= 0:
        return Diff(metric, float("nan"), None, None, per, 1.0)
    return Diff(metric, float(_median_ratio(a, b)), _bootstrap((a, b), _median_ratio, seed), _t_interval(per), per, 1.0)


def ttft_ms(req: Mapping[str, Sequence[Any]]) -> np.ndarray:
    """TTFT per request (ms); NaN where the request failed."""
    return np.array([float(t) if ok else np.nan for ok, t in zip(req["success"], req["ttft_ms"])])


def tpot_ms(req: Mapping[str, Sequence[Any]]) -> np.ndarray:
    """Mean inter-token time per request (ms): (E2E - TTFT) / (outputs - 1); NaN where it failed
    or produced a single token."""
    return np.array([(float(e) - float(t)) / (n - 1) if ok and n > 1 else np.nan
                     for ok, t, e, n in zip(req["success"], req["ttft_ms"], req["e2e_ms"], req["output_len"])])


def ratio(metric: str, a_values: Sequence[float], b_values: Sequence[float]) -> Diff:
    """A per-run figure (output tokens/s): B / A per repeat, the mean ratio and its t interval."""
    per = tuple(b / a for a, b in zip(a_values, b_values) if a > 0)
    est = float(np.mean(per)) if per else float("nan")
    return Diff(metric, est, None, _t_interval(per), per, 1.0)


def compare_runs(a_points: Sequence[Mapping[str, Any]], b_points: Sequence[Mapping[str, Any]],
                 seed: int = 0) -> dict[str, Diff]:
    """Matched runs of A and B (one per repeat, same requests each) -> every difference we report,
    overall and per SLO class."""
    ra, rb = [p["requests"] for p in a_points], [p["requests"] for p in b_points]
    for x, y in zip(ra, rb):
        if len(x["success"]) != len(y["success"]) or list(x["ttft_slo_ms"]) != list(y["ttft_slo_ms"]):
            raise ValueError("runs are not matched (different requests)")
    out = {
        "joint_attainment": indicator_diff("joint_attainment", [joint_met(r) for r in ra], [joint_met(r) for r in rb], seed),
        "ttft_attainment": indicator_diff("ttft_attainment", [ttft_met(r) for r in ra], [ttft_met(r) for r in rb], seed),
        "tbt_gap_attainment": gap_diff([gaps(r) for r in ra], [gaps(r) for r in rb], seed),
        "output_throughput": ratio("output_throughput", [p["summary"]["output_throughput_tps"] for p in a_points],
                                   [p["summary"]["output_throughput_tps"] for p in b_points]),
        # the no-overload parity figures (issue 35 item 4: within 2% of stock below half its capacity)
        "ttft_p50": median_ratio("ttft_p50", [ttft_ms(r) for r in ra], [ttft_ms(r) for r in rb], seed),
    }
    if all("e2e_ms" in r and "output_len" in r for r in ra + rb):
        out["tpot_p50"] = median_ratio("tpot_p50", [tpot_ms(r) for r in ra], [tpot_ms(r) for r in rb], seed)
    classes = sorted({c for r in ra for c in r.get("slo_class", []) if c is not None})
    for cls in classes:
        pick = [np.array([c == cls for c in r["slo_class"]]) for r in ra]
        key = f"joint_attainment[{cls}]"
        out[key] = indicator_diff(key, [joint_met(r)[m] for r, m in zip(ra, pick)],
                                  [joint_met(r)[m] for r, m in zip(rb, pick)], seed)
    return out


def pooled(points: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One system at one rate, pooled over its runs: attainment over all requests (and gaps), mean
    throughput, P99 TTFT of all completed requests, per-class joint attainment."""
    reqs = [p["requests"] for p in points]
    joint = np.concatenate([joint_met(r) for r in reqs])
    met, n = (np.concatenate(x) for x in zip(*(gaps(r) for r in reqs)))
    ttfts = [t for r in reqs for ok, t in zip(r["success"], r["ttft_ms"]) if ok]
    classes = [c for r in reqs for c in r.get("slo_class", [])]
    by_class = {c: float(joint[[x == c for x in classes]].mean()) for c in sorted({c for c in classes if c})}
    return {
        "runs": len(points), "n": int(len(joint)),
        "completed": int(sum(sum(bool(x) for x in r["success"]) for r in reqs)),
        "joint_attainment": float(joint.mean()),
        "ttft_attainment": float(np.concatenate([ttft_met(r) for r in reqs]).mean()),
        "tbt_gap_attainment": float(met.sum() / n.sum()) if n.sum() else 1.0,
        "output_throughput_tps": float(np.mean([p["summary"]["output_throughput_tps"] for p in points])),
        "p99_ttft_ms": float(np.percentile(ttfts, 99)) if ttfts else None,
        "joint_by_class": by_class,
    }
