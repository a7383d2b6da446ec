"""TTFT shedding at fixed rates in the simulator: the goodput policy with and without
`--ttft-shedding`, joint attainment pooled over several ShareGPT-like seeds or Azure trace windows
per rate, around the capacity table's cells. A capacity is one first crossing of 90%, and on a
curve that wavers around 90% it moves by a grid step between near-equal curves; the curves
themselves say whether one variant meets more SLOs than the other.

    python scripts/sim_shedding.py --jobs 2 --out results/sim_capacity/shedding
    python scripts/sim_shedding.py --cell gh200-qwen2.5-32b,sharegpt-like,5,0.1,18:20:22 --no-ignore-eos

Writes shedding.json (one row per cell, rate and variant: the pooled joint attainment and each
sample's) and table.md into --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from superinfer_sgl.sim import record
from superinfer_sgl.sim.runner import Job, run_jobs

# (profile, workload, TTFT s, TBT s, rates): the capacity table's ShareGPT-like and Azure conv
# cells, rates around ours' capacity there (results/sim_capacity)
CELLS = (("gh200-qwen2.5-32b", "sharegpt-like", 5.0, 0.1, (16.0, 18.0, 20.0, 22.0)),
         ("gh200-qwen2.5-32b", "sharegpt-like", 1.0, 0.05, (16.0, 18.0, 20.0)),
         ("gh200-qwen2.5-32b", "azure:conv", 5.0, 0.1, (4.0, 4.4, 4.8)),
         ("gh200-qwen2.5-32b", "azure:conv", 1.0, 0.05, (3.2, 3.5, 3.8)),
         ("h100-pcie5-qwen2.5-32b", "sharegpt-like", 5.0, 0.1, (6.0, 7.0, 8.0, 9.0)),
         ("h100-pcie5-qwen2.5-32b", "sharegpt-like", 1.0, 0.05, (5.5, 6.0, 6.5, 7.0)),
         ("h100-pcie5-qwen2.5-32b", "azure:conv", 5.0, 0.1, (1.3, 1.4, 1.5)),
         ("h100-pcie5-qwen2.5-32b", "azure:conv", 1.0, 0.05, (1.0, 1.1, 1.2)))
SEEDS = (909, 4242, 4243, 4244)  # ShareGPT-like draws
WINDOWS = (0, 600, 1200, 1800)  # Azure: seconds into the trace (the seed does not move a window)


def cell(text: str) -> tuple[str, str, float, float, tuple[float, ...]]:
    """argparse type of --cell: PROFILE,WORKLOAD,TTFT_S,TBT_S,RATE[:RATE...]."""
    try:
        profile, workload, ttft, tbt, rates = text.split(",")
        return profile, workload, float(ttft), float(tbt), tuple(float(r) for r in rates.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PROFILE,WORKLOAD,TTFT_S,TBT_S,RATE[:RATE...], got {text!r}") from None


def samples(workload: str) -> list[tuple[str, int]]:
    """(workload, seed) of each sample pooled per rate."""
    if workload.startswith("azure:"):
        return [(f"{workload}@{w}" if w else workload, SEEDS[0]) for w in WINDOWS]
    return [(workload, s) for s in SEEDS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cell", action="append", type=cell, help="repeatable PROFILE,WORKLOAD,TTFT_S,TBT_S,RATE[:RATE...]; "
                    "default: the capacity table's ShareGPT-like and Azure conv cells")
    ap.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals")
    ap.add_argument("--no-ignore-eos", action="store_true", help="requests that may stop at EOS (shedding counts prompts only)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results/sim_capacity/shedding"))
    a = ap.parse_args()
    cells = a.cell or list(CELLS)
    keys, jobs = [], []
    for profile, workload, ttft, tbt, rates in cells:
        for rate in rates:
            for shedding in (True, False):
                for wl, seed in samples(workload):
                    keys.append((profile, workload, ttft, tbt, rate, shedding))
                    jobs.append(Job(profile, "goodput", wl, rate, a.duration, seed, ttft, tbt, mixed_chunk=True,
                                    ignore_eos=not a.no_ignore_eos, ttft_shedding=shedding))
    pooled: dict[tuple, list[float]] = {}
    for key, out in zip(keys, run_jobs(jobs, a.jobs)):
        pooled.setdefault(key, []).append(out["both_attainment"])
    rows = [{"profile": k[0], "workload": k[1], "slo_s": [k[2], k[3]], "rate": k[4], "ttft_shedding": k[5],
             "samples": v, "both_attainment": sum(v) / len(v)} for k, v in pooled.items()]
    record.write(a.out, "shedding.json", rows, table(rows), seeds=list(SEEDS), azure_windows_s=list(WINDOWS))


def table(rows: list[dict]) -> str:
    """Joint attainment with shedding / without, and the difference, per cell and rate."""
    lines = ["| profile | workload | SLO | req/s | joint, shedding | joint, without | difference (points) |",
             "|---|---|---|---|---|---|---|"]
    by = {(r["profile"], r["workload"], tuple(r["slo_s"]), r["rate"], r["ttft_shedding"]): r["both_attainment"] for r in rows}
    for (p, w, slo, rate, shed), on in by.items():
        if shed:
            off = by[(p, w, slo, rate, False)]
            lines.append(f"| {p} | {w} | {slo[0]:g} s / {1000 * slo[1]:g} ms | {rate:g} | {100 * on:.1f}% | {100 * off:.1f}% "
                         f"| {100 * (on - off):+.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
