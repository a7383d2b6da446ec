"""Scheduler overhead per iteration at GPU-scale request counts: RotaSched's whole hook
(`RotaSchedRuntime.around_prefill`: observe, views, decide, admission order, and stock SGLang's
`get_new_batch_prefill` inside it over the order LVF hands it) beside stock SGLang's
`Scheduler.get_new_batch_prefill` alone, over SGLang's real `Req`s, allocator and radix tree on
a CPU, in a contended steady state (`sched_rig.py`).

    python -m superinfer_sgl.bench.sched_overhead [--counts 1000 4000 16000] [--steps 40]
        [--repeats 3] [--policy goodput] [--arrivals 0] [--metrics] [--out results/sched_overhead/goodput.json]

Each step first applies a decode iteration's changes (one output token per running request, the
clock moving on, `--arrivals` new requests appended to the waiting queue), then times both calls on that state, alternating which goes first. A repeat is a
fresh state; each count reports the median and p90 of every repeat, and the pooled median and p90
with 95% bootstrap intervals. `parts` times the hook's pieces in a separate pass (their own timers
add a little). A shared VM moves these figures by 15-40%: compare numbers from one run.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .rundoc import cpu_info
from .sched_rig import Rig, build

DEFAULT_OUT = Path("results/sched_overhead")
BOOTSTRAP = 2000


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def interval(xs: list[float], q: float, seed: int = 0) -> list[float]:
    """95% percentile-bootstrap interval of the q-quantile of `xs`."""
    rng = random.Random(seed)
    stats = sorted(quantile(rng.choices(xs, k=len(xs)), q) for _ in range(BOOTSTRAP))
    return [round(stats[int(0.025 * BOOTSTRAP)], 4), round(stats[int(0.975 * BOOTSTRAP) - 1], 4)]


def _ms(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - t0) / 1e6


def time_steps(rig: Rig, steps: int, warmup: int, arrivals: int = 0) -> dict[str, list[float]]:
    """Per-step milliseconds of our hook and of stock's get_new_batch_prefill on the same states
    (`arrivals` new requests queued before each step)."""
    out: dict[str, list[float]] = {"ours": [], "stock": []}
    for i in range(warmup + steps):
        rig.decode()
        rig.arrive(arrivals)
        pair = [("ours", rig.ours), ("stock", rig.stock)]
        for name, fn in pair if i % 2 == 0 else pair[::-1]:
            rig.batch.batch_is_full = False  # stock sets it when nothing fits: each call starts alike
            t = _ms(fn)
            if i >= warmup:
                out[name].append(t)
    return out


def time_parts(rig: Rig, steps: int) -> dict[str, float]:
    """Median milliseconds of the hook's pieces: views, the decision (free blocks and plan_step),
    stock's call inside the hook, and the rest (observe, admission order, prefetch choice)."""
    rt = rig.rt
    acc: dict[str, list[float]] = {"views": [], "decide": [], "stock_inside": [], "hook": []}

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                acc[name].append((time.perf_counter_ns() - t0) / 1e6)
        return wrapper

    from sglang.srt.managers.scheduler import Scheduler

    views, decide = rt._views, rt._decide
    rt._views, rt._decide = timed("views", views), timed("decide", decide)  # type: ignore[method-assign]
    inner = timed("stock_inside", Scheduler.get_new_batch_prefill)
    try:
        for _ in range(steps):
            rig.decode()
            acc["hook"].append(_ms(lambda: rt.around_prefill(inner, rig.sched, rig.batch)))
    finally:
        del rt._views, rt._decide  # back to the class's methods
    med = {k: statistics.median(v) for k, v in acc.items()}
    med["rest"] = med["hook"] - med["views"] - med["decide"] - med["stock_inside"]
    return {k: round(v, 4) for k, v in med.items()}


