"""Reports of a sweep: target checks, noise comparison, markdown table, PNG plots.

`results` everywhere is {system: [point, ...]} where a point is the dict the runner stores for one
rate: {"rate", "offered_rate", "summary": {...}, "counters": {...}, ...}.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .metrics import max_rate_meeting

Results = Mapping[str, Sequence[Mapping[str, Any]]]

# (summary key, column title, format)
COLUMNS = (
    ("ttft_attainment", "TTFT att.", "pct"),
    ("tbt_gap_attainment", "TBT att. (gaps)", "pct"),
    ("tbt_request_attainment", "TBT att. (req, all gaps)", "pct"),
    ("joint_attainment", "joint att.", "pct"),
    ("goodput_rps", "goodput req/s", "f2"),
    ("output_throughput_tps", "out tok/s", "f1"),
    ("p50_ttft_ms", "P50 TTFT ms", "f0"),
    ("p99_ttft_ms", "P99 TTFT ms", "f0"),
    ("p50_tbt_ms", "P50 TBT ms", "f0"),
    ("p99_tbt_ms", "P99 TBT ms", "f0"),
    ("p50_e2e_ms", "P50 E2E ms", "f0"),
    ("p99_e2e_ms", "P99 E2E ms", "f0"),
)


def _fmt(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    return f"{value:.{kind[1]}f}"


def _by_rate(points: Sequence[Mapping[str, Any]]) -> dict[float, Mapping[str, Any]]:
    return {p["rate"]: p for p in points}


def markdown_table(results: Results) -> str:
    head = ["rate req/s", "system", *(c[1] for c in COLUMNS), "rotations", "recomputes", "done"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rates = sorted({p["rate"] for pts in results.values() for p in pts})
    for rate in rates:
        for system, pts in results.items():
            p = _by_rate(pts).get(rate)
            if p is None:
                continue
            s, c = p["summary"], p["counters"]
            cells = [f"{rate:g}", system, *(_fmt(s[k], f) for k, _, f in COLUMNS),
                     _count(c.get("rotations")), _count(recomputes(c)), f"{s['completed']}/{s['n']}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def recomputes(counters: Mapping[str, Any]) -> float | None:
    parts = [counters.get("retractions"), counters.get("recompute_fallbacks")]
    known = [p for p in parts if p is not None]
    return sum(known) if known else None


def _count(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def capacity(results: Results, target: float = 0.9) -> dict[str, dict[str, object]]:
    """Per system: the highest rate at which >= target of requests meet both SLOs."""
    return {
        system: max_rate_meeting(((p["rate"], p["summary"]["joint_attainment"]) for p in pts), target)
        for system, pts in results.items()
    }


def check_targets(results: Results, baseline: str, ours: str) -> dict[str, Any]:
    """The issue's cpu-profile targets, evaluated on one run."""
    base, mine = _by_rate(results[baseline]), _by_rate(results[ours])
    common = sorted(set(base) & set(mine))
    star = next((r for r in common if base[r]["summary"]["ttft_attainment"] <= 0.5), None)
    out: dict[str, Any] = {"baseline": baseline, "ours": ours, "rate": star}
    if star is not None:
        b, m = base[star]["summary"], mine[star]["summary"]
        d_ttft = 100 * (m["ttft_attainment"] - b["ttft_attainment"])
        d_tbt = 100 * (m["tbt_gap_attainment"] - b["tbt_gap_attainment"])
        tput = m["output_throughput_tps"] / b["output_throughput_tps"] if b["output_throughput_tps"] else None
        out |= {
            "ttft_gain_points": d_ttft, "ttft_target_met": d_ttft >= 40.0,
            "tbt_delta_points": d_tbt, "tbt_target_met": d_tbt >= -2.0,
            "throughput_ratio": tput, "throughput_target_met": tput is not None and tput >= 0.97,
        }
    cap = capacity({baseline: results[baseline], ours: results[ours]})
    cb, cm = cap[baseline]["interpolated"], cap[ours]["interpolated"]
    ratio = (cm / cb) if (cb and cm is not None) else None
    out |= {"capacity": cap, "capacity_ratio": ratio,
            "capacity_target_met": ratio is not None and ratio >= 1.5}
    return out


def noise_band(results: Results, a: str, b: str) -> dict[str, float]:
    """Largest |a - b| per metric over the rates both ran (stock vs stock: run-to-run noise)."""
    pa, pb = _by_rate(results[a]), _by_rate(results[b])
    band: dict[str, float] = {}
    for rate in sorted(set(pa) & set(pb)):
        for key, _, kind in COLUMNS:
            va, vb = pa[rate]["summary"][key], pb[rate]["summary"][key]
            if va is None or vb is None:
                continue
            diff = abs(va - vb) * (100 if kind == "pct" else 1)
            band[key] = max(band.get(key, 0.0), diff)
    return band


def plot(results: Results, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("ttft_attainment", "TTFT SLO attainment"), ("tbt_gap_attainment", "TBT SLO attainment (gaps)"),
              ("joint_attainment", "joint attainment (TTFT + 90% gaps)"), ("output_throughput_tps", "output tok/s"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6))
    for ax, (key, label) in zip(axes, panels):
        for system, pts in results.items():
            pts = sorted(pts, key=lambda p: p["rate"])
            ys = [p["summary"][key] for p in pts]
            if key != "output_throughput_tps":
                ys = [100 * y for y in ys]
            ax.plot([p["rate"] for p in pts], ys, marker="o", label=system)
        ax.set_xlabel("request rate (req/s)")
        ax.set_title(label, fontsize=10)
        if key != "output_throughput_tps":
            ax.set_ylim(-3, 103)
            ax.set_ylabel("%")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def targets_markdown(t: Mapping[str, Any]) -> str:
    if t.get("rate") is None:
        head = f"- no swept rate where {t['baseline']} TTFT attainment <= 50%: per-rate targets not evaluated\n"
    else:
        head = (
            f"- at {t['rate']:g} req/s ({t['baseline']} TTFT attainment <= 50%):\n"
            f"  - TTFT attainment {t['ttft_gain_points']:+.1f} points (target >= +40): "
            f"{_yes(t['ttft_target_met'])}\n"
            f"  - TBT attainment (gaps) {t['tbt_delta_points']:+.1f} points (target >= -2): "
            f"{_yes(t['tbt_target_met'])}\n"
            f"  - output throughput {100 * (t['throughput_ratio'] or 0):.1f}% of {t['baseline']} "
            f"(target >= 97%): {_yes(t['throughput_target_met'])}\n"
        )
    cap = t["capacity"]
    parts = []
    for system in (t["baseline"], t["ours"]):
        c = cap[system]
        val = "none of the swept rates" if c["interpolated"] is None else f"{c['interpolated']:.2f} req/s"
        parts.append(f"{system} {'>= ' if c['all_met'] else ''}{val}")
    ratio = t["capacity_ratio"]
    tail = (f"- highest rate with >= 90% of requests meeting both SLOs (interpolated): {', '.join(parts)}; "
            f"ratio {'-' if ratio is None else f'{ratio:.2f}x'} (target >= 1.5x): {_yes(t['capacity_target_met'])}\n")
    return head + tail


def _yes(ok: bool) -> str:
    return "met" if ok else "NOT met"
