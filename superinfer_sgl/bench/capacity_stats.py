"""Statistics of live capacity searches (`ab_bench.py --capacity`, bench/capacity_live.py).

`summarize`: capacity per system and repeat; the mean over repeats with a Student-t interval
(scipy); the ratio ours / baseline per repeat, its mean and t interval (bench/stats.py); and a
request-level interval: every measured point's pass share drawn from its posterior given its
requests (Beta, Jeffreys prior) and the first crossing re-read over the rates that were measured.
`by_rule`: the same searches re-read under each TBT rule (90% of gaps; DistServe's mean TPOT) from
their points.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..sim.capacity import SLO_RULES
from . import stats

N_BOOT = 4000


def summarize(runs: Sequence[Mapping[str, Any]], pairs: Sequence[tuple[str, str]],
              results: Mapping[str, Sequence[Mapping[str, Any]]], seed: int = 0, rule: str = "gaps") -> dict[str, Any]:
    """Per system: capacity per repeat, mean, t interval, request-level interval (posterior draws
    of every point's pass share, `_boot_capacity`, a request passing by `rule`: the search's); per
    pair: the ratio B / A per repeat with its t interval, and the ratio of the request-level draws;
    `by_rule`: the searches re-read under each rule."""
    out: dict[str, Any] = {"systems": {}, "pairs": []}
    rng = np.random.default_rng(seed)
    draws: dict[str, np.ndarray] = {}
    for system in dict.fromkeys(r["system"] for r in runs):
        mine = sorted((r for r in runs if r["system"] == system and not r.get("error")), key=lambda r: r["repeat"])
        caps = [_cap(r) for r in mine]
        # (every search of it failed: no draws, and its pairs say nothing)
        boot = np.mean([_boot_capacity(_measured(results.get(system, []), r["repeat"], rule), rng) for r in mine],
                       axis=0) if mine else np.zeros(0)
        draws[system] = boot
        out["systems"][system] = {
            "repeats": [r["repeat"] for r in mine],  # which repeats finished: pairs match on these
            "per_repeat": caps, "censored": [r.get("censored") for r in mine],
            "brackets": [r.get("bracket") for r in mine],
            # rates above the first crossing that met the target again: reported, never counted
            "passes_above": [r.get("passes_above") or [] for r in mine],
            "mean_req_s": float(np.mean(caps)) if caps else None,
            "repeat_ci": stats.mean_interval(caps),
            "request_ci": _pct(boot),
        }
    for a, b in pairs:
        if a not in out["systems"] or b not in out["systems"]:
            continue
        ca, cb = _paired(out["systems"][a], out["systems"][b], "per_repeat")
        ok = [(x, y) for x, y in zip(ca, cb) if x > 0]
        diff = stats.ratio("capacity", [x for x, _ in ok], [y for _, y in ok]) if ok else None
        with np.errstate(divide="ignore", invalid="ignore"):
            rb = draws[b] / draws[a] if len(draws[a]) and len(draws[b]) else np.zeros(0)
        rb = rb[np.isfinite(rb)]
        out["pairs"].append({"a": a, "b": b, "ratio": diff.estimate if diff else None,
                             "ratio_of_means": (np.mean(cb) / np.mean(ca)) if ca and np.mean(ca) else None,
                             "per_repeat": list(diff.per_repeat) if diff else [],
                             "repeat_ci": diff.repeat_ci if diff else None,
                             "request_ci": _pct(rb) if len(rb) else None})
    # (points recorded without end-to-end latencies cannot give a mean TPOT)
    timed = all("e2e_ms" in p["requests"] and "output_len" in p["requests"] for pts in results.values() for p in pts)
    out["rule"] = rule
    out["by_rule"] = by_rule(runs, pairs, results) if timed else None
    return out


def _paired(sa: Mapping[str, Any], sb: Mapping[str, Any], key: str) -> tuple[list[float], list[float]]:
    """Two systems' values of `key` on the repeats both finished, in repeat order (a search that
    failed drops its repeat from the pair, not a later repeat's value into its place)."""
    a, b = dict(zip(sa["repeats"], sa[key])), dict(zip(sb["repeats"], sb[key]))
    both = sorted(a.keys() & b.keys())
    return [a[k] for k in both], [b[k] for k in both]