def run_count(n: int, args: argparse.Namespace, model_path: str) -> dict[str, Any]:
    repeats: list[dict[str, Any]] = []
    pooled: dict[str, list[float]] = {"ours": [], "stock": []}
    parts: dict[str, float] = {}
    decision: dict[str, Any] = {}
    counts: dict[str, int] = {}
    for r in range(args.repeats):
        rig = build(n, args.policy, args.max_running, model_path, seed=r, ttft_shedding=args.ttft_shedding,
                    metrics=args.metrics)
        try:
            gc.collect()
            times = time_steps(rig, args.steps, args.warmup, args.arrivals)
            if r == 0:
                parts = time_parts(rig, args.steps)
                d = rig.rt._decision
                decision = {"contention": d.contention, "admit": len(d.admit), "resume": len(d.resume),
                            "rotate_out": len(d.rotate_out), "blocked": d.blocked is not None}
                counts = rig.counts
        finally:
            rig.context.close()
        repeats.append({name: {"median_ms": round(statistics.median(v), 4), "p90_ms": round(quantile(v, 0.9), 4)}
                        for name, v in times.items()})
        for name, v in times.items():
            pooled[name] += v
    summary = {name: {"median_ms": round(statistics.median(v), 4), "median_ci95": interval(v, 0.5),
                      "p90_ms": round(quantile(v, 0.9), 4), "p90_ci95": interval(v, 0.9)}
               for name, v in pooled.items()}
    return {"requests": n, "mix": counts, "steps_per_repeat": args.steps, "repeats": repeats, "pooled": summary,
            "ours_parts_median_ms": parts, "last_decision": decision}


def _machine() -> dict[str, Any]:
    soak = subprocess.run(["pgrep", "-f", "soak"], capture_output=True, text=True).stdout.split()
    return {"node": platform.node(), "processor": platform.processor() or platform.machine(), **cpu_info(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "loadavg": list(os.getloadavg()),
            "soak_running": bool(soak)}


def _code() -> dict[str, Any]:
    """Which code ran: the package's folder, and the commit of the checkout it is in, if any."""
    pkg = Path(__file__).resolve().parents[1]
    out: dict[str, Any] = {"package": str(pkg), "commit": None, "uncommitted_changes": None}
    try:
        git = ["git", "-C", str(pkg.parent)]
        out["commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True,
                                       check=True).stdout.strip()
        diff = subprocess.run([*git, "diff", "--quiet", "HEAD", "--", "superinfer_sgl"], capture_output=True)
        out["uncommitted_changes"] = diff.returncode != 0
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[1000, 4000, 16000])
    ap.add_argument("--steps", type=int, default=40, help="timed steps per repeat")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="fresh states per count")
    ap.add_argument("--policy", choices=["goodput", "paper"], default="goodput")
    ap.add_argument("--max-running", type=int, default=1024, help="running requests at most (the batch)")
    ap.add_argument("--arrivals", type=int, default=0, help="new requests queued before each step")
    ap.add_argument("--ttft-shedding", action=argparse.BooleanOptionalAction, default=True,
                    help="goodput: the server's --ttft-shedding")
    ap.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=False,
                    help="the hook updates the superinfer_ Prometheus series too (a server's --enable-metrics)")
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default results/sched_overhead/POLICY.json)")
    args = ap.parse_args(argv)
    from ..model_prep import prepare_default_model

    model_path = str(prepare_default_model())  # SGLang's config bags need a model's ServerArgs
    started = _machine()
    rows = []
    for n in args.counts:
        row = run_count(n, args, model_path)
        p = row["pooled"]
        print(f"{n:>6} requests  ours median {p['ours']['median_ms']:.3f} ms p90 {p['ours']['p90_ms']:.3f} ms | "
              f"stock median {p['stock']['median_ms']:.3f} ms p90 {p['stock']['p90_ms']:.3f} ms | "
              f"parts {row['ours_parts_median_ms']}", flush=True)
        rows.append(row)
    doc = {"what": "per-iteration scheduler time: RotaSchedRuntime.around_prefill (ours, stock's call inside) "
                   "vs stock SGLang get_new_batch_prefill, real SGLang Reqs on a CPU",
           "policy": args.policy, "max_running": args.max_running, "arrivals_per_step": args.arrivals,
           "ttft_shedding": args.ttft_shedding, "metrics": args.metrics,
           "command": " ".join([os.path.basename(sys.executable), "-m", "superinfer_sgl.bench.sched_overhead",
                                *(argv if argv is not None else sys.argv[1:])]),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "code": _code(), "machine_start": started, "machine_end": _machine(), "rows": rows}
    out = args.out or DEFAULT_OUT / f"{args.policy}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
