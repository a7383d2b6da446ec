"""The prefix-cache A/B's numbers: per arm and workload, and ours against each stock policy with
paired 95% bootstrap intervals (scipy) over the same requests (with `prefix_ab --paired`: over the
requests of the runs made side by side, `beside`) and, as the CPU A/Bs report it, a t interval
over the per-repeat differences (the spread between runs, which the requests' bootstrap leaves out).

hit share      cached prompt tokens / prompt tokens (SGLang's meta_info cached_tokens)
TTFT att.      share of requests whose first token came within the TTFT SLO (a failed request misses)
joint att.     TTFT within its SLO and the mean gap between output tokens within the TBT SLO
throughput     output tokens per second of the run's wall time
peak KV        the highest `sglang:token_usage` sampled from /metrics during the run
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import numpy as np
from scipy import stats

from .stats import mean_interval

# our arms (ours-radix: our launcher with SGLang's radix cache, a reference; goodput-*: our default
# scheduler told the run's SLOs); every other arm is stock
OURS = ("predictive", "predictive+host", "ours-radix", "goodput-radix", "goodput+predictive+host")
CONTROL = "unique"
SLO_MULTIPLES = (1.0, 2.0, 4.0)  # SLOs as multiples of the control's median TTFT / TBT (2: headline)


def control_slos(runs: Sequence[dict[str, Any]], multiple: float = 2.0) -> tuple[float, float]:
    """(TTFT, TBT) SLOs in ms, fixed before any comparison: `multiple` times the median TTFT and
    mean output-token gap of the no-reuse control, pooled over every arm (no arm's reuse in it)."""
    recs = [r for run in runs if run["kind"] == CONTROL for r in run["records"] if r["ok"] and r["ttft_s"]]
    if not recs:
        raise ValueError("no control (unique) runs to derive SLOs from: pass --ttft-slo-ms and --tbt-slo-ms")
    ttft = float(np.median([r["ttft_s"] for r in recs]))
    tbt = float(np.median([(r["e2e_s"] - r["ttft_s"]) / max(1, r["output_tokens"] - 1) for r in recs]))
    return multiple * ttft * 1000.0, multiple * tbt * 1000.0


def _key(r: dict[str, Any], rep: int) -> tuple[int, int, int]:
    return (rep, r["idx"], r["turn"])


def _indicators(r: dict[str, Any], ttft_s: float, tbt_s: float) -> tuple[float, float]:
    if not r["ok"] or r["ttft_s"] is None:
        return 0.0, 0.0
    ttft_ok = r["ttft_s"] <= ttft_s
    n = r["output_tokens"]
    tbt = (r["e2e_s"] - r["ttft_s"]) / (n - 1) if n > 1 else 0.0
    return float(ttft_ok), float(ttft_ok and tbt <= tbt_s)


def _row(runs: Sequence[dict[str, Any]], ttft_s: float, tbt_s: float) -> dict[str, Any]:
    recs = [r for run in runs for r in run["records"]]
    ind = np.array([_indicators(r, ttft_s, tbt_s) for r in recs]) if recs else np.zeros((0, 2))
    prompt = sum(r["prompt_tokens"] for r in recs)
    ttfts = np.array([r["ttft_s"] for r in recs if r["ok"] and r["ttft_s"] is not None])
    out_tok = sum(r["output_tokens"] for r in recs)
    wall = sum(run["wall_s"] for run in runs)
    return {
        "requests": len(recs), "failed": sum(not r["ok"] for r in recs),
        "hit_share": sum(r["cached_tokens"] for r in recs) / prompt if prompt else float("nan"),
        "ttft_attainment": float(ind[:, 0].mean()) if len(ind) else float("nan"),
        "joint_attainment": float(ind[:, 1].mean()) if len(ind) else float("nan"),
        "ttft_p50_s": float(np.percentile(ttfts, 50)) if len(ttfts) else float("nan"),
        "ttft_p90_s": float(np.percentile(ttfts, 90)) if len(ttfts) else float("nan"),
        "throughput_tok_s": out_tok / wall if wall else float("nan"),
        "peak_token_usage": max((run["peak_token_usage"] for run in runs), default=float("nan")),
        "per_repeat": {_repeat_key(run): {
            "hit_share": (sum(r["cached_tokens"] for r in run["records"])
                          / max(1, sum(r["prompt_tokens"] for r in run["records"]))),
            "ttft_attainment": float(np.mean([_indicators(r, ttft_s, tbt_s)[0] for r in run["records"]]
                                             or [np.nan]))} for run in runs},
    }


def _repeat_key(run: dict[str, Any]) -> str:
    """A run's repeat, and with --paired the arm it ran beside (each arm runs once per pair)."""
    other = run.get("beside", run.get("pair"))  # (files before `beside`: one of our arms, `pair` the stock one)
    return f"{run['rep']} beside {other}" if other not in (None, run["arm"]) else str(run["rep"])


def beside(runs: Sequence[dict[str, Any]], other: str) -> list[dict[str, Any]]:
    """The runs to compare with arm `other`: with --paired those made beside it (same moments, same
    machine phase), else all of them. Files written before runs carried `beside` had one of our
    arms, so every stock run was beside it, and `pair` names the stock arm of ours' runs."""
    if not any("pair" in run for run in runs):
        return list(runs)
    return [run for run in runs if run.get("beside", run["pair"] if run["pair"] != run["arm"] else other) == other]


def _ci(values: tuple[np.ndarray, ...], statistic: Any) -> tuple[float, float] | None:
    if len(values[0]) < 3:
        return None
    res = stats.bootstrap(values, statistic, paired=True, vectorized=True, n_resamples=2000,
                          confidence_level=0.95, method="percentile", rng=np.random.default_rng(0))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _paired(a_runs: Sequence[dict[str, Any]], b_runs: Sequence[dict[str, Any]], ttft_s: float,
            tbt_s: float) -> dict[str, Any]:
    """B - A over the requests both served (same repeat, request and turn)."""
    a = {_key(r, run["rep"]): r for run in a_runs for r in run["records"]}
    b = {_key(r, run["rep"]): r for run in b_runs for r in run["records"]}
    for side, runs in ((a, a_runs), (b, b_runs)):
        if len(side) != sum(len(run["records"]) for run in runs):  # two runs of one request: no pairing
            raise ValueError("a request appears in two runs of one side; pair the runs first (`beside`)")
    keys = sorted(a.keys() & b.keys())
    if not keys:
        return {"pairs": 0}
    ia = np.array([_indicators(a[k], ttft_s, tbt_s) for k in keys])
    ib = np.array([_indicators(b[k], ttft_s, tbt_s) for k in keys])
    ca = np.array([a[k]["cached_tokens"] for k in keys], float)
    pa = np.array([a[k]["prompt_tokens"] for k in keys], float)
    cb = np.array([b[k]["cached_tokens"] for k in keys], float)
    pb = np.array([b[k]["prompt_tokens"] for k in keys], float)

    def share_diff(ca, pa, cb, pb, axis=-1):  # noqa: ANN001, ANN202
        return cb.sum(axis) / pb.sum(axis) - ca.sum(axis) / pa.sum(axis)

    def mean_diff(x, y, axis=-1):  # noqa: ANN001, ANN202
        return y.mean(axis) - x.mean(axis)

    reps = np.array([k[0] for k in keys])
    out: dict[str, Any] = {"pairs": len(keys), "repeats": len(set(reps.tolist())),
                           "hit_share": float(share_diff(ca, pa, cb, pb)),
                           "hit_share_ci": _ci((ca, pa, cb, pb), share_diff)}
    for j, name in enumerate(("ttft_attainment", "joint_attainment")):
        out[name] = float(ib[:, j].mean() - ia[:, j].mean())
        out[name + "_ci"] = _ci((ia[:, j], ib[:, j]), mean_diff)
        # the runs' own spread (a pair's machine phase, its cores), which the request bootstrap
        # does not see: one difference per repeat, a t interval over them
        per = [float(ib[reps == r, j].mean() - ia[reps == r, j].mean()) for r in sorted(set(reps.tolist()))]
        out[name + "_per_repeat"] = per
        out[name + "_repeat_ci"] = mean_interval(per)
    return out


def summarize(runs: Sequence[dict[str, Any]], ttft_slo_ms: float | None, tbt_slo_ms: float | None) -> dict[str, Any]:
    """The table and the paired differences at the given SLOs (None: control_slos at 2x), plus
    every arm's TTFT and joint attainment at each of SLO_MULTIPLES of the control."""
    derived = ttft_slo_ms is None or tbt_slo_ms is None
    if derived:
        ttft_slo_ms, tbt_slo_ms = control_slos(runs)
    ttft_s, tbt_s = ttft_slo_ms / 1000.0, tbt_slo_ms / 1000.0
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for run in runs:
        groups[(run["kind"], run["arm"])].append(run)
    table = [{"workload": k, "arm": a, **_row(g, ttft_s, tbt_s)} for (k, a), g in sorted(groups.items())]
    diffs = []
    for kind in sorted({k for k, _ in groups}):
        for ours in (o for o in OURS if (kind, o) in groups):
            for arm in sorted(a for k, a in groups if k == kind and a not in OURS):
                diffs.append({"workload": kind, "ours": ours, "baseline": arm,
                              **_paired(beside(groups[(kind, arm)], ours), beside(groups[(kind, ours)], arm),
                                        ttft_s, tbt_s)})
    sweep = []
    if any(run["kind"] == CONTROL for run in runs):
        for m in SLO_MULTIPLES:
            t_ms, b_ms = control_slos(runs, m)
            for (k, a), g in sorted(groups.items()):
                row = _row(g, t_ms / 1000.0, b_ms / 1000.0)
                sweep.append({"multiple": m, "workload": k, "arm": a, "ttft_attainment": row["ttft_attainment"],
                              "joint_attainment": row["joint_attainment"]})
    return {"ttft_slo_ms": ttft_slo_ms, "tbt_slo_ms": tbt_slo_ms, "slos_from_control": derived,
            "paired": any("pair" in run for run in runs),
            "table": table, "ours_minus_stock": diffs, "slo_sweep": sweep}


def plot(summary: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["table"]
    kinds = sorted({r["workload"] for r in rows})
    arms = sorted({r["arm"] for r in rows}, key=lambda a: (a not in OURS, a))
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    width = 0.8 / len(arms)
    for ax, metric, title in ((axes[0], "hit_share", "prefix-hit share"),
                              (axes[1], "ttft_attainment", "TTFT attainment")):
        for i, arm in enumerate(arms):
            vals = [next((r[metric] for r in rows if r["workload"] == k and r["arm"] == arm), np.nan)
                    for k in kinds]
            ax.bar(np.arange(len(kinds)) + i * width, vals, width, label=arm)
        ax.set_xticks(np.arange(len(kinds)) + 0.4 - width / 2, kinds)
        ax.set_ylim(0, 1)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _ci_text(ci: Any, scale: float = 100.0) -> str:
    return f"{ci[0] * scale:+.1f}..{ci[1] * scale:+.1f}" if ci else "n/a"


def markdown(summary: dict[str, Any]) -> str:
    """The summary's two tables (per arm; ours minus each stock policy) in Markdown."""
    lines = ["| workload | arm | requests (failed) | hit share | TTFT att. | joint att. | TTFT p50 / p90 s "
             "| output tok/s | peak token usage |", "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["table"]:
        lines.append(f"| {r['workload']} | {r['arm']} | {r['requests']} ({r['failed']}) | {r['hit_share']:.3f} "
                     f"| {r['ttft_attainment']:.3f} | {r['joint_attainment']:.3f} "
                     f"| {r['ttft_p50_s']:.1f} / {r['ttft_p90_s']:.1f} | {r['throughput_tok_s']:.2f} "
                     f"| {r['peak_token_usage']:.2f} |")
    lines += ["", "| workload | ours - stock | pairs | hit share, points (95% CI) | TTFT att., points (95% CI) "
              "[repeat] | joint att., points (95% CI) [repeat] |", "|---|---|---|---|---|---|"]
    for d in summary["ours_minus_stock"]:
        if not d.get("pairs"):
            continue
        lines.append(f"| {d['workload']} | {d['ours']} - {d['baseline']} | {d['pairs']} | {d['hit_share'] * 100:+.1f} "
                     f"({_ci_text(d['hit_share_ci'])}) | {d['ttft_attainment'] * 100:+.1f} "
                     f"({_ci_text(d['ttft_attainment_ci'])}) [{_ci_text(d.get('ttft_attainment_repeat_ci'))}] "
                     f"| {d['joint_attainment'] * 100:+.1f} ({_ci_text(d['joint_attainment_ci'])}) "
                     f"[{_ci_text(d.get('joint_attainment_repeat_ci'))}] |")
    return "\n".join(lines)
