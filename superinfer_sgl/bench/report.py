"""Reports of a sweep: target checks, noise comparison, markdown table, PNG plots.

`results` everywhere is {system: [point, ...]} where a point is the dict the runner stores for one
rate: {"rate", "offered_rate", "summary": {...}, "counters": {...}, ...}.
"""

from __future__ import annotations

import statistics
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
    head = ["rate req/s", "system", *(c[1] for c in COLUMNS), "rotations", "recomputes",
            "copy s out / in", "overlap s", "ms per rotation out / in", "done"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    rates = sorted({p["rate"] for pts in results.values() for p in pts})
    for rate in rates:
        for system, pts in results.items():
            p = _by_rate(pts).get(rate)
            if p is None:
                continue
            s, c = p["summary"], p["counters"]
            cells = [f"{rate:g}", system, *(_fmt(s[k], f) for k, _, f in COLUMNS),
                     _count(c.get("rotations")), _count(recomputes(c)), *copy_cells(c), f"{s['completed']}/{s['n']}"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def copy_cells(c: Mapping[str, Any]) -> list[str]:
    """Copy seconds per direction, their overlap, and the measured cost of one rotation: copy time
    out per request rotated out, copy time in per request resumed ("-" where not exported)."""
    out_s, in_s = c.get("copy_out_s"), c.get("copy_in_s")
    if out_s is None or in_s is None:
        return ["-", "-", "-"]
    per_out = f"{1000 * out_s / c['rotations']:.2f}" if c.get("rotations") else "-"
    per_in = f"{1000 * in_s / c['resumes']:.2f}" if c.get("resumes") else "-"
    return [f"{out_s:.3f} / {in_s:.3f}", f"{c.get('copy_overlap_s') or 0.0:.3f}", f"{per_out} / {per_in}"]


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
    if common:  # the GPU goal: at the highest (overloaded) rate, joint attainment and throughput
        b, m = base[common[-1]]["summary"], mine[common[-1]]["summary"]
        tput = m["output_throughput_tps"] / b["output_throughput_tps"] if b["output_throughput_tps"] else None
        gain = 100 * (m["joint_attainment"] - b["joint_attainment"])
        out["overloaded"] = {"rate": common[-1], "joint_gain_points": gain, "joint_target_met": gain >= 20.0,
                             "throughput_ratio": tput, "throughput_target_met": tput is not None and tput >= 0.97}
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
    over = t.get("overloaded")
    if over:
        tail += (f"- at the highest rate, {over['rate']:g} req/s: joint attainment {over['joint_gain_points']:+.1f} "
                 f"points (target >= +20): {_yes(over['joint_target_met'])}; output throughput "
                 f"{100 * (over['throughput_ratio'] or 0):.1f}% of {t['baseline']} (target >= 97%): "
                 f"{_yes(over['throughput_target_met'])}\n")
    return head + tail


def _yes(ok: bool) -> str:
    return "met" if ok else "NOT met"


# ---- several runs per rate (repeats, paired mode): pooled figures and differences with CIs ------
def _runs(results: Results, system: str, partner: str, rate: float) -> dict[int, Mapping[str, Any]]:
    """A system's runs at a rate by repeat; in paired mode only those run beside `partner`."""
    return {p.get("repeat", 0): p for p in results.get(system, ())
            if p["rate"] == rate and p.get("paired_with") in (None, partner)}


def comparisons(results: Results, pairs: Sequence[tuple[str, str]]) -> list[dict[str, Any]]:
    """Per pair (A, B) and rate: B - A over the matched runs (same repeat), with intervals."""
    from .stats import compare_runs

    out = []
    for a, b in pairs:
        rates = sorted({p["rate"] for p in results.get(a, ())} & {p["rate"] for p in results.get(b, ())})
        for rate in rates:
            ra, rb = _runs(results, a, b, rate), _runs(results, b, a, rate)
            common = sorted(set(ra) & set(rb))
            if not common:
                continue
            diffs = compare_runs([ra[k] for k in common], [rb[k] for k in common])
            out.append({"a": a, "b": b, "rate": rate, "repeats": common,
                        "n_per_system": sum(len(ra[k]["requests"]["success"]) for k in common),
                        "diffs": {k: d.to_dict() for k, d in diffs.items()}})
    return out


def pooled_results(results: Results) -> dict[str, list[dict[str, Any]]]:
    """{system: [{"rate", "summary": pooled over all its runs at that rate}]} (plots, tables)."""
    from .stats import pooled

    out: dict[str, list[dict[str, Any]]] = {}
    for system, pts in results.items():
        for rate in sorted({p["rate"] for p in pts}):
            out.setdefault(system, []).append({"rate": rate, "summary": pooled([p for p in pts if p["rate"] == rate])})
    return out


def _ci(ci: Sequence[float] | None, scale: str) -> str:
    if ci is None:
        return "-"
    return f"[{ci[0]:+.1f}, {ci[1]:+.1f}]" if scale == "pts" else f"[{ci[0]:.3f}, {ci[1]:.3f}]"


def comparisons_markdown(comps: Sequence[Mapping[str, Any]]) -> str:
    """One table per pair: every difference B - A with both intervals, then the verdict line."""
    lines: list[str] = []
    for a, b in dict.fromkeys((c["a"], c["b"]) for c in comps):
        rows = [c for c in comps if (c["a"], c["b"]) == (a, b)]
        classes = sorted({k for c in rows for k in c["diffs"] if k.startswith("joint_attainment[")})
        head = ["rate req/s", "repeats", "n", "joint Δ pts", "request CI", "repeat CI", "TTFT Δ pts (CI)",
                "TBT gaps Δ pts (CI)", "out tok/s B/A (CI)", "median TTFT B/A (CI)", "median TPOT B/A (CI)",
                *(f"{k[17:-1]} joint Δ (CI)" for k in classes)]
        lines += [f"**{b} - {a}** (95% intervals: request = paired bootstrap over requests of all repeats, "
                  "repeat = t interval over per-repeat differences)", "",
                  "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for c in rows:
            d = c["diffs"]
            j = d["joint_attainment"]
            cells = [f"{c['rate']:g}", str(len(c["repeats"])), str(c["n_per_system"]), f"{j['estimate']:+.1f}",
                     _ci(j["request_ci"], "pts"), _ci(j["repeat_ci"], "pts"),
                     f"{d['ttft_attainment']['estimate']:+.1f} {_ci(d['ttft_attainment']['request_ci'], 'pts')}",
                     f"{d['tbt_gap_attainment']['estimate']:+.1f} {_ci(d['tbt_gap_attainment']['request_ci'], 'pts')}",
                     f"{d['output_throughput']['estimate']:.3f} {_ci(d['output_throughput']['repeat_ci'], 'x')}",
                     *(_ratio_cell(d.get(k)) for k in ("ttft_p50", "tpot_p50")),
                     *(f"{d[k]['estimate']:+.1f} {_ci(d[k]['request_ci'], 'pts')}" for k in classes)]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", verdict_line(rows), "", parity_line(rows), ""]
    return "\n".join(lines) + "\n"


def _ratio_cell(d: Mapping[str, Any] | None) -> str:
    """B / A with the request-level (bootstrap) interval, else the repeat one."""
    if d is None or d["estimate"] != d["estimate"]:  # absent, or NaN: no matched values
        return "-"
    return f"{d['estimate']:.3f} {_ci(d['request_ci'] or d['repeat_ci'], 'x')}"


PARITY_TOLERANCE = 0.02  # issue 35 item 4: no more than 2% worse than stock where nothing is overloaded
# (key, label, +1: higher is worse (a time), -1: lower is worse (throughput))
PARITY_METRICS = (("ttft_p50", "median TTFT", 1), ("tpot_p50", "median TPOT", 1),
                  ("output_throughput", "throughput", -1))


def parity_line(rows: Sequence[Mapping[str, Any]], tol: float = PARITY_TOLERANCE) -> str:
    """Per rate, B's median TTFT, median TPOT and throughput against A's (pooled ratios): "ok"
    when B is at most `tol` worse, "better" when it is more than `tol` better, "TAX" otherwise.
    Meaningful where neither system is overloaded; the table's intervals say how sure."""
    a, b = rows[0]["a"], rows[0]["b"]
    parts = []
    for c in rows:
        cells = []
        for key, label, worse in PARITY_METRICS:
            d = c["diffs"].get(key)
            if d is None or d["estimate"] != d["estimate"]:
                continue
            change = worse * (d["estimate"] - 1)  # > 0: B is worse
            word = "TAX" if change > tol else ("better" if change < -tol else "ok")
            cells.append(f"{label} {100 * (d['estimate'] - 1):+.1f}% ({word})")
        parts.append(f"{c['rate']:g} req/s: " + ", ".join(cells))
    return (f"Parity ({b} / {a}, pooled; ok = at most {100 * tol:g}% worse; meaningful below capacity): "
            + "; ".join(parts) + ".")


def verdict_line(rows: Sequence[Mapping[str, Any]]) -> str:
    """Rates where every interval excludes zero, then those where only the request-level one does
    (a difference that held pooled over requests but whose size moved from repeat to repeat)."""
    a, b = rows[0]["a"], rows[0]["b"]
    joint = [(c["rate"], c["diffs"]["joint_attainment"]) for c in rows]

    def side(d: Mapping[str, Any], sign: int) -> bool:
        return sign * d["estimate"] > 0

    def req_only(d: Mapping[str, Any]) -> bool:
        ci = d["request_ci"]
        return not d["excludes_null"] and ci is not None and (ci[0] > 0 or ci[1] < 0)

    fmt = lambda rs: ", ".join(f"{r:g} req/s" for r in rs) or "no rate"  # noqa: E731
    up = [r for r, d in joint if d["excludes_null"] and side(d, 1)]
    down = [r for r, d in joint if d["excludes_null"] and side(d, -1)]
    up_req = [r for r, d in joint if req_only(d) and side(d, 1)]
    down_req = [r for r, d in joint if req_only(d) and side(d, -1)]
    line = (f"Verdict ({b} - {a}, joint attainment): every interval excludes zero: {b} ahead at {fmt(up)}, "
            f"behind at {fmt(down)}. Request-level interval only (the repeat interval still spans zero): "
            f"ahead at {fmt(up_req)}, behind at {fmt(down_req)}. Not distinguishable at the other rates.")
    if all(d["repeat_ci"] is None for _, d in joint):
        line += " (No repeat interval: one repeat, or repeats that agreed exactly; the verdict rests on requests alone.)"
    return line


def pooled_markdown(results: Results) -> str:
    pooled = pooled_results(results)
    classes = sorted({c for pts in pooled.values() for p in pts for c in p["summary"]["joint_by_class"]})
    head = ["rate req/s", "system", "runs", "n", "joint att.", "TTFT att.", "TBT att. (gaps)", "out tok/s",
            "P99 TTFT ms", *(f"{c} joint" for c in classes), "done"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rate in sorted({p["rate"] for pts in pooled.values() for p in pts}):
        for system, pts in pooled.items():
            for p in pts:
                if p["rate"] != rate:
                    continue
                s = p["summary"]
                cells = [f"{rate:g}", system, str(s["runs"]), str(s["n"]), _fmt(s["joint_attainment"], "pct"),
                         _fmt(s["ttft_attainment"], "pct"), _fmt(s["tbt_gap_attainment"], "pct"),
                         _fmt(s["output_throughput_tps"], "f1"), _fmt(s["p99_ttft_ms"], "f0"),
                         *(_fmt(s["joint_by_class"].get(c), "pct") for c in classes), f"{s['completed']}/{s['n']}"]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def eos_lines(doc: Mapping[str, Any]) -> list[str]:
    """For requests that may stop at EOS: the output lengths the model chose, per system (every
    completed request of every point), against the bounds the server saw."""
    cfg = doc["config"]
    if cfg.get("ignore_eos", True):
        return []
    bounds = [int(r["output_tokens"]) for r in cfg.get("requests", [])]
    parts = []
    for name, pts in doc["results"].items():
        outs = [n for p in pts for n, ok in zip(p["requests"]["output_len"], p["requests"]["success"]) if ok and n]
        if outs:
            parts.append(f"{name} mean {sum(outs) / len(outs):.1f} tokens (median {statistics.median(outs):g}, "
                         f"{len(outs)} requests)")
    bound = f"{cfg['max_new_tokens']} tokens" if cfg.get("max_new_tokens") else (
        f"each request's drawn length, mean {sum(bounds) / len(bounds):.1f}" if bounds else "each request's drawn length")
    return [f"Requests may stop at EOS (the server sees only the bound: {bound}); output lengths measured: "
            + ("; ".join(parts) or "none yet"), ""]


def render_markdown(doc: Mapping[str, Any]) -> str:
    """table.md of a sweep, from its ab.json document alone."""
    cfg = doc["config"]
    results = {k: v for k, v in doc["results"].items() if v}
    lines = [f"# A/B: {cfg['profile']} profile, {cfg['workload']} workload ({cfg['date_utc']})", "",
             f"command: `{' '.join(cfg['argv'])}`", "",
             f"SLO default TTFT {cfg['slo_default']['ttft_ms']:g} ms / TBT {cfg['slo_default']['tbt_ms']:g} ms; "
             f"KV budget {cfg['kv_tokens']} tokens; chunked prefill {cfg['chunked_prefill']}; "
             f"{cfg['num_requests']} requests per point; order {cfg.get('order')}; wall {doc.get('wall_s', 0):.0f} s", ""]
    if any(r.get("slo_class") for r in cfg["requests"]):
        used = sorted({r["slo_class"] for r in cfg["requests"] if r.get("slo_class")})
        lines += ["SLO classes: " + "; ".join(f"{c} TTFT {cfg['slo_classes'][c]['ttft_ms']:g} ms / TBT "
                                              f"{cfg['slo_classes'][c]['tbt_ms']:g} ms" for c in used), ""]
    cal = doc.get("calibration")
    if cal:
        steps = ", ".join(f"batch {b}: {ms:.0f} ms" for b, ms in cal["speed"]["steps_ms"])
        lines += [f"Calibrated on {cal['probe_server']}: decode step {steps}; prefill "
                  f"{cal['speed']['prefill_ms_per_token']:.1f} ms/prompt token; memory-bound batch {cal['batch']:.1f} "
                  f"-> step {cal['step_ms']:.0f} ms; capacity estimate {cal['capacity_rps']:.3f} req/s", ""]
    lines += eos_lines(doc)
    loads = [l for pts in results.values() for p in pts for l in p.get("loadavg_1m", [])]
    if loads:
        lines += [f"1-minute load average during the runs (2 cores): {min(loads):.1f} .. {max(loads):.1f}", ""]
    if results and "comparisons" in doc:
        seed, k = cfg["seed"], cfg.get("repeats", 1)
        lines += [f"Pooled over repeats (seeds {seed}..{seed + k - 1}); "
                  f"order {cfg.get('order')}; pairs {cfg.get('pairs')}", "", pooled_markdown(results),
                  comparisons_markdown(doc.get("comparisons", []))]
    elif results:
        lines += [markdown_table(results)]
    if any(p.get("recompute") for pts in results.values() for p in pts):
        from .recompute import tax_markdown

        lines += [tax_markdown(results)]
    if doc.get("kv_pool_tokens"):
        lines += ["KV pool per server (tokens; read from " + ", ".join(sorted(set(
            doc.get("kv_pool_source", {}).values()))) + "): " + ", ".join(
            f"{name} {n if n is not None else 'unknown'}" for name, n in doc["kv_pool_tokens"].items()), ""]
    by_system = doc.get("targets_by_system") or ({"": doc["targets"]} if "targets" in doc else {})
    for name, targets in by_system.items():
        lines += [f"Targets{f' ({name})' if name else ''}:", targets_markdown(targets)]
    if "noise_band" in doc:
        lines += ["Noise (largest |A-B| over rates; attainment in points):",
                  ", ".join(f"{k} {v:.2f}" for k, v in doc["noise_band"].items()), ""]
    if doc["errors"]:
        lines += ["Errors:", *(f"- {k}: {v.splitlines()[0] if v else ''}" for k, v in doc["errors"].items()), ""]
    return "\n".join(lines) + "\n"
