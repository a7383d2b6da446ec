"""Decision time of RotaSched's LVF policy for a queue of N requests.

`lvf_decide` alone, over synthetic views; the server's whole step per iteration (views, decision,
admission order, over SGLang's real requests, beside stock SGLang's) is
`python -m superinfer_sgl.bench.sched_overhead`.

Usage: python scripts/bench_policy.py [--n 1000] [--iters 200] [--policy paper|goodput]
                                    [--out results/bench_policy.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import random
import statistics
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

from superinfer_sgl.rotasched import PAPER, LvfPolicy, ReqState, ReqView, VltParams, lvf_decide
from superinfer_sgl.rotasched.goodput import GoodputParams, StepCosts
from superinfer_sgl.rotasched.planner import POLICIES

# the goodput policy's step costs: a 32B-class model on a GPU (0.1 ms per prefill token, 30 ms decode)
GOODPUT = GoodputParams(StepCosts(1e-4, 0.002, 0.03, 0.001))

NOW = 1000.0


def make_views(n: int, seed: int) -> list[ReqView]:
    """A contended queue: ~40% waiting, ~40% running, ~20% rotary, ages up to 30 s."""
    rng = random.Random(seed)
    views = []
    for i in range(n):
        state = rng.choices(list(ReqState), weights=(4, 4, 2))[0]
        arrival = NOW - rng.uniform(0.0, 30.0)
        running = state is ReqState.RUNNING
        last = None if state is ReqState.WAITING else rng.uniform(arrival, NOW)
        blocks = rng.randint(1, 64)
        started = state is not ReqState.WAITING
        views.append(ReqView(
            rid=f"req-{i}", state=state, arrival=arrival, last_token=last,
            run_start=rng.uniform(arrival, NOW) if running else None,
            ttft_slo=rng.choice((1.0, 5.0, 30.0)), tbt_slo=rng.choice((0.05, 0.1, 0.5)),
            blocks_needed=0 if running else blocks, blocks_held=blocks if running else 0,
            rotatable=rng.random() > 0.05 or not running,
            prefill_tokens=0 if started else rng.randint(16, 4096),
            misses_left=rng.randint(-2, 20), ttft_met=rng.random() > 0.3 if started else None,
        ))
    return views


def bench(views: list[ReqView], free: int, budget: int, iters: int,
          policy: LvfPolicy = PAPER) -> list[float]:
    """Microseconds per lvf_decide call; the clock advances 10 ms per call like a real loop."""
    params = VltParams()
    for i in range(10):  # warm-up
        lvf_decide(views, free, budget, NOW + i * 0.01, params, policy)
    times = []
    for i in range(iters):
        t0 = time.perf_counter_ns()
        lvf_decide(views, free, budget, NOW + i * 0.01, params, policy)
        times.append((time.perf_counter_ns() - t0) / 1000.0)
    return times


def percentile(sorted_xs: list[float], q: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, round(q * (len(sorted_xs) - 1)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=1000, help="queued requests per decision")
    ap.add_argument("--iters", type=int, default=200, help="timed decisions")
    ap.add_argument("--free-blocks", type=int, default=2000, help="free device blocks")
    ap.add_argument("--budget-blocks", type=int, default=2400, help="rotation budget (paper: 2400)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", choices=POLICIES.names(), default="paper")
    ap.add_argument("--out", type=Path, default=REPO_ROOT / "results" / "bench_policy.json")
    args = ap.parse_args()

    views = make_views(args.n, args.seed)
    policy = POLICIES[args.policy].for_step(lambda: GOODPUT)
    d = lvf_decide(views, args.free_blocks, args.budget_blocks, NOW, VltParams(), policy)
    times = sorted(bench(views, args.free_blocks, args.budget_blocks, args.iters, policy))
    result = {
        "policy": args.policy,
        "n": args.n,
        "iters": args.iters,
        "free_blocks": args.free_blocks,
        "budget_blocks": args.budget_blocks,
        "seed": args.seed,
        "p50_us": round(percentile(times, 0.50), 1),
        "p99_us": round(percentile(times, 0.99), 1),
        "mean_us": round(statistics.fmean(times), 1),
        "decision": {"contention": d.contention, "admit": len(d.admit),
                     "resume": len(d.resume), "rotate_out": len(d.rotate_out)},
        "python": platform.python_version(),
        "machine": {"processor": platform.processor() or platform.machine(),
                    "node": platform.node()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(json.dumps(result, indent=2))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
