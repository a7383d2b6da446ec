"""`ab_bench.py --capacity`: SLO capacity on live servers, per system and repeat, with intervals.

Capacity is the simulator's (sim/capacity.py, the one implementation of the search): the highest
request rate at which at least 90% of requests meet both their TTFT and TBT SLOs (joint
attainment, bench/metrics.py), found by a geometric grid scan until `stop_after` rates in a row
miss, then bisection of the *first* crossing to `resolution`. Here `measure(rates)` runs one live
point per rate (run_point: the same load generator, requests, probes and counters as an A/B).

Pairs (`--paired`): the two systems' searches run at the same time, each side pinned to its half
of the cores and started together at every step (a barrier), so a slow phase of a shared machine
lands on both; once one side's search has ended, the other goes on alone. Sides swap cores from
repeat to repeat. Without `--paired`, the searches run one after another (order alternating by
repeat). Arrivals at a rate are the same on both sides (seeded by the repeat's seed and the rate).

Statistics: bench/capacity_stats.py (`summarize`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..sim.capacity import CapacityGrid, find_capacity
from . import abfile, stats
from .capacity_stats import summarize
from .client import ClientError
from .recompute import pooled_tax
from .report import eos_lines
from .paired import core_halves, pairs_for
from .planning import Plan, SweepPoint, for_repeat
from .rundoc import describe, prepare_files
from .runner import Sweep, calibrate, run_point, save
from .servers import ServerError, SystemSpec
from .workloads import search_arrivals

RULE_TEXT = {"gaps": "90% of a request's gaps within it", "tpot": "its mean time per output token within it"}
EXTEND_BELOW = 4  # grid steps scanned below the grid's lowest rate when it fails (down to ~0.26x)


def grid_for(plan: Plan, capacity_rps: float | None) -> CapacityGrid:
    """The search grid: --capacity-grid LO,HI (req/s) if given, else 0.5x..4x the calibrated
    capacity estimate, else the profile's rate range doubled at the top; below LO when LO fails
    (`EXTEND_BELOW` steps: the estimate comes from the whole machine, a paired server has half)."""
    o = plan.options
    if getattr(o, "capacity_grid", None):
        lo, hi = o.capacity_grid
    elif capacity_rps:
        lo, hi = 0.5 * capacity_rps, 4.0 * capacity_rps
    else:
        lo, hi = min(plan.profile.rates), 2.0 * max(plan.profile.rates)
    return CapacityGrid(target=0.9, lo=round(lo, 4), hi=round(hi, 4), growth=o.capacity_growth,
                        resolution=o.capacity_resolution, stop_after=2, extend_below=EXTEND_BELOW)


def point_at(plan: Plan, rate: float, index: int) -> SweepPoint:
    """A Poisson point at `rate` for this repeat's requests (same arrivals for every system at the
    same rate), its schedule written where run_point reads it."""
    arrivals = tuple(search_arrivals(len(plan.requests), rate, plan.seed))
    pt = SweepPoint(round(rate, 6), arrivals, f"{rate:.4g} req/s")
    (plan.out_dir / "schedules" / f"{index:03d}.json").write_text(
        json.dumps({"label": pt.label, "rate": pt.rate, "arrivals_s": list(arrivals)}))
    return pt


class Side:
    """One system's search in one repeat: a measure function for find_capacity over live points."""

    def __init__(self, sweep: Sweep, plan: Plan, spec: SystemSpec, base: int, partner: str | None,
                 cores: frozenset[int] | None, sync: threading.Barrier | None, lock: threading.Lock,
                 bar: Any) -> None:
        self.sweep, self.plan, self.spec, self.partner = sweep, plan, spec, partner
        self.cores, self.sync, self.lock, self.bar = cores, sync, lock, bar
        self.next_index = base
        self.points: list[dict[str, Any]] = []

    def measure(self, rates: Sequence[float]) -> list[float]:
        out = []
        for rate in rates:
            server = self.sweep.servers[self.spec.name]
            if self.cores is not None:
                server.pin(self.cores)
            i, self.next_index = self.next_index, self.next_index + 1
            pt = point_at(self.plan, rate, i)
            sync = self.sync
            if sync is not None and sync.broken:
                sync = None  # the partner's search has ended: go on alone
            try:
                res = run_point(self.plan, self.spec, server, i, pt, self.bar, sync, self.partner)
            except threading.BrokenBarrierError:  # the partner ended while we waited
                res = run_point(self.plan, self.spec, server, i, pt, self.bar, None, self.partner)
            res["search_step"] = len(self.points)
            self.points.append(res)
            with self.lock:
                self.sweep.doc["results"][self.spec.name].append(res)
                save(self.sweep.plan, self.sweep.doc)  # the run's ab.json (self.plan: repeat k's folder)
            self.sweep.bar.update()
            out.append(attainment(res, slo_rule(self.plan)))
        return out


