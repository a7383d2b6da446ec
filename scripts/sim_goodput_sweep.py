"""Goodput policy against stock SGLang, the paper's rule and the oracle in the simulator.

Both GPU profiles; ShareGPT-like lengths (two seeds) and both Azure LLM inference traces (Azure
LLM inference trace 2023, Azure Public Dataset, CC-BY 4.0; Patel et al., Splitwise, ISCA 2024);
rates from underload to about twice capacity; SGLang mixed chunk on for every policy (our server
runs with it; stock with it is the stronger stock, results/sim_whatif.md). Writes sweep.json, table.md and
attainment.png into --out.

    python scripts/sim_goodput_sweep.py --jobs 2 --out results/sim_goodput

Goodput reads the step costs a CostMeter learns from the simulated iterations, starting from
nothing, as the server's does (SimConfig.measured_costs); `--profile-costs` hands it the
profile's exact costs instead (what a server would measure at best):

    python scripts/sim_goodput_sweep.py --jobs 2 --profile-costs --out results/sim_goodput_profile_costs
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path


from superinfer_sgl.sim.runner import Job, run_jobs
from superinfer_sgl.sim.workload import AZURE_ATTRIBUTION

PROFILES = {"gh200-qwen2.5-32b": (2.5, 5.0, 10.0, 15.0, 20.0),
            "h100-pcie5-qwen2.5-32b": (1.0, 2.5, 5.0, 7.5, 10.0)}
WORKLOADS = (("sharegpt-like", 0), ("sharegpt-like", 1), ("azure:conv", 0), ("azure:code", 0))
POLICIES = ("sglang", "paper", "goodput", "oracle")
KEYS = ("both_attainment", "ttft_attainment", "tbt_attainment", "throughput_tok_s", "ttft_p99_s",
        "ttft_max_s", "finished", "requests", "rotations_out")


def jobs(policies: tuple[str, ...] = POLICIES, measured_costs: bool = True) -> list[Job]:
    return [Job(prof, pol, wl, rate, 120.0, seed, mixed_chunk=True, measured_costs=measured_costs)
            for prof, rates in PROFILES.items() for wl, seed in WORKLOADS for rate in rates
            for pol in policies]


def made_with_meter(doc: dict) -> bool:
    """Whether a sweep.json's goodput rows used the cost meter; files from before the key existed
    were all made with the profile's costs."""
    return bool(doc.get("measured_costs", False))


def rows(results: list[dict]) -> list[dict]:
    out = []
    for r in results:
        job = r["job"]
        row = {"profile": job["profile"], "workload": job["workload"], "seed": job["seed"],
               "rate": job["rate"], "policy": r["policy"]}
        row.update({k: r.get(k) for k in KEYS})
        out.append(row)
    return out


def table(data: list[dict]) -> str:
    lines = ["| profile | workload | rate | joint: stock / paper / goodput / oracle | goodput - max(stock, paper) "
             "| throughput goodput/stock | P99 TTFT stock / goodput (s) | max TTFT goodput (s) |",
             "|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple, dict[str, dict]] = {}
    for r in data:
        groups.setdefault((r["profile"], r["workload"], r["seed"], r["rate"]), {})[r["policy"]] = r
    for (prof, wl, seed, rate), g in sorted(groups.items()):
        j = {p: 100 * g[p]["both_attainment"] for p in POLICIES}
        margin = j["goodput"] - max(j["sglang"], j["paper"])
        tput = g["goodput"]["throughput_tok_s"] / g["sglang"]["throughput_tok_s"]
        lines.append(f"| {prof} | {wl} s{seed} | {rate:g} | {j['sglang']:.1f} / {j['paper']:.1f} / "
                     f"{j['goodput']:.1f} / {j['oracle']:.1f} | {margin:+.1f} | {100 * tput:.1f}% | "
                     f"{g['sglang']['ttft_p99_s']:.1f} / {g['goodput']['ttft_p99_s']:.1f} | "
                     f"{g['goodput']['ttft_max_s']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(data: list[dict], path: Path, measured_costs: bool = True) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(p, wl, s) for p in PROFILES for wl, s in WORKLOADS]
    fig, axes = plt.subplots(2, len(WORKLOADS), figsize=(5 * len(WORKLOADS), 8), squeeze=False)
    style = {"sglang": ("tab:gray", "o"), "paper": ("tab:red", "^"), "goodput": ("tab:blue", "s"),
             "oracle": ("tab:green", "*")}
    for ax, (prof, wl, seed) in zip([a for row in axes for a in row], panels):
        for pol in POLICIES:
            pts = sorted((r["rate"], 100 * r["both_attainment"]) for r in data
                         if (r["profile"], r["workload"], r["seed"], r["policy"]) == (prof, wl, seed, pol))
            color, marker = style[pol]
            ax.plot([x for x, _ in pts], [y for _, y in pts], color=color, marker=marker,
                    linestyle=":" if pol == "oracle" else "-", label=pol)
        ax.set_title(f"{prof}\n{wl} seed {seed}", fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("joint SLO attainment (%)")
        ax.set_ylim(-3, 103)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    costs = "" if measured_costs else "; goodput with the profile's step costs (--profile-costs)"
    fig.suptitle("Simulator: joint attainment (TTFT 5 s and 90% of gaps <= 100 ms), mixed chunk for all"
                 f"{costs}; python scripts/sim_goodput_sweep.py", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results/sim_goodput"))
    ap.add_argument("--profile-costs", action="store_true",
                    help="goodput reads the profile's exact step costs instead of learning them from the "
                         "simulated steps as the server does")
    ap.add_argument("--replot", action="store_true", help="redo table and plot from sweep.json")
    ap.add_argument("--only", action="append", choices=POLICIES,
                    help="re-run only these policies and replace their rows in the existing sweep.json "
                         "(the others are deterministic and unchanged by a change to this policy)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    if a.replot:
        doc = json.loads((a.out / "sweep.json").read_text())
    elif a.only:
        doc = json.loads((a.out / "sweep.json").read_text())
        kept = [r for r in doc["rows"] if r["policy"] not in a.only]
        doc["rows"] = kept + rows(run_jobs(jobs(tuple(a.only), made_with_meter(doc)), a.jobs))
        doc.setdefault("updates", []).append({"date_utc": now, "policies": a.only,
                                              "command": "python scripts/sim_goodput_sweep.py " + " ".join(sys.argv[1:])})
        (a.out / "sweep.json").write_text(json.dumps(doc, indent=1) + "\n")
    else:
        results = run_jobs(jobs(measured_costs=not a.profile_costs), a.jobs)
        doc = {"command": "python scripts/sim_goodput_sweep.py " + " ".join(sys.argv[1:]),
               "date_utc": now, "machine": {"node": platform.node(), "cpus": os.cpu_count()},
               "measured_costs": not a.profile_costs,
               "data_attribution": AZURE_ATTRIBUTION,
               "rows": rows(results)}
        (a.out / "sweep.json").write_text(json.dumps(doc, indent=1) + "\n")
    (a.out / "table.md").write_text(table(doc["rows"]))
    plot(doc["rows"], a.out / "attainment.png", made_with_meter(doc))
    print(table(doc["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
