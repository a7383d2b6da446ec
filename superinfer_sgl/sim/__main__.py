"""`python -m superinfer_sgl.sim`: what-if simulation of RotaSched and its baselines.

  run       one workload through one or more policies on one cost profile, print a summary
  paper     the paper's scenario on GH200 and H100 profiles: sweeps, plots, claim table
  whatif    LVF knobs (budget, alpha, beta_tbt, mixed chunk, lookahead, direct resume) at one point
  --validate AB_JSON   replay the A/B harness's workload and compare with its measurements
  capacity  SLO capacity per policy: the highest rate at which --target of requests meet both SLOs
  plan      replicas a mix of SLO classes needs per policy; one shared cluster vs one per class
  validate-capacity DIR   the planner's one-replica answer against a live capacity run (ab_bench --capacity)
  speed     wall time of 120 s at 20 req/s per policy (the simulator's speed target)
  scale-profile NAME   a profile for an MoE or MLA model, scaled from the measured H100 one

Examples:
  python -m superinfer_sgl.sim run --profile gh200-qwen2.5-32b --rate 15 --policy sglang --policy lvf-duplex
  python -m superinfer_sgl.sim run --profile h100-pcie5-qwen2.5-32b --workload azure:conv --rate 4
  python -m superinfer_sgl.sim capacity --profile gh200-qwen2.5-32b --policy sglang --policy goodput --jobs 2
  python -m superinfer_sgl.sim plan --profile h100-pcie5-qwen2.5-32b --class chat:rate=20,ttft_ms=1000,tbt_ms=50 \
      --class batch:rate=10,ttft_ms=30000,tbt_ms=500 --policy goodput --policy sglang --policy sglang-priority
  python -m superinfer_sgl.sim paper --jobs 2
  python -m superinfer_sgl.sim --validate results/ab_cpu.json
  python -m superinfer_sgl.sim validate-capacity results/capacity_cpu
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from superinfer_sgl.sim import capacity, capacity_validate, plan, scale_profile
from superinfer_sgl.sim import validate as validate_defaults
from superinfer_sgl.rotasched.planner import MIX_PREFILL
from superinfer_sgl.sim.engine import SimConfig
from superinfer_sgl.sim.policies import POLICIES
from superinfer_sgl.sim.profile import resolve_profile
from superinfer_sgl.sim.runner import Job, build_workload, run_jobs

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"
SHOW = ("requests", "finished", "ttft_attainment", "tbt_attainment", "both_attainment",
        "tbt_gap_attainment", "ttft_p50_s", "ttft_p99_s", "tbt_p50_s", "tbt_p99_s", "throughput_tok_s",
        "rotations_out", "retractions", "moved_in_gb", "transfer_share", "sim_end_s", "wall_s")


PROBES_HELP = ("rates probed per bisection round (1: bisection; 2: thirds). The answer can depend on it where "
               "a curve wavers around the target; it never depends on --jobs")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m superinfer_sgl.sim", description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--validate", type=Path, metavar="AB_JSON",
                    help="replay an A/B result (results/ab_cpu.json, or its folder) and compare")
    ap.add_argument("--validate-profile", default=validate_defaults.DEFAULT_PROFILE,
                    help="cost profile (name in profiles/ or a path) for --validate; reports made with another "
                         "profile or --rescale get its name / _rescaled in their file names")
    ap.add_argument("--rescale", action="store_true",
                    help="--validate: replay each point at the machine's speed while it ran: from the servers' "
                         "step logs where the A/B has them (step model refit to the point's steps, plus its speed "
                         "over time in 3 s buckets), else from the speed probe right before the point, else from "
                         "the opening probe (docs/sim.md)")
    ap.add_argument("--map", action="append", default=[], metavar="SYSTEM=POLICY",
                    help="--validate: simulate an A/B system with this policy (e.g. superinfer=lvf-duplex)")
    sub = ap.add_subparsers(dest="cmd")
    run = sub.add_parser("run", help="simulate one workload")
    _workload_options(run)
    run.add_argument("--rate", type=float, default=10.0, help="req/s (Azure: rescale; 0 = as recorded; a .csv / .jsonl table: as recorded, always)")
    run.add_argument("--json", type=Path, help="write all summaries here")
    cap = sub.add_parser("capacity", help="SLO capacity per policy (rate search)",
                         description=capacity.__doc__.split("\n\n")[0])
    _workload_options(cap)
    cap.add_argument("--target", type=float, default=0.9, help="share of requests meeting both SLOs")
    cap.add_argument("--lo", type=float, default=0.5, help="lowest rate of the grid (req/s)")
    cap.add_argument("--hi", type=float, default=64.0, help="highest rate of the grid (req/s)")
    cap.add_argument("--growth", type=float, default=1.25, help="ratio between grid rates")
    cap.add_argument("--resolution", type=float, default=0.02,
                   help="bisect the crossing until its bracket is this fraction of the rate")
    cap.add_argument("--probes", type=_positive_int, default=2, help=PROBES_HELP)
    cap.add_argument("--seeds", type=_positive_int, default=1, help="workload seeds pooled at each rate (from --seed)")
    cap.add_argument("--slo-rule", choices=sorted(capacity.SLO_RULES), default="gaps", help=capacity.SLO_RULE_HELP)
    cap.add_argument("--json", type=Path, help="write one row per policy (policy, capacity_req_s, points)")
    pl = sub.add_parser("plan", help="replicas per policy for a mix of SLO classes",
                        description=plan.__doc__.split("\n\n")[0])
    pl.add_argument("--profile", default="gh200-qwen2.5-32b", help="profiles/<name>.json or a path")
    pl.add_argument("--class", dest="classes", action="append", required=True, type=_mix_class,
                    metavar="NAME:rate=R,ttft_ms=T,tbt_ms=B[,weight=W]", help="repeatable: one SLO class and its rate")
    pl.add_argument("--policy", action="append", type=_plan_policy, metavar="POLICY[:no-mix]",
                    help=f"repeatable, one of {', '.join(sorted(POLICIES))}; POLICY:no-mix without SGLang's mixed "
                         "chunk (stock SGLang's default); default: goodput, sglang, sglang:no-mix, sglang-priority")
    pl.add_argument("--target", type=float, default=0.9, help="share of each class's requests meeting both SLOs")
    pl.add_argument("--duration", type=_positive_float, default=120.0, help="seconds of arrivals per simulated rate")
    pl.add_argument("--seed", type=int, default=0)
    pl.add_argument("--seeds", type=_positive_int, default=1, help="workload seeds pooled at each rate")
    pl.add_argument("--resolution", type=float, default=0.02)
    pl.add_argument("--lo", type=float, default=0.5, help="lowest total rate of the grid (req/s)")
    pl.add_argument("--hi", type=float, default=64.0,
                    help="highest total rate of the grid (req/s); a capacity there is reported as at least it")
    pl.add_argument("--probes", type=_positive_int, default=2, help=PROBES_HELP)
    pl.add_argument("--jobs", type=_positive_int, default=1, help="worker processes")
    pl.add_argument("--json", type=Path, help="write one row per policy")
    vc = sub.add_parser("validate-capacity", help="the planner's one-replica answer against a live capacity run",
                        description=capacity_validate.__doc__.split("\n\n")[0])
    vc.add_argument("run_dir", type=Path, metavar="DIR", help="an ab_bench.py --capacity folder (or its ab.json)")
    vc.add_argument("--profile", default=validate_defaults.DEFAULT_PROFILE, help="cost profile scaled to the run's speed")
    vc.add_argument("--speed", choices=capacity_validate.SPEED_SOURCES, default="auto",
                    help="the run's speed from its step logs, point probes or opening calibration (auto: the first it has)")
    vc.add_argument("--duration", type=_positive_float, default=600.0, help="planner: seconds of arrivals per simulated rate")
    vc.add_argument("--seeds", type=_positive_int, default=4, help="planner: workload seeds pooled at each rate")
    vc.add_argument("--seed", type=int, default=0)
    vc.add_argument("--resolution", type=float, default=0.02, help="planner: bisection resolution")
    vc.add_argument("--no-replay", action="store_true", help="skip the replay of the live search per repeat")
    vc.add_argument("--as-planned", action="store_true",
                    help="planner: its own settings (mixed chunk for every policy) instead of each server's flags")
    vc.add_argument("--jitter", action=argparse.BooleanOptionalAction, default=True,
                    help="simulated steps spread as each system's logged steps did (step logs only)")
    vc.add_argument("--jobs", type=_positive_int, default=1, help="worker processes (planner)")
    vc.add_argument("--out", type=Path, default=RESULTS, help="writes sim_validate_capacity_<run>.json / .md here")
    paper = sub.add_parser("paper", help="the paper's scenario: sweeps, plots, claims")
    paper.add_argument("--jobs", type=_positive_int, default=1)
    paper.add_argument("--quick", action="store_true", help="30 s of arrivals, two rates")
    paper.add_argument("--out", type=Path, default=RESULTS)
    paper.add_argument("--replot", action="store_true", help="redo plots/tables from sim_paper.json")
    whatif = sub.add_parser("whatif", help="LVF knobs at one contended point (GH200, 15 req/s)")
    whatif.add_argument("--jobs", type=_positive_int, default=1)
    whatif.add_argument("--out", type=Path, default=RESULTS)
    speed = sub.add_parser("speed", help="wall time of 120 s at 20 req/s, per policy")
    speed.add_argument("--profile", default="gh200-qwen2.5-32b")
    speed.add_argument("--policy", action="append", choices=sorted(POLICIES))
    speed.add_argument("--out", type=Path, default=RESULTS / "sim_speed.json")
    sc = sub.add_parser("scale-profile", help="write a profile scaled from a measured one (MoE, MLA shapes)",
                        description=(scale_profile.__doc__ or "").split("\n\n")[0])
    sc.add_argument("name", choices=sorted(scale_profile.TARGETS))
    sc.add_argument("--out-dir", type=Path, default=scale_profile.PROFILE_DIR)
    return ap


def _workload_options(p: argparse.ArgumentParser) -> None:
    """What `run` and `capacity` share: the workload, the profile, the policies and their knobs."""
    p.add_argument("--profile", default="gh200-qwen2.5-32b", help="profiles/<name>.json or a path")
    p.add_argument("--policy", action="append", choices=sorted(POLICIES), help="repeatable; default: all")
    p.add_argument("--workload", default="sharegpt-like",
                   help="sharegpt-like | azure:conv | azure:code (azure:KIND@START: the window from START s into the trace) | a ShareGPT .json / .csv / .jsonl trace")
    p.add_argument("--duration", type=_positive_float, default=120.0, help="seconds of arrivals")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ttft-slo-ms", type=float, help="override every request's TTFT SLO")
    p.add_argument("--tbt-slo-ms", type=float, help="override every request's TBT SLO")
    p.add_argument("--budget-blocks", type=int, default=2400, help="B_xfer (LVF rotation budget)")
    p.add_argument("--kv-tokens", type=int, help="override the profile's device KV pool")
    p.add_argument("--vlt", type=float, nargs=3, default=(3.0, 0.5, 0.0), metavar=("ALPHA", "B_TTFT", "B_TBT"))
    p.add_argument("--lookahead", action="store_true", help="transfers overlap compute")
    p.add_argument("--mixed-chunk", action="store_true", help="prefill batches also decode (SGLang mixed chunk)")
    p.add_argument("--mix-prefill", choices=MIX_PREFILL, default=SimConfig.mix_prefill,
                   help="our policies with --mixed-chunk: the server's --mix-prefill")
    p.add_argument("--min-stint-s", type=float, default=None,
                   help="LVF may not rotate out a request running for less than this (default: 0, the "
                          "paper's rule, for the lvf-* policies; the server's default for goodput and paper)")
    p.add_argument("--max-best-effort-wait-s", type=float, default=SimConfig.max_best_effort_wait_s,
                   help="goodput policy: starvation bound (the server's --max-best-effort-wait-ms)")
    p.add_argument("--ttft-shedding", action=argparse.BooleanOptionalAction, default=SimConfig.ttft_shedding,
                   help="goodput policy: the server's --ttft-shedding")
    p.add_argument("--step-jitter", type=float, default=0.0,
                   help="spread of single steps (coefficient of variation; the CPU server's: ~0.15)")
    p.add_argument("--profile-costs", action="store_true",
                   help="goodput policy: the profile's exact step costs instead of what the server's "
                          "CostMeter learns from the simulated steps (the default, as the server does)")
    p.add_argument("--no-ignore-eos", action="store_true", help="reserve with SGLang's new-token ratio")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="with --no-ignore-eos: every request asks for up to this many tokens (or its trace "
                        "length, where longer) and stops at EOS after its trace length (default: exactly it)")
    p.add_argument("--running-reserve", type=float, default=None,
                   help="our policies: the decode reserve a running request keeps, as a share of SGLang's "
                        "(the server's --running-reserve; default: the policy's)")
    p.add_argument("--jobs", type=_positive_int, default=1, help="worker processes")


def _job(a: argparse.Namespace, policy: str, rate: float) -> Job:
    return Job(a.profile, policy, a.workload, rate, a.duration, a.seed,
               None if a.ttft_slo_ms is None else a.ttft_slo_ms / 1000.0,
               None if a.tbt_slo_ms is None else a.tbt_slo_ms / 1000.0,
               a.budget_blocks, a.kv_tokens, a.lookahead, a.mixed_chunk, not a.no_ignore_eos,
               a.min_stint_s, tuple(a.vlt), a.max_best_effort_wait_s, a.step_jitter,
               measured_costs=not a.profile_costs, running_reserve=a.running_reserve, mix_prefill=a.mix_prefill,
               ttft_shedding=a.ttft_shedding, max_new_tokens=a.max_new_tokens)


def _capacity(a: argparse.Namespace) -> None:
    grid = capacity.CapacityGrid(a.target, a.lo, a.hi, a.growth, a.resolution, probes=a.probes)
    rows = [capacity.policy_capacity(_job(a, pol, grid.lo), grid, a.seeds, a.jobs, a.slo_rule)
            for pol in (a.policy or list(POLICIES))]
    print(f"profile: {a.profile}; workload: {a.workload}; {a.duration:g} s of arrivals, {a.seeds} seed(s) from "
          f"{a.seed}; first crossing of {100 * a.target:g}% joint attainment (TBT rule: {a.slo_rule}), "
          f"resolution {100 * a.resolution:g}%")
    print(capacity.capacity_table(rows, baseline=rows[0]["policy"]))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


def _plan(a: argparse.Namespace) -> None:
    spec = plan.PlanSpec(a.profile, tuple(a.classes), a.duration, a.seed, a.seeds)
    grid = capacity.CapacityGrid(a.target, a.lo, a.hi, resolution=a.resolution, probes=a.probes)
    rows = plan.plan(spec, a.policy or ["goodput", "sglang", "sglang" + plan.NO_MIX, "sglang-priority"], grid, a.jobs)
    print(f"profile: {a.profile}; {sum(c.rate for c in a.classes):g} req/s: "
          + ", ".join(f"{c.name} {c.rate:g} req/s at {1000 * c.ttft_s:g} ms / {1000 * c.tbt_s:g} ms" for c in a.classes)
          + f"; every class at {100 * a.target:g}% joint attainment")
    print(plan.plan_table(rows))
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


def _run(a: argparse.Namespace) -> None:
    jobs = [_job(a, pol, a.rate) for pol in (a.policy or list(POLICIES))]
    results = run_jobs(jobs, a.jobs, progress=False)
    print(f"workload: {results[0]['workload']}; profile: {results[0]['profile']}")
    print(f"{'metric':22s}" + "".join(f"{r['policy']:>26s}" for r in results))
    for key in SHOW:
        cells = []
        for r in results:
            v = r[key]
            cells.append(f"{'-' if v is None else (f'{v:.3f}' if isinstance(v, float) else v):>26}")
        print(f"{key:22s}" + "".join(cells))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str) + "\n")


def _speed(a: argparse.Namespace) -> None:
    import os
    import platform

    jobs = [Job(a.profile, pol, rate=20.0, duration=120.0) for pol in (a.policy or list(POLICIES))]
    rows = []
    for job in jobs:
        r = run_jobs([job], 1, progress=False)[0]
        rows.append({"policy": job.policy, "wall_s": round(r["wall_s"], 2), "cpu_s": round(r["cpu_s"], 2),
                     "iterations": r["iterations"],
                     "requests": r["requests"], "rotations_out": r["rotations_out"],
                     "loadavg": [round(x, 2) for x in os.getloadavg()]})
        print(f"{job.policy:26s} {r['wall_s']:6.2f} s wall {r['cpu_s']:6.2f} s CPU  {r['iterations']:6d} iterations  "
              f"{r['rotations_out']:7d} rotations", flush=True)
    import datetime

    doc = {"profile": a.profile, "workload": "sharegpt-like, Poisson 20 req/s, 120 s, seed 0",
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": "python -m superinfer_sgl.sim speed" + "".join(f" --policy {p}" for p in a.policy or []),
           "machine": {"node": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()},
           "note": "cpu_s: process CPU time of one run (the target: < 10 s); wall_s depends on the "
                   "shared machine's load (loadavg: 1/5/15-min load average after each run)",
           "rows": rows}
    a.out.write_text(json.dumps(doc, indent=1) + "\n")


def _plan_policy(text: str) -> str:
    if plan.base_policy(text) not in POLICIES:
        raise argparse.ArgumentTypeError(f"unknown policy {text!r}; known: {', '.join(sorted(POLICIES))} "
                                         f"(each also as POLICY{plan.NO_MIX})")
    return text


def _mix_class(text: str) -> plan.MixClass:
    try:
        return plan.MixClass.parse(text)
    except ValueError as e:  # argparse shows an ArgumentTypeError's own words
        raise argparse.ArgumentTypeError(str(e)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0.0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def _check_inputs(ap: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """A misspelt profile or workload is a usage error before any work starts, not a traceback
    from a worker process."""
    try:
        for name in ([a.validate_profile] if a.validate is not None else [getattr(a, "profile", None)]):
            if name is not None:
                resolve_profile(name)
        table = a.cmd in ("run", "capacity") and a.workload != "sharegpt-like" \
            and not a.workload.startswith("azure:") and Path(a.workload).suffix != ".json"
        if a.cmd == "capacity" and table:
            raise ValueError(f"{a.workload}: a recorded table keeps its own arrival times, so every rate would "
                             "replay the same trace; capacity needs a workload it can re-time (sharegpt-like, "
                             "azure:KIND, a ShareGPT .json)")
        if a.cmd == "capacity":
            capacity.CapacityGrid(a.target, a.lo, a.hi, a.growth, a.resolution, probes=a.probes)
        if a.cmd == "plan":
            capacity.CapacityGrid(a.target, a.lo, a.hi, resolution=a.resolution, probes=a.probes)
            plan.PlanSpec(a.profile, tuple(a.classes), a.duration, a.seed, a.seeds)
        if a.cmd in ("run", "capacity"):
            wl = build_workload(a.workload, a.rate if a.cmd == "run" else a.lo, a.duration, a.seed)
            if a.max_new_tokens is not None:
                _job(a, "sglang", 1.0)  # (with ignore_eos: a usage error)
                wl.with_max_new_tokens(a.max_new_tokens)
    except (OSError, ValueError) as e:
        ap.error(str(e))


def main(argv: list[str] | None = None) -> int:
    ap = _parser()
    a = ap.parse_args(argv)
    _check_inputs(ap, a)
    if a.validate is not None:
        from superinfer_sgl.sim import validate

        mapping = dict(m.split("=", 1) for m in a.map)
        report = validate.run(a.validate, a.validate_profile, RESULTS, mapping, rescale=a.rescale)
        print(validate.markdown(report))
        return 0 if report["all_pass"] else 1
    if a.cmd == "run":
        _run(a)
    elif a.cmd in ("capacity", "plan"):
        try:
            (_capacity if a.cmd == "capacity" else _plan)(a)
        except ValueError as e:  # found during the search (e.g. a rate with no request to judge)
            ap.error(str(e))
    elif a.cmd == "validate-capacity":
        rep = capacity_validate.run(a.run_dir, a.out, profile=a.profile, speed=a.speed, duration=a.duration,
                                    seeds=a.seeds, seed=a.seed, resolution=a.resolution, processes=a.jobs,
                                    policy_map=dict(m.split("=", 1) for m in a.map), replay=not a.no_replay,
                                    as_planned=a.as_planned, jitter=a.jitter)
        print(capacity_validate.markdown(rep))
    elif a.cmd == "paper":
        from superinfer_sgl.sim import paper

        doc = paper.replot(a.out) if a.replot else paper.run(a.out, a.jobs, a.quick)
        print(json.dumps(doc["claims"], indent=1))
    elif a.cmd == "whatif":
        from superinfer_sgl.sim import paper

        paper.run_whatif(a.out, a.jobs)
        print((a.out / "sim_whatif.md").read_text())
    elif a.cmd == "speed":
        _speed(a)
    elif a.cmd == "scale-profile":
        print(scale_profile.write(a.name, a.out_dir))
    else:
        _parser().print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
