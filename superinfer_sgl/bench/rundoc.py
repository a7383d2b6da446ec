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


def machine() -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
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
