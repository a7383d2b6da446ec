"""The sweep: for each system start its server, run every sweep point, stop it; then report.

A `Plan` is everything decided before any process starts (requests, schedules, command lines),
so `--dry-run` can print and save it and tests can inspect it without a server.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import requests
from tqdm import tqdm

from .client import ClientError, bench_args, run_client
from .metrics import counter_deltas, outcomes_from_details, parse_prometheus, summarize
from .profiles import Profile
from .prompts import PromptBuilder, priority_by_ttft, write_dataset
from .report import check_targets, markdown_table, noise_band, plot, targets_markdown
from .servers import ServerError, SystemSpec, command, launch
from .workloads import BenchRequest, offered_rate


@dataclass(frozen=True)
class SweepPoint:
    rate: float  # x axis: the Poisson rate, or the offered rate of a replayed trace
    arrivals: tuple[float, ...]
    label: str
    time_scale: float | None = None


@dataclass
class Plan:
    profile: Profile
    workload: str
    model: str
    tokenizer: str
    seed: int
    requests: list[BenchRequest]
    points: list[SweepPoint]
    systems: list[SystemSpec]
    shared: list[str]
    out_dir: Path
    arrival_mode: str  # "poisson" or "recorded"
    argv: list[str] = field(default_factory=list)
    noise: bool = False
    notes: list[str] = field(default_factory=list)


def prepare_files(plan: Plan, tokenizer: Any) -> dict[str, Any]:
    """Datasets (plain and with priorities), schedules and the request table, under out_dir."""
    out = plan.out_dir
    (out / "schedules").mkdir(parents=True, exist_ok=True)
    builder = PromptBuilder(tokenizer)
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
                                         len(plan.requests), plan.seed, Path("OUT.jsonl"), plan.tokenizer),
        "requests": [
            {"prompt_tokens": n, "output_tokens": r.output_tokens, "slo_class": r.slo_class,
             "ttft_slo_ms": r.slo.ttft_ms, "tbt_slo_ms": r.slo.tbt_ms}
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
    except Exception:
        pass
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True, timeout=5, cwd=Path(__file__).parent).stdout.strip()
    except Exception:
        pass
    return info


def scrape(url: str) -> dict[str, float]:
    try:
        return parse_prometheus(requests.get(url + "/metrics", timeout=30).text)
    except requests.RequestException:
        return {}


def run_point(plan: Plan, spec: SystemSpec, server: Any, i: int, pt: SweepPoint, pbar: tqdm) -> dict[str, Any]:
    out = plan.out_dir
    tag = f"{spec.name.replace('#', '_')}_{i:02d}"
    raw = out / "raw" / f"{tag}.jsonl"
    raw.parent.mkdir(exist_ok=True)
    args = bench_args(server.url, dataset_for(plan, spec), len(plan.requests), plan.seed, raw, plan.tokenizer)

    def progress(done: int, total: int) -> None:
        pbar.total = total
        pbar.n = done
        pbar.refresh()

    pbar.reset(total=len(plan.requests))
    pbar.set_description(f"  {spec.name} @ {pt.label}")
    before, load0 = scrape(server.url), os.getloadavg()
    run = run_client(args, out / "schedules" / f"{i:02d}.json", out / "logs" / f"{tag}.client.log", raw,
                     progress, timeout_s=plan.profile.run_timeout_s)
    after = scrape(server.url)
    if not server.alive():
        raise ServerError(f"{spec.name} died during {pt.label}:\n{server.log_tail()}")
    slos = [(r.slo.ttft_ms, r.slo.tbt_ms, r.slo_class) for r in plan.requests]
    outcomes = outcomes_from_details(run.details, slos, [r.output_tokens for r in plan.requests])
    summary = summarize(outcomes, float(run.details["duration"]))
    return {
        "rate": pt.rate, "label": pt.label, "offered_rate": offered_rate(pt.arrivals),
        "summary": asdict(summary), "counters": counter_deltas(before, after),
        "client_wall_s": run.wall_s,
        # 1-minute load average before and after: this machine is shared, so say how busy it was
        "loadavg_1m": [round(load0[0], 2), round(os.getloadavg()[0], 2)],
        "requests": {
            "success": [o.success for o in outcomes],
            "ttft_ms": [round(o.ttft_s * 1000, 3) for o in outcomes],
            "e2e_ms": [round(o.latency_s * 1000, 3) for o in outcomes],
            "output_len": [o.output_len for o in outcomes],
            "n_gaps": [o.n_gaps for o in outcomes],
            "gaps_met": [o.gaps_met for o in outcomes],
            "ttft_slo_ms": [o.ttft_slo_ms for o in outcomes],
            "tbt_slo_ms": [o.tbt_slo_ms for o in outcomes],
            "slo_class": [o.slo_class for o in outcomes],
            "errors": [e[:300] for e in run.details["errors"]],
        },
    }


def execute(plan: Plan, config: dict[str, Any]) -> dict[str, Any]:
    """Run the sweep; results are saved after every point (a Ctrl-C keeps what finished)."""
    results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in plan.systems}
    doc: dict[str, Any] = {"config": config, "results": results, "errors": {}, "processes_left": {}}
    (plan.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    total = len(plan.systems) * len(plan.points)
    sweep = tqdm(total=total, desc="A/B sweep", unit="run", position=0)
    inner = tqdm(total=len(plan.requests), unit="req", position=1, leave=False)
    try:
        for spec in plan.systems:
            sweep.set_postfix_str(f"starting {spec.name}")
            t0 = time.monotonic()
            try:
                log = plan.out_dir / "logs" / f"{spec.name.replace('#', '_')}.server.log"
                server = launch(spec, plan.shared, log, plan.profile.ready_timeout_s, dict(plan.profile.env))
            except ServerError as exc:
                doc["errors"][spec.name] = str(exc)[-3000:]
                sweep.update(len(plan.points))
                continue
            doc.setdefault("startup_s", {})[spec.name] = round(time.monotonic() - t0, 1)
            try:
                for i, pt in enumerate(plan.points):
                    sweep.set_postfix_str(f"{spec.name} @ {pt.label}")
                    results[spec.name].append(run_point(plan, spec, server, i, pt, inner))
                    sweep.update()
                    save(plan, doc)
            except (ClientError, ServerError) as exc:
                doc["errors"][spec.name] = str(exc)[-3000:]
            finally:
                left = server.stop()
                doc["processes_left"][spec.name] = left
                doc.setdefault("servers", {})[spec.name] = {"port": server.port, "pids": sorted(server.pids)}
                save(plan, doc)
    finally:
        inner.close()
        sweep.close()
    finish(plan, doc)
    return doc


def finish(plan: Plan, doc: dict[str, Any]) -> None:
    results = {k: v for k, v in doc["results"].items() if v}
    names = list(results)
    if plan.noise and len(names) >= 2:
        doc["noise_band"] = noise_band(results, names[0], names[1])
    elif "sglang" in results and "superinfer" in results:
        doc["targets"] = check_targets(results, "sglang", "superinfer")
    save(plan, doc)
    if results:
        title = f"{plan.profile.name} / {plan.workload}: {doc['config']['machine'].get('cpu', '')}"
        plot(results, plan.out_dir / "attainment.png", title)
    (plan.out_dir / "table.md").write_text(render_markdown(plan, doc))


def render_markdown(plan: Plan, doc: dict[str, Any]) -> str:
    cfg = doc["config"]
    results = {k: v for k, v in doc["results"].items() if v}
    lines = [f"# A/B: {cfg['profile']} profile, {cfg['workload']} workload ({cfg['date_utc']})", "",
             f"command: `{' '.join(cfg['argv'])}`", "",
             f"SLO default TTFT {cfg['slo_default']['ttft_ms']:g} ms / TBT {cfg['slo_default']['tbt_ms']:g} ms; "
             f"KV budget {cfg['kv_tokens']} tokens; chunked prefill {cfg['chunked_prefill']}", ""]
    if results:
        lines += [markdown_table(results)]
    if "targets" in doc:
        lines += ["Targets:", targets_markdown(doc["targets"])]
    if "noise_band" in doc:
        lines += ["Noise (largest |A-B| over rates; attainment in points):",
                  ", ".join(f"{k} {v:.2f}" for k, v in doc["noise_band"].items()), ""]
    if doc["errors"]:
        lines += ["Errors:", *(f"- {k}: {v.splitlines()[0] if v else ''}" for k, v in doc["errors"].items()), ""]
    return "\n".join(lines) + "\n"


def save(plan: Plan, doc: dict[str, Any]) -> None:
    path = plan.out_dir / "ab.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)
