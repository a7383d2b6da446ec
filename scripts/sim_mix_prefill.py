"""`--mix-prefill needed` against the default `always` in the simulator, point by point.

The goodput policy with mixed chunk (the server as shipped: the cost meter) on both GPU profiles,
ShareGPT-like (seed 909) and the Azure conversation trace (Azure LLM inference trace 2023, Azure
Public Dataset, CC-BY 4.0; Patel et al., Splitwise, ISCA 2024), both SLO pairs of the capacity
table, at fractions of the table's goodput capacity (docs/results.md, "SLO capacity"): below half
of it, where `needed` is meant to shorten the first token, and around it, where it must not cost
attainment. Writes mix_prefill.json into --out.

    python scripts/sim_mix_prefill.py --jobs 2 --out results/sim_mix_prefill
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from superinfer_sgl.sim.runner import Job, run_job
from superinfer_sgl.sim.workload import AZURE_ATTRIBUTION

# (profile, workload, TTFT s, TBT s, goodput's capacity in req/s: results/sim_capacity/table.md)
CELLS = (
    ("gh200-qwen2.5-32b", "sharegpt-like", 5.0, 0.1, 17.92),
    ("gh200-qwen2.5-32b", "sharegpt-like", 1.0, 0.05, 17.92),
    ("gh200-qwen2.5-32b", "azure:conv", 5.0, 0.1, 4.34),
    ("gh200-qwen2.5-32b", "azure:conv", 1.0, 0.05, 3.76),
    ("h100-pcie5-qwen2.5-32b", "sharegpt-like", 5.0, 0.1, 6.32),
    ("h100-pcie5-qwen2.5-32b", "sharegpt-like", 1.0, 0.05, 6.02),
    ("h100-pcie5-qwen2.5-32b", "azure:conv", 5.0, 0.1, 1.36),
    ("h100-pcie5-qwen2.5-32b", "azure:conv", 1.0, 0.05, 1.15),
)
FRACTIONS = (0.3, 0.5, 0.9, 1.0, 1.1)
MODES = ("always", "needed")
KEYS = ("both_attainment", "ttft_attainment", "throughput_tok_s", "ttft_p50_s", "tbt_p50_s", "tbt_p99_s",
        "finished", "requests")


def point(args: tuple[tuple, float, str]) -> dict:
    (profile, workload, ttft, tbt, capacity), fraction, mode = args
    r = run_job(Job(profile, "goodput", workload, round(capacity * fraction, 4), 120.0, 909, ttft, tbt,
                    mixed_chunk=True, mix_prefill=mode))
    return {"profile": profile, "workload": workload, "ttft_slo_s": ttft, "tbt_slo_s": tbt,
            "fraction": fraction, "rate": r["rate"], "mix_prefill": mode, **{k: r[k] for k in KEYS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    todo = [(c, f, m) for c in CELLS for f in FRACTIONS for m in MODES]
    with ProcessPoolExecutor(a.jobs) as pool:
        rows = list(pool.map(point, todo))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip()
    a.out.mkdir(parents=True, exist_ok=True)
    doc = {"command": "python scripts/sim_mix_prefill.py", "commit": commit,
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "attribution": AZURE_ATTRIBUTION, "rows": rows}
    (a.out / "mix_prefill.json").write_text(json.dumps(doc, indent=1) + "\n")
    for i in range(0, len(rows), 2):
        base, new = rows[i], rows[i + 1]
        print(f"{base['profile'][:5]} {base['workload']:13} {base['ttft_slo_s']:g}/{base['tbt_slo_s']:g} "
              f"{base['fraction']:.1f}x joint {base['both_attainment']:.3f} -> {new['both_attainment']:.3f} "
              f"ttft p50 {base['ttft_p50_s'] * 1e3:.0f} -> {new['ttft_p50_s'] * 1e3:.0f} ms "
              f"tbt p99 {base['tbt_p99_s'] * 1e3:.0f} -> {new['tbt_p99_s'] * 1e3:.0f} ms "
              f"throughput x{new['throughput_tok_s'] / base['throughput_tok_s']:.3f}")


if __name__ == "__main__":
    main()
