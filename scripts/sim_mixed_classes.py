"""The mixed-class CPU A/B workload in the simulator: per class, many seeds, every policy.

The workload is the A/B harness's (`scripts/ab_bench.py --profile cpu --workload mixed --class-mix
interactive:1,batch:1`): its length distributions, its class draw, Poisson arrivals; the SLO
classes, rates and server flags are read from a measured A/B result (default: the current mixed
one), and the cost profile is the CPU profile scaled to that A/B's opening speed probe. Policies:
stock SGLang (FCFS), stock with priority scheduling (priority by TTFT class, as the harness sends
it), and ours as launched there (`goodput`; `--also paper` adds the paper's rule). Writes
mixed.json and table.md into --out.

    python scripts/sim_mixed_classes.py --seeds 10 --out results/sim_mixed_classes
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np


from superinfer_sgl.bench import abfile
from superinfer_sgl.bench.profiles import PROFILES
from superinfer_sgl.bench.prompts import priority_by_ttft
from superinfer_sgl.bench.workloads import (
    assign_classes, parse_mix, poisson_arrivals, sharegpt_like,
)
from superinfer_sgl.rotasched.slo import Slo, SloClasses
from superinfer_sgl.sim import steplog
from superinfer_sgl.sim.engine import Simulator
from superinfer_sgl.sim.metrics import request_outcomes
from superinfer_sgl.sim.policies import make_policy
from superinfer_sgl.sim.profile import resolve_profile
from superinfer_sgl.sim.validate import DEFAULT_PROFILE, scaled, speed_scales, system_config
from superinfer_sgl.sim.workload import RequestSpec, Workload

AB = Path("results/ab_cpu_paired_mixed/ab.json.gz")
# name -> (the A/B server whose launch flags it runs with, simulator policy)
SYSTEMS = {"sglang": ("sglang", "sglang"), "sglang-priority": ("sglang-priority", "sglang-priority"),
           "superinfer": ("superinfer", "goodput")}


def class_mix(cfg: dict) -> str:
    argv = [str(x) for x in cfg.get("argv") or []]
    return argv[argv.index("--class-mix") + 1] if "--class-mix" in argv else PROFILES[cfg["profile"]].class_mix


def workload(cfg: dict, seed: int, rate: float) -> tuple[Workload, dict[str, str]]:
    """The harness's mixed request set for `seed` (its lengths, its class draw) at `rate`."""
    p = PROFILES[cfg["profile"]]
    default = Slo(cfg["slo_default"]["ttft_ms"], cfg["slo_default"]["tbt_ms"])
    classes = SloClasses.parse(json.dumps(cfg["slo_classes"]), default=default)
    reqs = assign_classes(sharegpt_like(cfg["num_requests"], seed, default, p.inputs, p.outputs),
                          parse_mix(class_mix(cfg)), classes, seed)
    prio = priority_by_ttft(reqs)
    arrivals = poisson_arrivals(len(reqs), rate, seed)
    specs = [RequestSpec(f"r{r.idx}", t, r.prompt_tokens, r.output_tokens, r.slo.ttft_s, r.slo.tbt_s,
                         prio(r), weight=r.slo.weight) for r, t in zip(reqs, arrivals)]
    return Workload(tuple(sorted(specs, key=lambda s: s.arrival)), f"mixed seed {seed}"), \
        {f"r{r.idx}": r.slo_class or "default" for r in reqs}


def run(cfg: dict, profile, system: str, policy: str, seed: int, rate: float, jitter: float = 0.0) -> dict:
    wl, cls = workload(cfg, seed, rate)
    conf = replace(system_config(cfg, system, policy, int(cfg["kv_tokens"])), step_jitter=jitter, jitter_seed=seed)
    sim = Simulator(wl, profile, make_policy(policy), conf).run()
    rows = request_outcomes(sim)
    joint = {r["rid"]: bool(r["ttft_met"] and r["tbt_met"]) for r in rows}
    out = {"joint": float(np.mean(list(joint.values()))),
           "finished": sum(bool(r["finished"]) for r in rows), "requests": len(rows),
           "output_tokens": sum(s.output_tokens for s in wl.requests), "end_s": sim.now}
    for name in sorted(set(cls.values())):
        mine = [r for r in rows if cls[r["rid"]] == name]
        out[name] = {k: float(np.mean([bool(r[k2]) for r in mine]))
                     for k, k2 in (("ttft", "ttft_met"), ("tbt", "tbt_met"))}
        out[name]["joint"] = float(np.mean([joint[r["rid"]] for r in mine]))
    return out


