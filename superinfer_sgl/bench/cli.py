"""`python scripts/ab_bench.py`: command-line options -> a Plan -> a sweep -> reports."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

from ..rotasched.slo import Slo, SloClasses, SloError
from .profiles import PROFILES, Profile, make_dummy_model
from .runner import Plan, SweepPoint, describe, execute, prepare_files
from .servers import noise_twin, shared_flags, stop_all, systems
from .traces import LengthFit, TraceError, load_trace, to_requests
from .workloads import (
    BenchRequest,
    assign_classes,
    offered_rate,
    parse_mix,
    poisson_arrivals,
    recorded_arrivals,
    sharegpt_like,
)

REPO = Path(__file__).resolve().parents[2]
# superinfer_sgl.cpu_attention's switch; unset it follows SUPERINFER_CPU_COMPAT, so we always set it
# explicitly and identically for every system.
CPU_ATTENTION_ENV = "SUPERINFER_CPU_ATTENTION"


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python scripts/ab_bench.py",
                                description="A/B: stock SGLang vs superinfer_sgl under SGLang's own load generator.")
    p.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    p.add_argument("--workload", choices=("sharegpt", "mixed", "trace"), default="sharegpt",
                   help="sharegpt: ShareGPT-like lengths from the seed, one SLO; mixed: the same with SLO "
                        "classes (--class-mix); trace: lengths (and timestamps) from --trace")
    p.add_argument("--trace", help="trace file: Azure-style CSV, Mooncake/JSONL with timestamps, ShareGPT JSON")
    p.add_argument("--trace-arrivals", choices=("poisson", "recorded"), default="poisson",
                   help="poisson: re-time the trace as Poisson at each --rates value; recorded: replay its "
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
    p.add_argument("--systems", help="comma list from sglang,sglang-priority,superinfer (default: profile's; "
                                     "mixed adds sglang-priority)")
    p.add_argument("--noise", action="store_true", help="stock vs stock (two identical sglang runs): the noise")
    p.add_argument("--slo-classes", help="JSON object (or file) name -> {ttft_ms, tbt_ms}; default: profile's")
    p.add_argument("--class-mix", help="e.g. interactive:1,batch:1 (default: profile's)")
    p.add_argument("--ttft-slo-ms", type=float, help="default TTFT SLO; default: profile's")
    p.add_argument("--tbt-slo-ms", type=float, help="default TBT SLO; default: profile's")
    p.add_argument("--kv-tokens", type=int, help="--max-total-tokens for every system")
    p.add_argument("--chunked-prefill", type=int, help="--chunked-prefill-size for every system")
    p.add_argument("--model-path", help="default: the prepared SmolLM2 folder (gpu: a random-weight model)")
    p.add_argument("--dummy-shape", choices=("llama3-8b", "qwen2.5-32b"), help="gpu profile model shape")
    p.add_argument("--cpu-attention", choices=("0", "1"),
                   help="CPU profiles: SUPERINFER_CPU_ATTENTION for every system alike (1: our batched CPU "
                        "attention behind torch_native, 0: SGLang's own torch_native); default: profile's")
    p.add_argument("--server-args", default="", help="extra flags for every server (one string)")
    p.add_argument("--our-args", default="", help="extra flags for our server only (one string)")
    p.add_argument("--out", type=Path, help="output folder (default: results/ab_<profile>_<workload>)")
    p.add_argument("--dry-run", action="store_true", help="write datasets/schedules, print commands, start nothing")
    return p


def resolve_profile(a: argparse.Namespace) -> Profile:
    p = PROFILES[a.profile]
    slo = Slo(a.ttft_slo_ms or p.slo.ttft_ms, a.tbt_slo_ms or p.slo.tbt_ms)
    classes = a.slo_classes or p.slo_classes
    if not classes.strip().startswith("{"):
        classes = Path(classes).read_text()
    SloClasses.parse(classes, default=slo)  # fail early on a bad --slo-classes
    return dataclasses.replace(
        p, slo=slo, slo_classes=json.dumps(json.loads(classes)),
        rates=a.rates or p.rates, num_requests=a.num_requests or p.num_requests,
        kv_tokens=a.kv_tokens or p.kv_tokens, chunked_prefill=a.chunked_prefill or p.chunked_prefill,
        class_mix=a.class_mix or p.class_mix, dummy_model=a.dummy_shape or p.dummy_model,
        server_flags=p.server_flags + tuple(a.server_args.split()),
        our_flags=p.our_flags + tuple(a.our_args.split()),
        env=_with_env(p.env, CPU_ATTENTION_ENV, a.cpu_attention),
    )


def _with_env(env: tuple[tuple[str, str], ...], key: str, value: str | None) -> tuple[tuple[str, str], ...]:
    if value is None:
        return env
    return tuple((k, v) for k, v in env if k != key) + ((key, value),)


def our_flags(p: Profile) -> tuple[str, ...]:
    """Our server learns the same default SLO and classes the harness measures against."""
    return ("--scheduler", "rotasched", "--ttft-slo-ms", f"{p.slo.ttft_ms:g}", "--tbt-slo-ms",
            f"{p.slo.tbt_ms:g}", "--slo-classes", p.slo_classes, *p.our_flags)


def resolve_model(a: argparse.Namespace, p: Profile, out: Path) -> tuple[str, str]:
    """(model path, tokenizer path)."""
    if a.model_path:
        return a.model_path, a.model_path
    from ..model_prep import prepare_default_model

    smol = prepare_default_model()
    if p.dummy_model:
        return str(make_dummy_model(p.dummy_model, smol, out / "model")), str(smol)
    return str(smol), str(smol)


def build_requests(a: argparse.Namespace, p: Profile, tokenizer: object) -> tuple[list[BenchRequest], list[str]]:
    notes: list[str] = []
    classes = SloClasses.parse(p.slo_classes, default=p.slo)
    if a.workload == "trace":
        if not a.trace:
            raise SystemExit("--workload trace needs --trace FILE")
        fit = LengthFit(a.trace_length_scale, p.inputs.hi, p.outputs.hi, min_tokens=1)
        reqs = to_requests(load_trace(a.trace, tokenizer), p.slo, fit, a.trace_start, p.num_requests)
        notes.append(f"trace {a.trace} records {a.trace_start}..{a.trace_start + len(reqs) - 1}, token counts x"
                     f"{a.trace_length_scale:g} clipped to <= {p.inputs.hi} in / {p.outputs.hi} out")
        if "Azure" in Path(a.trace).name:
            notes.append("Azure LLM inference trace 2023, Azure Public Dataset, CC-BY 4.0; Patel et al., "
                         "'Splitwise: Efficient generative LLM inference using phase splitting', ISCA 2024")
        if a.mixed:
            reqs = assign_classes(reqs, parse_mix(p.class_mix), classes, a.seed)
    else:
        reqs = sharegpt_like(p.num_requests, a.seed, p.slo, p.inputs, p.outputs)
        if a.workload == "mixed":
            reqs = assign_classes(reqs, parse_mix(p.class_mix), classes, a.seed)
    return reqs, notes


def build_points(a: argparse.Namespace, p: Profile, reqs: list[BenchRequest]) -> tuple[list[SweepPoint], str]:
    if a.workload == "trace" and a.trace_arrivals == "recorded":
        pts = []
        for scale in a.time_scales:
            arr = tuple(recorded_arrivals(reqs, scale))
            pts.append(SweepPoint(round(offered_rate(arr), 4), arr, f"x{scale:g} time", scale))
        return sorted(pts, key=lambda pt: pt.rate), "recorded"
    pts = [SweepPoint(rate, tuple(poisson_arrivals(len(reqs), rate, a.seed * 1000 + k)), f"{rate:g} req/s")
           for k, rate in enumerate(sorted(p.rates))]
    return pts, "poisson"


def pick_systems(a: argparse.Namespace, p: Profile) -> list:
    table = systems(our_flags(p))
    if a.noise:
        return [table["sglang"], noise_twin(table["sglang"])]
    names = a.systems.split(",") if a.systems else list(p.systems)
    if not a.systems and (a.workload == "mixed" or a.mixed) and "sglang-priority" not in names:
        names.insert(1, "sglang-priority")
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"unknown systems {unknown}; known: {sorted(table)}")
    return [table[n] for n in names]


def build_plan(argv: list[str]) -> tuple[Plan, object]:
    a = parser().parse_args(argv)
    try:
        p = resolve_profile(a)
    except (SloError, OSError, ValueError) as exc:
        raise SystemExit(f"ab_bench: {exc}") from None
    suffix = "_noise" if a.noise else ""
    out = (a.out or REPO / "results" / f"ab_{p.name}_{a.workload}{suffix}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    model, tok_path = resolve_model(a, p, out)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    try:
        reqs, notes = build_requests(a, p, tokenizer)
    except (TraceError, ValueError) as exc:
        raise SystemExit(f"ab_bench: {exc}") from None
    points, mode = build_points(a, p, reqs)
    shared = shared_flags(model, p.kv_tokens, p.chunked_prefill, p.device, p.server_flags)
    plan = Plan(p, a.workload, model, tok_path, a.seed, reqs, points, pick_systems(a, p), shared, out, mode,
                argv=["python", "scripts/ab_bench.py", *argv], noise=a.noise, notes=notes)
    return plan, tokenizer


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    plan, tokenizer = build_plan(argv)
    info = prepare_files(plan, tokenizer)
    config = describe(plan, info)
    if "--dry-run" in argv:
        (plan.out_dir / "plan.json").write_text(json.dumps(config, indent=1, default=str))
        env = " ".join(f"{k}={v}" for k, v in config["shared_server_env"].items())
        for name, cmd in config["server_commands"].items():
            print(f"{name}: {env} python {shlex.join(cmd)}".replace("--port 0", "--port PORT"))
        print("load generator: python -m superinfer_sgl.bench.client --ab-schedule SCHEDULE -- "
              + " ".join(config["bench_serving_args"]))
        print(f"points: {', '.join(pt['label'] for pt in config['points'])}; plan: {plan.out_dir / 'plan.json'}")
        return 0
    try:
        doc = execute(plan, config)
    except KeyboardInterrupt:
        left = stop_all()  # the signal handler already did; this covers an interrupt before it was set
        print(f"ab_bench: interrupted; partial results in {plan.out_dir / 'ab.json'}"
              + (f"; processes left: {left}" if left else ""), file=sys.stderr)
        return 130
    print((plan.out_dir / "table.md").read_text())
    print(f"results: {plan.out_dir / 'ab.json'}, plot: {plan.out_dir / 'attainment.png'}")
    left = {k: v for k, v in doc["processes_left"].items() if v}
    if left:
        print(f"ab_bench: processes left behind: {left}", file=sys.stderr)
        return 3
    return 1 if doc["errors"] else 0
