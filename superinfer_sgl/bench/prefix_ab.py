"""The prefix-cache A/B: ours (`--prefix-cache predictive`) against stock SGLang with each of its
eviction policies (lru, lfu, slru, tlru), on workloads with reuse under KV pressure and a control
without reuse (bench/prefix_workloads.py).

    python -m superinfer_sgl.bench.prefix_ab --out results/prefix_cache/ab.json

Every arm gets the same model, KV pool (--max-total-tokens), prefill chunk and CPU attention (the
stock servers run with SUPERINFER_CPU_COMPAT=1, which switches on the same batched CPU attention
and fast ops ours uses: equal attention speed). Ours runs our launcher with `--scheduler sglang`,
so SGLang's scheduling is unchanged and the prefix cache is the only difference. One server per
arm serves every workload and repeat (the cache flushed in between); arms run one after another
in an order that rotates between repeats. Run one after another, the arms meet the machine at
different speeds (a shared 2-core VM drifts by tens of percent within minutes): each arm's repeats
are reported apart, and the differences' 95% intervals are paired bootstraps over the same requests
(bench/prefix_stats.py), which do not contain that drift.

`--paired` runs ours beside each stock arm instead, at the same time on the same arrival schedule,
each server on its own half of the cores (bench/paired.py; the halves swap from pair to pair), so a
slow phase of the machine hits both sides of a comparison. Each side has half the machine: rates
that contend two cores contend one core more.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import requests

from . import abfile
from .paired import core_halves
from .prefix_client import run_workload, run_workload_on_each
from .prefix_stats import OURS, plot, summarize
from .prefix_workloads import WORKLOADS, conversations, tenants, unique
from .servers import OUR_MODULE, STOCK_MODULE, SystemSpec, launch, shared_flags

PYTHON_TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"  # SGLang 0.5.23: rust (default) or python
DEFAULT_MODEL = os.path.expanduser("~/.cache/superinfer_sgl/models/SmolLM2-135M-Instruct")


def arms(tlru_threshold: int, tlru_next: int, host_tokens: int = 800,
         slo_ms: tuple[float, float] | None = None) -> dict[str, SystemSpec]:
    """Every arm by name. slo_ms (TTFT, TBT): the SLOs the run measures against, which the arms
    with our SLO-aware scheduler are told (without them those arms are not offered)."""
    stock = {p: SystemSpec(f"sglang-{p}", STOCK_MODULE, ("--radix-eviction-policy", p))
             for p in ("lru", "lfu", "slru")}
    tlru_cfg = json.dumps({"threshold": tlru_threshold, "next_prompt_estimate": tlru_next})
    stock["tlru"] = SystemSpec("sglang-tlru", STOCK_MODULE,
                               ("--radix-eviction-policy", "tlru", "--radix-eviction-policy-config", tlru_cfg))
    # stock LRU on SGLang's Python tree core, the one ours needs (its Rust core never calls a
    # Python strategy): beside ours it separates the core's cost from the predictor's
    stock["lru-pycore"] = SystemSpec("sglang-lru-pycore", STOCK_MODULE, ("--radix-eviction-policy", "lru"),
                                     env=((PYTHON_TREE_CORE_ENV, "python"),))
    ours = SystemSpec("ours-predictive", OUR_MODULE, ("--scheduler", "sglang", "--prefix-cache", "predictive",
                                                      "--prefix-host-tokens", "0"))
    # the host tier at a budget of host_tokens (prefix_host.py): demoted prefixes restored on a match
    host = SystemSpec("ours-predictive-host", OUR_MODULE, ("--scheduler", "sglang", "--prefix-cache", "predictive",
                                                          "--prefix-host-tokens", str(host_tokens)))
    # our launcher and layer with SGLang's own radix cache: beside a stock arm, what ours costs
    # without the predictive cache (the control's reference)
    radix = SystemSpec("ours-radix", OUR_MODULE, ("--scheduler", "sglang", "--prefix-cache", "radix"))
    table = {"predictive": ours, "predictive+host": host, "ours-radix": radix, **stock}
    if slo_ms is not None:
        # the product as shipped: our default scheduler (RotaSched, goodput) told the SLOs the run
        # measures, with SGLang's radix cache (the scheduler's share of a difference) and with the
        # predictive cache and its host tier (scheduler and cache together)
        slo = ("--ttft-slo-ms", f"{slo_ms[0]:g}", "--tbt-slo-ms", f"{slo_ms[1]:g}")
        table["goodput-radix"] = SystemSpec("ours-goodput-radix", OUR_MODULE, ("--prefix-cache", "radix", *slo))
        table["goodput+predictive+host"] = SystemSpec(
            "ours-goodput-predictive-host", OUR_MODULE,
            ("--prefix-cache", "predictive", "--prefix-host-tokens", str(host_tokens), *slo))
    return table


def build(kind: str, seed: int, rate: float, duration_s: float) -> list[Any]:
    return {"tenants": tenants, "conversations": conversations, "unique": unique}[kind](seed, rate, duration_s)


def _flush(url: str) -> None:
    for _ in range(20):
        if requests.post(url + "/flush_cache", timeout=30).status_code == 200:
            return
        time.sleep(0.5)  # refused while requests are still in flight


def pair_schedule(names: list[str], repeats: int) -> list[tuple[int, str, str, bool]]:
    """(repeat, our arm, stock arm, swapped) for every run of `--paired`: each of our arms beside
    each stock arm once per repeat, the pairs' order rotated between repeats, and the sides' cores
    swapped from one run to the next (`swapped`: ours on the second half), so neither side keeps
    the core that serves the machine's interrupts."""
    ours = [n for n in names if n in OURS]
    stock = [n for n in names if n not in OURS]
    if not ours or not stock:
        raise ValueError(f"--paired needs one of our arms ({', '.join(OURS)}) and a stock arm; got {names}")
    pairs = [(o, s) for o in ours for s in stock]
    out = []
    for rep in range(repeats):
        for o, s in pairs[rep % len(pairs):] + pairs[:rep % len(pairs)]:
            out.append((rep, o, s, len(out) % 2 == 1))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    fixed = None if args.ttft_slo_ms is None or args.tbt_slo_ms is None else (args.ttft_slo_ms, args.tbt_slo_ms)
    table = arms(args.tlru_threshold, args.tlru_next, args.host_tokens, fixed)
    names = [n for n in args.arms.split(",") if n]
    unknown = [n for n in names if n not in table]
    if unknown:
        need = " (the goodput arms need --ttft-slo-ms and --tbt-slo-ms: our scheduler is told them)" \
            if any(n.startswith("goodput") for n in unknown) else ""
        raise SystemExit(f"unknown arm(s) {', '.join(unknown)}; offered: {', '.join(table)}{need}")
    kinds = [k for k in args.workloads.split(",") if k]
    rates = dict(zip(WORKLOADS, (args.rate_tenants, args.rate_conversations, args.rate_unique)))
    shared = shared_flags(args.model, args.kv_tokens, args.chunked_prefill, "cpu")
    out_dir = Path(args.out).parent
    out_dir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []

    def record(rep: int, arm: str, kind: str, t_start: float, res: dict[str, Any], **extra: Any) -> None:
        runs.append({"arm": arm, "rep": rep, "kind": kind, "rate": rates[kind], "started": t_start, **extra, **res})
        partial = abfile.stem(Path(args.out)).with_suffix(".partial.json")
        partial.write_text(json.dumps({"runs": runs, "args": vars(args)}))
        print(f"[prefix_ab] rep {rep} {arm}{' beside ' + extra['beside'] if 'beside' in extra else ''} "
              f"{kind}: {len(res['records'])} requests in {res['wall_s']:.0f}s", flush=True)

    if args.paired:
        halves = core_halves()
        for rep, ours, base, swapped in pair_schedule(names, args.repeats):
            sides = ((ours, halves[1]), (base, halves[0])) if swapped else ((ours, halves[0]), (base, halves[1]))
            t_start = time.time()
            servers = []
            try:
                for name, cores in sides:
                    log = out_dir / "logs" / f"{name}.beside-{base if name == ours else ours}.rep{rep}.log"
                    servers.append(launch(table[name], shared, log, ready_timeout_s=600, cores=cores))
                for kind in kinds:
                    for server in servers:
                        _flush(server.url)
                    work = build(kind, args.seed + rep, rates[kind], args.duration)
                    results = run_workload_on_each([sv.url for sv in servers], kind, work, [c for _, c in sides])
                    for (name, cores), res, other in zip(sides, results, (base, ours)):
                        record(rep, name, kind, t_start, res, pair=base, beside=other, cores=sorted(cores))
            finally:
                for server in servers:
                    server.stop()
        return {"runs": runs}

    for rep in range(args.repeats):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for name in order:
            spec = table[name]
            log = out_dir / "logs" / f"{name}.rep{rep}.log"
            t_start = time.time()
            server = launch(spec, shared, log, ready_timeout_s=600)
            try:
                for kind in kinds:
                    _flush(server.url)
                    work = build(kind, args.seed + rep, rates[kind], args.duration)
                    record(rep, name, kind, t_start, run_workload(server.url, kind, work))
            finally:
                server.stop()
    return {"runs": runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/prefix_cache/ab.json", help="result file (gzipped if it ends in .gz)")
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--arms", default="predictive,lru,lfu,slru,tlru")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--kv-tokens", type=int, default=800, help="--max-total-tokens of every arm (KV pressure)")
    ap.add_argument("--chunked-prefill", type=int, default=512)
    ap.add_argument("--host-tokens", type=int, default=800, help="--prefix-host-tokens of the predictive+host arm")
    ap.add_argument("--duration", type=float, default=45.0, help="seconds of arrivals per workload")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--paired", action="store_true",
                    help="run ours beside each stock arm at the same time, each on half the cores "
                         "(differences then keep little of the machine's drift; each side is slower)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rate-tenants", type=float, default=1.0)
    ap.add_argument("--rate-conversations", type=float, default=0.3)
    ap.add_argument("--rate-unique", type=float, default=0.5)
    ap.add_argument("--ttft-slo-ms", type=float, default=None,
                    help="default: 2x the no-reuse control's median TTFT, pooled over arms (prefix_stats)")
    ap.add_argument("--tbt-slo-ms", type=float, default=None, help="default: 2x the control's median TBT")
    ap.add_argument("--tlru-threshold", type=int, default=64,
                    help="T-LRU's TTFT budget in tokens (what one prefill step covers within the TTFT SLO)")
    ap.add_argument("--tlru-next", type=int, default=11, help="T-LRU's next-prompt estimate: a user turn")
    ap.add_argument("--resummarize", help="recompute the summary of an existing result file")
    args = ap.parse_args(argv)
    if args.resummarize:
        doc = abfile.read_json(Path(args.resummarize))
        doc["summary"] = summarize(doc["runs"], doc["config"]["ttft_slo_ms"], doc["config"]["tbt_slo_ms"])
        abfile.write_json(Path(args.resummarize), doc)
        plot(doc["summary"], str(abfile.stem(Path(args.resummarize)).with_suffix(".png")))
        return 0
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    doc = run(args)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc["config"] = {**vars(args), "command": " ".join([sys.executable, "-m", __spec__.name, *(argv or sys.argv[1:])]),
                     "started_utc": started, "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                     "machine": f"{platform.node()} {platform.processor() or platform.machine()}, "
                                f"{os.cpu_count()} cores", "commit": commit}
    doc["summary"] = summarize(doc["runs"], args.ttft_slo_ms, args.tbt_slo_ms)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    abfile.write_json(Path(args.out), doc)  # (gzipped when --out ends in .gz)
    plot(doc["summary"], str(abfile.stem(Path(args.out)).with_suffix(".png")))
    print(json.dumps(doc["summary"]["table"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
