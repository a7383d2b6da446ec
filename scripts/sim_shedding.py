"""One lever of the goodput policy at fixed rates in the simulator: the default beside the policy
without it (`--against shedding`: without `--ttft-shedding`, the default; `--against reserve`:
with SGLang's whole decode reserve, `--running-reserve 1`, or `--reserve S`'s share), joint
attainment and output throughput
pooled over several ShareGPT-like seeds or Azure trace windows per rate, around the capacity
table's cells. A capacity is one first crossing of 90%, and on a curve that wavers around 90% it
moves by a grid step between near-equal curves; the curves themselves say whether one variant
meets more SLOs than the other.

    python scripts/sim_shedding.py --jobs 2 --out results/sim_capacity/shedding
    python scripts/sim_shedding.py --cell gh200-qwen2.5-32b,sharegpt-like,5,0.1,18:20:22 --no-ignore-eos
    python scripts/sim_shedding.py --against reserve --no-ignore-eos --max-new-tokens 1024 --out ...
    python scripts/sim_shedding.py --against reserve --reserve 0.15 --out ...   # the default beside 0.15

Writes shedding.json (one row per cell, rate and variant: the pooled joint attainment, each
sample's, and the pooled output throughput) and table.md into --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dataclasses import replace

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
# The variant beside the default goodput policy (--against): the lever it leaves out.
AGAINST = {"shedding": {"ttft_shedding": False}, "reserve": {"running_reserve": 1.0}}
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
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="with --no-ignore-eos: every request asks for up to this many tokens (sim run --max-new-tokens)")
    ap.add_argument("--against", choices=sorted(AGAINST), default="shedding",
                    help="the lever left out of the variant: shedding (--no-ttft-shedding) or reserve (--running-reserve 1)")
    ap.add_argument("--reserve", type=float, default=1.0,
                    help="with --against reserve: the variant's --running-reserve (default 1: SGLang's whole reserve)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results/sim_capacity/shedding"))
    a = ap.parse_args()
    if a.max_new_tokens is not None and not a.no_ignore_eos:
        ap.error("--max-new-tokens needs --no-ignore-eos: a fixed-length request decodes all it asks for")
    if a.reserve != 1.0 and a.against != "reserve":
        ap.error("--reserve needs --against reserve")
    variant = {"running_reserve": a.reserve} if a.against == "reserve" else AGAINST[a.against]
    label = f"reserve {a.reserve:g}" if a.against == "reserve" and a.reserve != 1.0 else a.against
    cells = a.cell or list(CELLS)
    keys, jobs = [], []
    for profile, workload, ttft, tbt, rates in cells:
        for rate in rates:
            for lever in (True, False):
                for wl, seed in samples(workload):
                    keys.append((profile, workload, ttft, tbt, rate, lever))
                    job = Job(profile, "goodput", wl, rate, a.duration, seed, ttft, tbt, mixed_chunk=True,
                              ignore_eos=not a.no_ignore_eos, max_new_tokens=a.max_new_tokens)
                    jobs.append(job if lever else replace(job, **variant))
    pooled: dict[tuple, list[dict]] = {}
    for key, out in zip(keys, run_jobs(jobs, a.jobs)):
        pooled.setdefault(key, []).append(out)
    rows = [{"profile": k[0], "workload": k[1], "slo_s": [k[2], k[3]], "rate": k[4], "lever": k[5],
             "variant": "goodput" if k[5] else f"without {label}",
             "samples": [o["both_attainment"] for o in v], "both_attainment": sum(o["both_attainment"] for o in v) / len(v),
             "throughput_tok_s": sum(o["throughput_tok_s"] for o in v) / len(v),
             "retractions": sum(o["retractions"] for o in v), "shortage_rotations": sum(o["shortage_rotations"] for o in v)}
            for k, v in pooled.items()]
    record.write(a.out, "shedding.json", rows, table(rows, label), seeds=list(SEEDS), azure_windows_s=list(WINDOWS),
                 against=label)


def table(rows: list[dict], against: str = "shedding") -> str:
    """Joint attainment with the lever / without, the difference, and the output throughput's
    ratio, per cell and rate."""
    lines = [f"| profile | workload | SLO | req/s | joint, goodput | joint, without {against} | difference (points) "
             f"| throughput, goodput / without |",
             "|---|---|---|---|---|---|---|---|"]
    by = {(r["profile"], r["workload"], tuple(r["slo_s"]), r["rate"], r["lever"]): r for r in rows}
    for (p, w, slo, rate, lever), on in by.items():
        if lever:
            off = by[(p, w, slo, rate, False)]
            lines.append(f"| {p} | {w} | {slo[0]:g} s / {1000 * slo[1]:g} ms | {rate:g} | {100 * on['both_attainment']:.1f}% "
                         f"| {100 * off['both_attainment']:.1f}% | {100 * (on['both_attainment'] - off['both_attainment']):+.1f} "
                         f"| {on['throughput_tok_s'] / off['throughput_tok_s']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