def slo_rule(plan: Plan) -> str:
    """--capacity-slo-rule: "gaps" (the server's rule) or "tpot" (DistServe's, bench/stats.py)."""
    return getattr(plan.options, "capacity_slo_rule", None) or "gaps"


def attainment(point: Mapping[str, Any], rule: str) -> float:
    """A point's joint attainment under `rule` (the summary's own under "gaps")."""
    if rule == "gaps":
        return float(point["summary"]["joint_attainment"])
    return float(stats.joint_met(point["requests"], rule).mean())


def search(side: Side, grid: CapacityGrid) -> dict[str, Any]:
    try:
        cap = find_capacity(side.measure, grid).as_dict()
    except (ClientError, ServerError) as exc:
        cap = {"capacity_req_s": None, "error": str(exc)[-2000:]}
        side.sweep.fail(side.spec, exc)
    finally:
        if side.sync is not None:
            side.sync.abort()  # release a partner waiting at the start of its next point
    return {"system": side.spec.name, "repeat": side.plan.repeat, "seed": side.plan.seed,
            "cores": sorted(side.cores) if side.cores else None, **cap}


def run_searches(sweep: Sweep, plan: Plan, grid: CapacityGrid, k: int,
                 pairs: list[tuple[SystemSpec, SystemSpec]], halves: Any) -> list[dict[str, Any]]:
    """Repeat k: every pair's two searches (paired: at once, each on its half of the cores)."""
    lock, found = threading.Lock(), []
    for p, pair in enumerate(pairs):
        base = 100 * (p * 2 + 1)
        if halves is not None:
            cores = halves if k % 2 == 0 else (halves[1], halves[0])
            sync = threading.Barrier(2, timeout=plan.profile.ready_timeout_s)
            sides = [Side(sweep, plan, pair[j], base + 100 * j, pair[1 - j].name, cores[j], sync, lock,
                          sweep.inners[j]) for j in (0, 1)]
            got: list[Any] = [None, None]
            # daemon: a Ctrl-C or SIGTERM (servers.install_cleanup stops the servers) ends the run
            # without waiting for a search thread's client to notice its server is gone
            threads = [threading.Thread(target=lambda j=j: got.__setitem__(j, search(sides[j], grid)), daemon=True)
                       for j in (0, 1)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            found += [{**g, "pair": [pair[0].name, pair[1].name]} for g in got if g is not None]
        else:
            order = pair if k % 2 == 0 else pair[::-1]
            for j, spec in enumerate(order):
                side = Side(sweep, plan, spec, base + 100 * j, None, None, None, lock, sweep.inner)
                found.append({**search(side, grid), "pair": [pair[0].name, pair[1].name]})
    return found


def execute_capacity(plan: Plan, tokenizer: Any) -> dict[str, Any]:
    """Start the servers, calibrate, search every pair's capacities per repeat, summarize."""
    t_start = time.monotonic()
    (plan.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"config": {}, "results": {s.name: [] for s in plan.systems}, "errors": {},
                           "processes_left": {}, "capacity_runs": []}
    pairs = pairs_for(plan.systems)
    halves = core_halves() if plan.paired else None
    home = {p[j].name: halves[j] for p in reversed(pairs) for j in (0, 1)} if halves else {}
    sweep = Sweep(plan, doc)
    try:
        first = sweep.start(plan.systems[0], home.get(plan.systems[0].name))
        if first is None:
            doc["errors"]["sweep"] = f"stopped: the first system ({plan.systems[0].name}) did not start"
            return _finish(plan, doc, sweep, t_start, None)
        cap_est = None
        if plan.calibrate:
            plan = calibrate(sweep, first, tokenizer, t_start)
            pairs = pairs_for(plan.systems)
            cap_est = doc["calibration"]["capacity_rps"]
        grid = grid_for(plan, cap_est)
        doc["config"] = describe(plan, prepare_files(plan, tokenizer))
        doc["config"] |= {"order": "paired" if plan.paired else "sequential", "repeats": plan.repeats,
                          "pairs": [[a.name, b.name] for a, b in pairs], "mode": "capacity",
                          "slo_rule": slo_rule(plan),
                          "capacity_grid": dataclasses.asdict(grid), "grid_rates": grid.rates(),
                          "core_halves": [sorted(h) for h in halves] if halves else None}
        for spec in plan.systems[1:]:
            sweep.start(spec, home.get(spec.name))
        sweep.bar.reset(total=None)
        for k in range(plan.repeats):
            rplan = for_repeat(plan, k, tokenizer)
            prepare_files(rplan, tokenizer)
            live = [pr for pr in pairs if all(s.name in sweep.servers for s in pr)]
            doc["capacity_runs"] += run_searches(sweep, rplan, grid, k, live, halves)
            save(plan, doc)
    finally:
        sweep.close()
    return _finish(plan, doc, sweep, t_start, pairs)


def _finish(plan: Plan, doc: dict[str, Any], sweep: Sweep, t_start: float,
            pairs: list[tuple[SystemSpec, SystemSpec]] | None) -> dict[str, Any]:
    sweep.close()
    doc["wall_s"] = round(time.monotonic() - t_start, 1)
    doc["capacity"] = summarize(doc["capacity_runs"], [(a.name, b.name) for a, b in pairs or []],
                                {s: pts for s, pts in doc["results"].items()}, rule=slo_rule(plan))
    doc["recompute_tax"] = {name: pooled_tax(pts) for name, pts in doc["results"].items() if pts}
    save(plan, doc)
    if doc["capacity_runs"]:
        plot_capacity(doc, plan.out_dir / "capacity.png")
    (plan.out_dir / "table.md").write_text(render_capacity(doc))
    return doc


def rereport_capacity(out_dir: Path) -> dict[str, Any]:
    """Recompute the summary, table and plot of a finished capacity run from its ab.json."""
    doc = abfile.load(out_dir)
    doc["capacity"] = summarize(doc["capacity_runs"], [tuple(p) for p in doc["config"].get("pairs") or []],
                                doc["results"], rule=doc["config"].get("slo_rule") or "gaps")
    doc["recompute_tax"] = {name: pooled_tax(pts) for name, pts in doc["results"].items() if pts}
    abfile.save_text(out_dir, _compact(doc))
    plot_capacity(doc, out_dir / "capacity.png")
    (out_dir / "table.md").write_text(render_capacity(doc))
    return doc


# What a capacity means in a run: runs pooled by `merge_capacity` must agree on all of it (their SLO
# class table too when requests carry classes).
MERGE_KEYS = ("profile", "workload", "slo_default", "num_requests", "capacity_grid", "pairs", "order", "class_mix")


def _merge_value(config: dict[str, Any], key: str) -> Any:
    """A run's `key` as the merge compares it: a grid recorded before `probes` was (2026-11-29) was
    searched with one probe per bisection round, the live search's only setting then."""
    value = config.get(key)
    return {"probes": 1, **value} if key == "capacity_grid" and isinstance(value, dict) else value


def merge_capacity(out_dir: Path, run_dirs: Sequence[Path]) -> dict[str, Any]:
    """Pool the repeats of finished capacity runs (`--report OUT --merge DIR ...`) into one report
    in out_dir: later runs' repeats are numbered after the earlier ones', so every search keeps
    its own points (those of a search that did not finish, in a run stopped early, are left out);
    the statistics are then recomputed over all repeats (`rereport_capacity`)."""
    docs = [abfile.load(Path(d)) for d in run_dirs]
    first = docs[0]["config"]
    keys = MERGE_KEYS + (("slo_classes",) if first.get("class_mix") else ())
    for d, doc in zip(run_dirs[1:], docs[1:]):
        if doc["config"].get("mode") != "capacity":
            raise ValueError(f"{d}: not a capacity run")
        differ = [k for k in keys if _merge_value(doc["config"], k) != _merge_value(first, k)]
        if (doc["config"].get("slo_rule") or "gaps") != (first.get("slo_rule") or "gaps"):  # (runs before it: gaps)
            differ.append("slo_rule")
        for key, before in (("ignore_eos", True), ("max_new_tokens", None)):  # runs before them: fixed-length
            if doc["config"].get(key, before) != first.get(key, before):
                differ.append(key)
        if differ:
            raise ValueError(f"{d} differs from {run_dirs[0]} in {', '.join(differ)}: not the same capacity")
    merged: dict[str, Any] = {**docs[0], "results": {}, "capacity_runs": [], "errors": {}}
    offset = 0
    for d, doc in zip(run_dirs, docs):
        for run in doc["capacity_runs"]:
            merged["capacity_runs"].append({**run, "repeat": run["repeat"] + offset})
        done = {(run["system"], run["repeat"]) for run in doc["capacity_runs"]}  # a stopped run's last search: left out
        for name, pts in doc["results"].items():
            merged["results"].setdefault(name, []).extend(
                {**p, "repeat": p.get("repeat", 0) + offset} for p in pts if (name, p.get("repeat", 0)) in done)
        merged["errors"] |= {f"{d}: {k}": v for k, v in (doc.get("errors") or {}).items()}
        offset += 1 + max((run["repeat"] for run in doc["capacity_runs"]), default=-1)
    # A pooled report merged again lists the runs it pooled, not itself.
    merged["config"] = {**first, "repeats": offset, "merged_from": [
        m for d, doc in zip(run_dirs, docs) for m in doc["config"].get("merged_from") or [
            {"dir": str(d), "argv": doc["config"].get("argv"), "date_utc": doc["config"].get("date_utc"),
             "git_commit": (doc["config"].get("machine") or {}).get("git_commit")}]]}
    merged["wall_s"] = sum(doc.get("wall_s", 0.0) for doc in docs)
    out_dir.mkdir(parents=True, exist_ok=True)
    abfile.save_text(out_dir, _compact(merged))
    return rereport_capacity(out_dir)


def _compact(doc: dict[str, Any]) -> str:
    """ab.json without indentation, and each point's per-request times (the `*_ms` columns of
    `point["requests"]`) at 0.1 ms, whole numbers without a decimal point: a pooled run holds every
    point's requests, and the file stays small (abfile gzips it past 1 MiB, the tracked-file
    guard). The HTTP client's timings are not finer than that; every other figure keeps its
    precision. `doc` itself is left as it is."""
    def point(p: dict[str, Any]) -> dict[str, Any]:
        columns = p.get("requests")
        if not isinstance(columns, dict):
            return p
        return {**p, "requests": {name: [_tenth(x) for x in col] if name.endswith("_ms") and isinstance(col, list)
                                  else col for name, col in columns.items()}}

    results = {name: [point(p) for p in pts] for name, pts in (doc.get("results") or {}).items()}
    return json.dumps({**doc, "results": results} if "results" in doc else doc, separators=(",", ":"),
                      default=str) + "\n"


def _tenth(x: Any) -> Any:
    if not isinstance(x, float) or not math.isfinite(x):
        return x
    x = round(x, 1)
    return int(x) if x.is_integer() else x


# ---- report --------------------------------------------------------------------------------------
def _ci(ci: Sequence[float] | None, fmt: str = "{:.3f}") -> str:
    return "-" if not ci else f"{fmt.format(ci[0])} .. {fmt.format(ci[1])}"


def render_capacity(doc: Mapping[str, Any]) -> str:
    """table.md of a capacity run, from its ab.json document alone."""
    from .recompute import tax_markdown

    cfg, cap = doc["config"], doc.get("capacity") or {"systems": {}, "pairs": []}
    grid = cfg.get("capacity_grid", {})
    lines = [f"# SLO capacity, live: {cfg.get('profile')} profile, {cfg.get('workload')} workload "
             f"({cfg.get('date_utc')})", "", f"command: `{' '.join(cfg.get('argv', []))}`", "",
             f"capacity = highest rate with >= {100 * grid.get('target', 0.9):.0f}% of requests meeting both SLOs "
             f"(TBT: {RULE_TEXT[cfg.get('slo_rule') or 'gaps']}) "
             f"(first crossing; sim/capacity.py's search: grid {grid.get('lo')}..{grid.get('hi')} req/s x"
             f"{grid.get('growth')}, bisection to {100 * grid.get('resolution', 0):.0f}%); SLO TTFT "
             f"{cfg.get('slo_default', {}).get('ttft_ms', 0):g} ms / TBT {cfg.get('slo_default', {}).get('tbt_ms', 0):g} ms; "
             f"{cfg.get('num_requests')} requests per point; order {cfg.get('order')}; repeats {cfg.get('repeats')}; "
             f"wall {doc.get('wall_s', 0):.0f} s", ""]
    for m in cfg.get("merged_from") or []:
        lines += [f"pooled: `{' '.join(m.get('argv') or [])}` ({m.get('date_utc')}, {m.get('git_commit')})", ""]
    machine = cfg.get("machine") or {}
    if machine:
        lines += ["machine: " + ", ".join(f"{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                                          for k, v in machine.items() if not isinstance(v, dict)), ""]
    cal = doc.get("calibration")
    if cal:
        lines += [f"Calibrated on {cal['probe_server']}: capacity estimate {cal['capacity_rps']:.3f} req/s", ""]
    lines += eos_lines(doc)
    loads = [x for pts in doc["results"].values() for p in pts for x in p.get("loadavg_1m", [])]
    if loads:
        lines += [f"1-minute load average during the points: {min(loads):.1f} .. {max(loads):.1f}", ""]
    lines += ["| system | capacity per repeat (req/s) | mean | 95% repeat (t) | 95% request (posterior draws) "
              "| passing again above the crossing |", "|---|---|---|---|---|---|"]
    for name, s in cap["systems"].items():
        per = ", ".join(f"{c:.3f}" + (f" ({z})" if z else "") for c, z in zip(s["per_repeat"], s["censored"]))
        mean = "-" if s["mean_req_s"] is None else f"{s['mean_req_s']:.3f}"
        above = "; ".join(", ".join(f"{r:.3g}" for r in a) or "-" for a in s.get("passes_above", []))
        lines.append(f"| {name} | {per} | {mean} | {_ci(s['repeat_ci'])} | {_ci(s['request_ci'])} | {above} |")
    lines.append("")
    for p in cap["pairs"]:
        per = ", ".join(f"{r:.2f}" for r in p["per_repeat"])
        est = "-" if p["ratio"] is None else f"{p['ratio']:.2f}x"
        lines.append(f"{p['b']} / {p['a']}: {est} (per repeat {per or '-'}; 95% repeat {_ci(p['repeat_ci'], '{:.2f}')}; "
                     f"95% request {_ci(p['request_ci'], '{:.2f}')})")
    rr = cap.get("by_rule")
    if rr and rr["pairs"]:
        lines += ["", "Re-read under each TBT rule from the rates the search measured (90% of gaps: the server's "
                  "rule; mean TPOT: DistServe's, as SGLang's bench_serving computes TPOT); means in req/s:", ""]
        for p in rr["pairs"]:
            for rule, what in (("gaps", "90% of gaps"), ("tpot", "mean TPOT")):
                x = p[rule]
                est = "-" if x["ratio"] is None else f"{x['ratio']:.2f}x"
                means = "-" if x["mean_a"] is None else f"{x['mean_b']:.3f} / {x['mean_a']:.3f}"
                lines.append(f"- {p['b']} / {p['a']}, {what}: {est} (95% repeat {_ci(x['repeat_ci'], '{:.2f}')}; "
                             f"means {means})")
    rule = cfg.get("slo_rule") or "gaps"
    lines += ["", "Points measured (rate: joint attainment, the search's rule):", ""]
    for name, pts in doc["results"].items():
        for k in sorted({p.get("repeat", 0) for p in pts}):
            seq = ", ".join(f"{p['rate']:.3g}: {100 * attainment(p, rule):.0f}%"
                            for p in sorted((p for p in pts if p.get("repeat", 0) == k), key=lambda p: p["rate"]))
            lines.append(f"- {name}, repeat {k}: {seq}")
    results = {k: v for k, v in doc["results"].items() if v}
    if results:
        lines += ["", tax_markdown(results)]
    if doc.get("errors"):
        lines += ["Errors:", *(f"- {k}: {str(v).splitlines()[0] if v else ''}" for k, v in doc["errors"].items())]
    return "\n".join(lines) + "\n"


def plot_capacity(doc: Mapping[str, Any], path: Path) -> None:
    """Joint attainment of every measured point by rate, per system (one marker per repeat), the
    target line and each system's mean capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    cap = doc.get("capacity", {}).get("systems", {})
    rule = doc["config"].get("slo_rule") or "gaps"
    for n, (name, pts) in enumerate(doc["results"].items()):
        if not pts:
            continue
        color = f"C{n}"
        for k in sorted({p.get("repeat", 0) for p in pts}):
            mine = sorted((p for p in pts if p.get("repeat", 0) == k), key=lambda p: p["rate"])
            ax.plot([p["rate"] for p in mine], [100 * attainment(p, rule) for p in mine],
                    marker="os^v"[k % 4], color=color, alpha=0.8, label=f"{name} r{k}")
        mean = cap.get(name, {}).get("mean_req_s")
        if mean:
            ax.axvline(mean, color=color, linestyle=":", linewidth=1)
    ax.axhline(90, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("joint SLO attainment (%" + ("; TBT: mean TPOT)" if rule == "tpot" else ")"))
    ax.set_title(f"live capacity search ({doc['config'].get('profile')}; dotted: mean capacity)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
