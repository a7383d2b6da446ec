"""What a run writes before any server starts, and the reproducibility block of its JSON.

prepare_files: datasets (plain and with priorities) and arrival schedules under the output folder.
describe: what ran, how, where, when (the "config" of ab.json; --dry-run prints it as plan.json).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .client import bench_args
from .planning import Plan
from .prompts import QUESTION, PromptBuilder, priority_by_ttft, write_dataset
from .servers import SystemSpec, command
from .workloads import offered_rate


def prepare_files(plan: Plan, tokenizer: Any) -> dict[str, Any]:
    """Datasets (plain and with priorities), schedules and the request table, under out_dir."""
    out = plan.out_dir
    if (out / "schedules").is_dir():  # a previous run's extra points must not be mistaken for ours
        for old in (out / "schedules").glob("*.json"):
            old.unlink()
    (out / "schedules").mkdir(parents=True, exist_ok=True)
    builder = PromptBuilder(tokenizer, None if plan.ignore_eos else QUESTION)
    lens = write_dataset(out / "dataset.jsonl", plan.requests, builder)
    write_dataset(out / "dataset_priority.jsonl", plan.requests, builder, priority_by_ttft(plan.requests))
    for i, pt in enumerate(plan.points):
        (out / "schedules" / f"{i:02d}.json").write_text(json.dumps({"label": pt.label, "rate": pt.rate,
                                                                      "arrivals_s": list(pt.arrivals)}))
    return {"prompt_tokens": lens, "min_prompt_tokens": builder.min_tokens}


def dataset_for(plan: Plan, spec: SystemSpec) -> Path:
    return plan.out_dir / ("dataset_priority.jsonl" if spec.uses_priority else "dataset.jsonl")


def describe(plan: Plan, prompt_info: dict[str, Any]) -> dict[str, Any]:
    """The reproducibility block of the JSON: what ran, how, where, when."""
    p = plan.profile
    prio = priority_by_ttft(plan.requests)  # sent only to the sglang-priority baseline
    return {
        "profile": p.name,
        "workload": plan.workload,
        "arrivals": plan.arrival_mode,
        "argv": plan.argv,
        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "model": plan.model,
        "seed": plan.seed,
        "num_requests": len(plan.requests),
        "kv_tokens": p.kv_tokens,
        "chunked_prefill": p.chunked_prefill,
        "slo_default": {"ttft_ms": p.slo.ttft_ms, "tbt_ms": p.slo.tbt_ms},
        "slo_classes": json.loads(p.slo_classes),
        "shared_server_flags": plan.shared,
        "shared_server_env": dict(p.env),
        "server_commands": {s.name: command(s, plan.shared, 0)[1:] for s in plan.systems},
        "load_generator": "sglang.benchmark.serving (bench_serving) cli_main, backend sglang-oai-chat, "
                          "dataset openai; arrival schedule from our schedule files",
        "bench_serving_args": bench_args("http://127.0.0.1:PORT", plan.out_dir / "dataset.jsonl",
                                         len(plan.requests), plan.seed, Path("OUT.jsonl"), plan.tokenizer,
                                         ignore_eos=plan.ignore_eos),
        "ignore_eos": plan.ignore_eos,
        "max_new_tokens": getattr(plan.options, "max_new_tokens", None),
        "requests": [
            {"prompt_tokens": n, "output_tokens": r.output_tokens, "slo_class": r.slo_class,
             "ttft_slo_ms": r.slo.ttft_ms, "tbt_slo_ms": r.slo.tbt_ms, "priority": prio(r)}
            for r, n in zip(plan.requests, prompt_info["prompt_tokens"])
        ],
        "points": [{"label": pt.label, "rate": pt.rate, "offered_rate": offered_rate(pt.arrivals),
                    "time_scale": pt.time_scale, "span_s": max(pt.arrivals)} for pt in plan.points],
        "notes": plan.notes + list(p.notes),
    }


# CPU extensions that move a CPU server's speed several-fold: the shared dev VM has been an "AMD
# EPYC" with AVX-512 BF16 and one with AVX2 only (the same model name), bf16 decode steps ~10x apart.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's model name and which of ISA_FLAGS it has (/proc/cpuinfo; `cpuinfo`: its text)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    cpu, flags = "", None
    for line in cpuinfo.splitlines():  # (the first core's lines: every core reads the same)
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not cpu:
            cpu = value.strip()
        elif key == "flags" and flags is None:
            flags = set(value.split())
    return {"cpu": cpu or platform.processor() or "", "isa": [f for f in ISA_FLAGS if f in (flags or ())]}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {**cpu_info(), "cores": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform()}
    try:
        from importlib.metadata import version

        info["sglang"] = version("sglang")
    except ImportError:  # PackageNotFoundError: no sglang in this environment
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True, timeout=5, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):  # no git here, or it hung
        pass
    return info
