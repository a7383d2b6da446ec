"""SLO capacity (90% joint attainment) per policy across both GPU profiles, three workloads and two
SLO pairs, in the simulator; the capacity ratio of each policy to stock SGLang's.

Workloads: ShareGPT-like lengths and both Azure LLM inference traces 2023 (Azure Public Dataset,
CC-BY 4.0; Patel et al., Splitwise, ISCA 2024), re-timed to each rate. SGLang's mixed chunk is on
for every policy, as in the goodput sweep, unless a policy is named POLICY:no-mix (stock SGLang's
own default is off: `--policy sglang --policy sglang:no-mix` gives stock both ways, and the table
then compares every policy with stock's better one). Requests are fixed-length (ignore_eos, as the paper's
benchmarks run) unless --no-ignore-eos (optionally with a --max-new-tokens bound above their
lengths). Writes capacity.json and table.md into --out.

    .venv/bin/python scripts/sim_capacity_table.py --jobs 2 --out results/sim_capacity
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from pathlib import Path

from superinfer_sgl.sim import plan, record
from superinfer_sgl.sim.capacity import SLO_RULE_HELP, SLO_RULES, CapacityGrid, policy_capacity
from superinfer_sgl.sim.runner import Job

PROFILES = ("gh200-qwen2.5-32b", "h100-pcie5-qwen2.5-32b")
WORKLOADS = ("sharegpt-like", "azure:conv", "azure:code")
SLOS = ((5.0, 0.1), (1.0, 0.05))  # (TTFT s, TBT s): the paper's pair and a tight one
STOCK_WAYS = ("sglang", "sglang" + plan.NO_MIX)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", action="append",
                    help="repeatable; POLICY@SHARE runs it with --running-reserve SHARE (e.g. goodput@1: "
                         "SGLang's whole decode reserve), POLICY:no-mix without mixed chunk (sglang:no-mix: "
                         "stock as SGLang ships it); default: sglang, paper, goodput@1, goodput")
    ap.add_argument("--profile", action="append",
                    help="repeatable; default: the two measured GPU profiles (the MoE and MLA ones: "
                         "h200-mixtral-8x7b, h100-deepseek-v2-lite)")
    ap.add_argument("--workload", action="append", help=f"repeatable; default: {', '.join(WORKLOADS)}")
    ap.add_argument("--duration", type=float, default=120.0)
    ap.add_argument("--slo", action="append", metavar="TTFT_S,TBT_S", type=slo_pair,
                    help="repeatable SLO pair in seconds (e.g. 2,0.075); default: 5,0.1 and 1,0.05")
    ap.add_argument("--seed", type=int, default=909)
    ap.add_argument("--seeds", type=int, default=1, help="workload seeds pooled per rate (ShareGPT-like)")
    ap.add_argument("--resolution", type=float, default=0.02)
    ap.add_argument("--hi", type=float, default=64.0, help="highest rate of the grid (req/s)")
    ap.add_argument("--probes", type=int, default=2, help="rates per bisection round (sim capacity --probes)")
    ap.add_argument("--slo-rule", choices=sorted(SLO_RULES), default="gaps", help=SLO_RULE_HELP)
    ap.add_argument("--no-ignore-eos", action="store_true",
                    help="requests may stop at EOS: the server sees only their max_new_tokens bound (sim run --no-ignore-eos)")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help="with --no-ignore-eos: every request asks for up to this many tokens, or its length where "
                         "longer (default: exactly its length)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results/sim_capacity"))
    a = ap.parse_args()
    if a.max_new_tokens is not None and not a.no_ignore_eos:
        ap.error("--max-new-tokens needs --no-ignore-eos: a fixed-length request decodes all it asks for")
    policies = a.policy or ["sglang", "paper", "goodput@1", "goodput"]
    grid = CapacityGrid(lo=0.05, hi=a.hi, resolution=a.resolution, probes=a.probes)
    rows = []
    for profile in a.profile or PROFILES:
        for workload in a.workload or WORKLOADS:
            for ttft, tbt in a.slo or SLOS:
                base = Job(profile, policies[0], workload, grid.lo, a.duration, a.seed, ttft, tbt, mixed_chunk=True,
                           ignore_eos=not a.no_ignore_eos, max_new_tokens=a.max_new_tokens)
                for pol in policies:
                    spec = plan.base_policy(pol)
                    if ":" in spec:
                        ap.error(f"--policy {pol}: the only mode is {plan.NO_MIX}")
                    name, _, share = spec.partition("@")
                    job = replace(base, policy=name, running_reserve=float(share) if share else None,
                                  mixed_chunk=plan.mixed_chunk(pol))
                    r = policy_capacity(job, grid, a.seeds, a.jobs, a.slo_rule)
                    r.update(policy=pol, profile=profile, workload=workload, slo=[ttft, tbt])
                    rows.append(r)
                    print(f"{profile} {workload} {ttft:g}s/{1000 * tbt:g}ms {pol}: {r['capacity_req_s']}", flush=True)
    record.write(a.out, "capacity.json", rows, table(rows, policies), grid=asdict(grid))


def slo_pair(text: str) -> tuple[float, float]:
    """argparse type of --slo: "TTFT_S,TBT_S", both positive seconds."""
    try:
        ttft, tbt = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TTFT_S,TBT_S (e.g. 2,0.075), got {text!r}") from None
    if ttft <= 0 or tbt <= 0:
        raise argparse.ArgumentTypeError(f"SLOs must be positive, got {text!r}")
    return ttft, tbt


def table(rows: list[dict], policies: list[str]) -> str:
    """Ratios against stock: `sglang`, or the better of `sglang` and `sglang:no-mix` where both ran."""
    both = all(p in policies for p in STOCK_WAYS)
    ref = "best stock" if both else "sglang"
    compared = [p for p in policies if p not in STOCK_WAYS]
    head = "| profile | workload | SLO | " + " | ".join(f"{p} req/s" for p in policies) + " |" + \
        "".join(f" {p} / {ref} |" for p in compared)
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    keys = sorted({(r["profile"], r["workload"], tuple(r["slo"])) for r in rows}, key=str)
    for key in keys:
        by = {r["policy"]: r["capacity_req_s"] for r in rows if (r["profile"], r["workload"], tuple(r["slo"])) == key}
        stock = max((by.get(p) or 0.0 for p in STOCK_WAYS), default=0.0) if both else by.get("sglang")
        # "-": not run in this cell; "<0.05": below the grid's lowest rate
        caps = " | ".join("-" if p not in by else "<0.05" if by[p] is None else f"{by[p]:.2f}" for p in policies)
        ratios = "".join(f" {by[p] / stock:.2f}x |" if stock and by.get(p) else " - |" for p in compared)
        lines.append(f"| {key[0]} | {key[1]} | {key[2][0]:g} s / {1000 * key[2][1]:g} ms | {caps} |{ratios}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