def _cap(run: Mapping[str, Any]) -> float:
    """A search's capacity; below the grid counts as 0 (it met no rate)."""
    return float(run.get("capacity_req_s") or 0.0)


def _measured(points: Sequence[Mapping[str, Any]], repeat: int, rule: str = "gaps") -> list[tuple[float, np.ndarray]]:
    """(rate, per-request joint met by `rule`) of one system's points in one repeat, by rate."""
    return sorted(((p["rate"], stats.joint_met(p["requests"], rule)) for p in points if p.get("repeat") == repeat),
                  key=lambda x: x[0])


def reread_capacity(measured: Sequence[tuple[float, np.ndarray]], target: float = 0.9) -> float:
    """The first crossing among the measured rates alone: the highest rate below the first one that
    misses `target` (0 when the lowest misses). Under the rule the search ran by this is its answer
    up to the bisection; under another rule it can only say as much as the rates probed allow."""
    passed = 0.0
    for rate, met in measured:
        if met.mean() < target:
            break
        passed = rate
    return passed


def by_rule(runs: Sequence[Mapping[str, Any]], pairs: Sequence[tuple[str, str]],
            results: Mapping[str, Sequence[Mapping[str, Any]]], target: float = 0.9) -> dict[str, Any]:
    """The run re-read under each rule ("gaps", the server's; "tpot", DistServe's: TTFT and mean
    TPOT within their SLOs, `stats.tpot_met`) from the rates the search measured: capacity per
    repeat and the pairs' ratios (under the search's own rule these are the search's answers, up
    to the bisection)."""
    out: dict[str, Any] = {"systems": {}, "pairs": []}
    for system in dict.fromkeys(r["system"] for r in runs):
        repeats = sorted(r["repeat"] for r in runs if r["system"] == system and not r.get("error"))
        out["systems"][system] = {"repeats": repeats, **{
            rule: [reread_capacity(_measured(results.get(system, []), k, rule), target) for k in repeats]
            for rule in SLO_RULES}}
    for a, b in pairs:
        if a not in out["systems"] or b not in out["systems"]:
            continue
        row: dict[str, Any] = {"a": a, "b": b}
        for rule in SLO_RULES:
            ca, cb = _paired(out["systems"][a], out["systems"][b], rule)
            ok = [(x, y) for x, y in zip(ca, cb) if x > 0]
            diff = stats.ratio("capacity", [x for x, _ in ok], [y for _, y in ok]) if ok else None
            row[rule] = {"ratio": diff.estimate if diff else None, "repeat_ci": diff.repeat_ci if diff else None,
                         "mean_a": float(np.mean(ca)) if ca else None, "mean_b": float(np.mean(cb)) if cb else None}
        out["pairs"].append(row)
    return out


def _boot_capacity(measured: Sequence[tuple[float, np.ndarray]], rng: np.random.Generator,
                   target: float = 0.9) -> np.ndarray:
    """N_BOOT draws of the first crossing over the measured rates: each point's pass share drawn
    from its Jeffreys posterior, Beta(passed + 1/2, missed + 1/2) (a plain resample of 40 passes
    out of 40 would always pass: the posterior keeps the binomial uncertainty of a point that met
    or missed everywhere), then the highest rate below the first failing one (0 when the lowest
    fails; the highest when none fails)."""
    if not measured:
        return np.zeros(N_BOOT)
    rates = np.array([r for r, _ in measured])
    att = np.stack([rng.beta(m.sum() + 0.5, len(m) - m.sum() + 0.5, N_BOOT) for _, m in measured])  # (points, draws)
    fails = att < target
    first_fail = np.where(fails.any(axis=0), fails.argmax(axis=0), len(rates))
    return np.where(first_fail == 0, 0.0, rates[np.maximum(first_fail - 1, 0)])


def _pct(draws: np.ndarray) -> tuple[float, float] | None:
    if len(draws) == 0:
        return None
    lo, hi = np.percentile(draws, [100 * (1 - stats.LEVEL) / 2, 100 * (1 + stats.LEVEL) / 2])
    return float(lo), float(hi)
