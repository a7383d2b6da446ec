"""Sustained overload in the simulator: each policy at a few rates for much longer than a capacity
search's 120 s, so that what builds up over minutes (parked requests filling the host pool, the
starvation bound's promotions) shows: joint attainment, output throughput, the time the run takes
to drain, recomputes (retractions, host-full fallbacks) and the host pool's peak.

    python scripts/sim_sustained.py --jobs 2 --out results/sim_sustained
    python scripts/sim_sustained.py --point gh200-qwen2.5-32b,sharegpt-like,20 --duration 600

Writes sustained.json (one row per policy and point) and table.md into --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from superinfer_sgl.sim import record
from superinfer_sgl.sim.runner import Job, run_jobs

# (profile, workload, rate): 1.2x, 1.5x and 2x stock SGLang's capacity at 5 s / 100 ms on GH200,
# 1.3x and 2x on H100 PCIe (results/sim_capacity, ShareGPT-like: 13.1 and 3.7 req/s)
POINTS = (("gh200-qwen2.5-32b", "sharegpt-like", 16.0), ("gh200-qwen2.5-32b", "sharegpt-like", 20.0),
          ("gh200-qwen2.5-32b", "sharegpt-like", 26.0), ("h100-pcie5-qwen2.5-32b", "sharegpt-like", 5.0),
          ("h100-pcie5-qwen2.5-32b", "sharegpt-like", 7.5))
KEEP = ("both_attainment", "ttft_attainment", "throughput_tok_s", "sim_end_s", "retractions", "host_full_fallbacks",
        "rotations_out", "peak_rotary", "peak_host_tokens")


def point(text: str) -> tuple[str, str, float]:
    """argparse type of --point: PROFILE,WORKLOAD,RATE."""
    try:
        profile, workload, rate = text.split(",")
        return profile, workload, float(rate)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PROFILE,WORKLOAD,RATE, got {text!r}") from None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--point", action="append", type=point, help="repeatable PROFILE,WORKLOAD,RATE; default: "
                    + "; ".join(f"{p},{w},{r:g}" for p, w, r in POINTS))
    ap.add_argument("--policy", action="append", help="repeatable; default: sglang, goodput")
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of arrivals")
    ap.add_argument("--ttft-slo", type=float, default=5.0, help="seconds")
    ap.add_argument("--tbt-slo", type=float, default=0.1, help="seconds")
    ap.add_argument("--seed", type=int, default=909)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results/sim_sustained"))
    a = ap.parse_args()
    points, policies = a.point or list(POINTS), a.policy or ["sglang", "goodput"]
    jobs = [Job(p, pol, w, r, a.duration, a.seed, a.ttft_slo, a.tbt_slo, mixed_chunk=True)
            for p, w, r in points for pol in policies]
    rows = [{"profile": j.profile, "workload": j.workload, "rate": j.rate, "policy": j.policy,
             **{k: out[k] for k in KEEP}} for j, out in zip(jobs, run_jobs(jobs, a.jobs))]
    record.write(a.out, "sustained.json", rows, table(rows), slo_s=[a.ttft_slo, a.tbt_slo])


def table(rows: list[dict]) -> str:
    lines = ["| profile | workload | req/s | policy | joint | output tok/s | drained at (s) | recomputes | peak rotary |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['profile']} | {r['workload']} | {r['rate']:g} | {r['policy']} | {100 * r['both_attainment']:.1f}% "
                     f"| {r['throughput_tok_s']:.0f} | {r['sim_end_s']:.0f} | {r['retractions']} | {r['peak_rotary']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
