#!/usr/bin/env python3
"""Which parts of the replay make it match a measured CPU A/B: the validation run once per model
variant, on A/B folders whose servers logged their steps (logs/<system>.steps.jsonl beside ab.json).

Variants, each adding to the previous one:
  profile      the CPU profile as measured, no one-step result lag
  scale        + two speed factors per point from its step log
  lag          + the overlap scheduler's one-step result lag (profile server.emit_after_next_step)
  refit        + the step model's slopes refit to the point's steps
  trace        + the machine's speed over the point in 3 s buckets (the default of --rescale)
  jitter       + single steps spread around it as much as the point's steps did within buckets

Usage: python scripts/sim_validate_ablation.py results/ab_cpu_sharegpt_0123c [more A/B folders]
Writes results/sim_validate_ablation.json and .md (rows passing per variant and A/B).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from superinfer_sgl.sim.profile import resolve_profile
from superinfer_sgl.sim.validate import DEFAULT_PROFILE, validate

# name -> (one-step result lag, --rescale, what the step log gives)
VARIANTS = {
    "profile": (False, False, "trace"),
    "scale": (False, True, "scale"),
    "lag": (True, True, "scale"),
    "refit": (True, True, "refit"),
    "trace": (True, True, "trace"),
    "jitter": (True, True, "jitter"),  # trace + the spread of single steps within its buckets
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("ab", nargs="+", type=Path, help="A/B result folders (with logs/*.steps.jsonl)")
    ap.add_argument("--profile", default=DEFAULT_PROFILE)
    ap.add_argument("--out", type=Path, default=REPO / "results" / "sim_validate_ablation")
    a = ap.parse_args()
    base = resolve_profile(a.profile)
    out: dict[str, dict] = {}
    for ab in a.ab:
        for name, (lag, rescale, use) in VARIANTS.items():
            prof = replace(base, server=replace(base.server, emit_after_next_step=lag))
            rep = validate(ab, prof, rescale=rescale, step_log_use=use)
            rows = rep["rows"]
            judged = [r for r in rows if r["judgeable"]]
            out.setdefault(ab.name, {})[name] = {
                "pass": sum(r["delta"]["pass"] for r in rows), "rows": len(rows),
                "judgeable_pass": sum(r["delta"]["pass"] for r in judged), "judgeable": len(judged),
                "max_ttft_points": max(abs(r["delta"]["ttft_points"]) for r in rows),
                "max_joint_points": max(abs(r["delta"]["joint_points"]) for r in rows),
                "max_p50_rel": max(abs(r["delta"]["p50_ttft_rel"] or 0.0) for r in rows)}
            print(ab.name, name, out[ab.name][name], flush=True)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps({"profile": a.profile, "variants": list(VARIANTS),
                                                       "results": out}, indent=1) + "\n")
    lines = ["| A/B | variant | rows passing | where the twins agree | worst TTFT att. pts | worst joint pts "
             "| worst P50 TTFT rel. |", "|---|---|---|---|---|---|---|"]
    for ab, variants in out.items():
        for name, r in variants.items():
            lines.append(f"| {ab} | {name} | {r['pass']}/{r['rows']} | {r['judgeable_pass']}/{r['judgeable']} | "
                         f"{r['max_ttft_points']:.1f} | {r['max_joint_points']:.1f} | {100 * r['max_p50_rel']:.0f}% |")
    a.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
