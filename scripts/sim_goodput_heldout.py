"""Goodput policy on points the sweep does not tune on: other seeds, both Azure traces, other SLOs.

The same profiles and rates as `scripts/sim_goodput_sweep.py`, with ShareGPT-like seeds 7 and 11
and both Azure LLM inference traces 2023 (Azure Public Dataset, CC-BY 4.0; Patel et al.,
Splitwise, ISCA 2024), each under four SLO pairs the policy was never tuned for; stock SGLang,
the paper's rule and goodput (the server as shipped: the cost meter, mixed chunk for all). With
`--baseline REV` it also runs goodput as it was at commit REV (from a `git worktree` of it) and
reports the change point by point. Writes heldout.json and table.md into --out.

    python scripts/sim_goodput_heldout.py --jobs 2 --out results/sim_goodput_heldout
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

from superinfer_sgl.sim.workload import AZURE_ATTRIBUTION

PROFILES = {"gh200-qwen2.5-32b": (2.5, 5.0, 10.0, 15.0, 20.0),
            "h100-pcie5-qwen2.5-32b": (1.0, 2.5, 5.0, 7.5, 10.0)}
WORKLOADS = (("sharegpt-like", 7), ("sharegpt-like", 11), ("azure:code", 0), ("azure:conv", 0))
SLOS = ((2.0, 0.05), (10.0, 0.2), (1.0, 0.15), (3.0, 0.08))  # (TTFT s, TBT s)
POLICIES = ("sglang", "paper", "goodput")


def run(root: Path, policies: tuple[str, ...], processes: int) -> list[dict]:
    """Every point under the code at `root` (this checkout, or a baseline's worktree)."""
    code = f"""
import json, sys
sys.path.insert(0, {str(root)!r})
from superinfer_sgl.sim.runner import Job, run_jobs
jobs = [Job(p, pol, wl, r, 120.0, s, ttft_slo=t, tbt_slo=b, mixed_chunk=True)
        for p, rates in {PROFILES!r}.items() for wl, s in {WORKLOADS!r} for r in rates
        for t, b in {SLOS!r} for pol in {policies!r}]
rows = [{{"profile": x["job"]["profile"], "workload": x["job"]["workload"], "seed": x["job"]["seed"],
          "rate": x["job"]["rate"], "slo": [x["job"]["ttft_slo"], x["job"]["tbt_slo"]],
          "policy": x["policy"], "joint": x["both_attainment"], "throughput_tok_s": x["throughput_tok_s"],
          "finished": x["finished"], "requests": x["requests"], "ttft_p99_s": x["ttft_p99_s"],
          "ttft_max_s": x["ttft_max_s"]}} for x in run_jobs(jobs, {processes})]
print(json.dumps(rows))
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=root, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def point(r: dict) -> tuple:
    return r["profile"], r["workload"], r["seed"], r["rate"], tuple(r["slo"])


def summary(rows: list[dict], base: list[dict] | None) -> str:
    by = {(point(r), r["policy"]): r for r in rows}
    pts = sorted({point(r) for r in rows})
    good = [by[(p, "goodput")] for p in pts]
    under = [p for p in pts if by[(p, "goodput")]["joint"] < max(by[(p, "sglang")]["joint"], by[(p, "paper")]["joint"]) - 1e-9]
    tput = [by[(p, "goodput")]["throughput_tok_s"] / by[(p, "sglang")]["throughput_tok_s"] for p in pts]
    lines = [f"- points: {len(pts)}; goodput's mean joint attainment {100 * np.mean([r['joint'] for r in good]):.1f}% "
             f"(stock {100 * np.mean([by[(p, 'sglang')]['joint'] for p in pts]):.1f}%, "
             f"paper {100 * np.mean([by[(p, 'paper')]['joint'] for p in pts]):.1f}%)",
             f"- under stock or paper: {len(under)} points {under if under else ''}",
             f"- every request completes: {all(r['finished'] == r['requests'] for r in good)}",
             f"- throughput / stock's: {100 * min(tput):.1f}% .. {100 * max(tput):.1f}%; "
             f"under 97% at {sum(t < 0.97 for t in tput)} points"]
    if base:
        old = {point(r): r for r in base if r["policy"] == "goodput"}
        d = np.array([100 * (by[(p, "goodput")]["joint"] - old[p]["joint"]) for p in pts])
        lines.append(f"- against the baseline: mean joint {100 * np.mean([old[p]['joint'] for p in pts]):.1f}% -> "
                     f"{100 * np.mean([r['joint'] for r in good]):.1f}% ({d.mean():+.2f} points); "
                     f"{(d > 2).sum()} points better by more than 2, {(d < -2).sum()} worse by more than 2 "
                     f"(range {d.min():+.1f} .. {d.max():+.1f})")
    head = "| profile | workload | rate | SLO (s) | joint: stock / paper / goodput | throughput goodput / stock |"
    table = [head, "|---|---|---|---|---|---|"]
    for p in pts:
        j = {pol: 100 * by[(p, pol)]["joint"] for pol in POLICIES}
        table.append(f"| {p[0]} | {p[1]} s{p[2]} | {p[3]:g} | {p[4][0]:g} / {p[4][1]:g} | "
                     f"{j['sglang']:.1f} / {j['paper']:.1f} / {j['goodput']:.1f} | "
                     f"{100 * by[(p, 'goodput')]['throughput_tok_s'] / by[(p, 'sglang')]['throughput_tok_s']:.1f}% |")
    return "\n".join(lines) + "\n\n" + "\n".join(table) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results/sim_goodput_heldout"))
    ap.add_argument("--baseline", help="a commit whose goodput to compare with (run from a git worktree of it)")
    a = ap.parse_args()
    rows = run(ROOT, POLICIES, a.jobs)
    base = None
    if a.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            wt = Path(tmp) / "baseline"
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), a.baseline],
                           check=True, capture_output=True)
            try:
                base = run(wt, ("goodput",), a.jobs)
            finally:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], check=True)
    command = "python scripts/sim_goodput_heldout.py " + " ".join(sys.argv[1:])
    doc = {"command": command,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "data_attribution": AZURE_ATTRIBUTION,
           "baseline": a.baseline, "rows": rows, "baseline_rows": base}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "heldout.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = summary(rows, base)
    (a.out / "table.md").write_text(f"# Goodput on held-out simulator points\n\n`{command}` ({doc['date_utc']})\n\n"
                                    f"Azure traces: {AZURE_ATTRIBUTION}\n\n"
                                    + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