def measured_spread(ab: Path, base) -> float:
    """Our server's step spread over the whole A/B (its step log), around the step model refit to
    it. Step logs stay on the machine that ran the A/B (results/README.md): without one, say so and
    use 0 (pass the spread with --step-jitter to reproduce a documented run)."""
    log = ab.parent / "logs" / "superinfer.steps.jsonl"
    if not log.exists():
        print(f"warning: no step log at {log}: step jitter 0 (pass --step-jitter)", file=sys.stderr)
        return 0.0
    steps = steplog.read_steps(log)
    found = steplog.refit(base.step, steps)
    spread = steplog.step_spread(found[0], steps, None) if found else None
    return spread or 0.0


def table(doc: dict) -> str:
    classes = doc["classes"]
    head = "| rate req/s | system | joint | " + " | ".join(f"{c} joint (TTFT / TBT)" for c in classes) + \
        " | ours - best stock |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rate, by_sys in doc["results"].items():
        mean = {s: float(np.mean([r["joint"] for r in runs])) for s, runs in by_sys.items()}
        best_stock = max(v for s, v in mean.items() if s.startswith("sglang"))
        for s, runs in by_sys.items():
            per = " | ".join(
                f"{100 * np.mean([r[c]['joint'] for r in runs]):.1f}% "
                f"({100 * np.mean([r[c]['ttft'] for r in runs]):.0f} / {100 * np.mean([r[c]['tbt'] for r in runs]):.0f})"
                for c in classes)
            diff = f"{100 * (mean[s] - best_stock):+.1f}" if not s.startswith("sglang") else ""
            lines.append(f"| {rate} | {s} | {100 * mean[s]:.1f}% | {per} | {diff} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ab", type=Path, default=AB, help="measured mixed A/B whose SLOs, rates and flags to use")
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--also", action="append", default=[], choices=["paper"], help="more policies for ours")
    ap.add_argument("--out", type=Path, default=Path("results/sim_mixed_classes"))
    ap.add_argument("--step-jitter", type=float, default=None,
                    help="spread of single steps (SimConfig.step_jitter); default: as measured in the A/B's "
                         "step log of our server (drift included: no speed trace is replayed here); 0: none")
    a = ap.parse_args()
    doc = abfile.read_json(a.ab)
    cfg = doc["config"]
    cal = doc.get("calibration") or {}
    base = resolve_profile(DEFAULT_PROFILE)
    profile = scaled(base, speed_scales(base, cal)).with_server(
        kv_tokens=int(cfg["kv_tokens"]), chunked_prefill_tokens=int(cfg["chunked_prefill"]) or None)
    jitter = a.step_jitter if a.step_jitter is not None else measured_spread(a.ab, base)
    systems = dict(SYSTEMS, **{f"superinfer-{p}": ("superinfer", p) for p in a.also})
    classes = sorted({r["slo_class"] for r in cfg["requests"] if r.get("slo_class")})
    results: dict[str, dict[str, list[dict]]] = {}
    for pt in cfg["points"]:
        rate = pt["rate"]
        results[str(rate)] = {
            name: [run(cfg, profile, server, pol, seed, rate, jitter) for seed in range(1, a.seeds + 1)]
            for name, (server, pol) in systems.items()}
    out = {"command": "python scripts/sim_mixed_classes.py " + " ".join(sys.argv[1:]),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "ab": str(a.ab), "slo_classes": cfg["slo_classes"], "classes": classes,
           "speed_scales": speed_scales(base, cal), "step_jitter": jitter, "seeds": a.seeds, "results": results}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "mixed.json").write_text(json.dumps(out, indent=1) + "\n")
    text = table(out)
    (a.out / "table.md").write_text(f"# Mixed-class CPU workload in the simulator\n\n`{out['command']}` "
                                    f"({out['date_utc']}; SLO classes {cfg['slo_classes']}; "
                                    f"{a.seeds} seeds per point; step jitter {jitter:.3f})\n\n" + text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
