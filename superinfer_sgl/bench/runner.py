"""The sweep: start the servers, (calibrate,) run every point on every system, stop, report.

Interleaved order (default): every server stays up (idle with --sleep-on-idle) and each rate runs
on every system back to back, the order alternating from rate to rate (A B, B A, ...), so slow
drifts in a shared machine's background load hit both systems alike. Sequential order: one server at a time, all its rates ("in turn").
"""

from __future__ import annotations

import functools
import json
import os
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import requests
from tqdm import tqdm

from superinfer_patches.step_log import STEP_LOG_ENV

from . import kv_pool, recompute
from .client import ClientError, bench_args, run_client
from .metrics import counter_deltas, outcomes_from_details, parse_prometheus, summarize
from .calibrate import ProbeError, Speed, derive, probe, probe_prompts
from .paired import core_halves, pairs_for
from .planning import Plan, SweepPoint, explicit_slos, for_repeat, mean_lengths, recalibrated
from .prompts import PromptBuilder
from .rundoc import dataset_for, describe, prepare_files
from .analysis import analyse, multi_run, record_roles
from .servers import ServerError, SystemSpec, launch
from .workloads import offered_rate


def scrape(url: str) -> dict[str, float]:
    try:
        text = requests.get(url + "/metrics", timeout=30).text
    except requests.RequestException:
        return {}
    return {**parse_prometheus(text), **recompute.labelled(text)}


def run_point(plan: Plan, spec: SystemSpec, server: Any, i: int, pt: SweepPoint, pbar: tqdm,
              sync: threading.Barrier | None = None, partner: str | None = None) -> dict[str, Any]:
    """One system at one sweep point. Paired mode: `sync` is shared with the partner's thread, so
    both load generators start together once both speed probes are done."""
    out = plan.out_dir
    tag = f"{spec.name.replace('#', '_')}_{i:02d}" + (f"_vs_{partner.replace('#', '_')}" if partner else "")
    raw = out / "raw" / f"{tag}.jsonl"
    raw.parent.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    args = bench_args(server.url, dataset_for(plan, spec), len(plan.requests), plan.seed, raw, plan.tokenizer,
                      backend="vllm-chat" if spec.is_vllm else "sglang-oai-chat", ignore_eos=plan.ignore_eos)

    def progress(done: int, total: int) -> None:
        pbar.total = total
        pbar.n = done
        pbar.refresh()

    pbar.reset(total=len(plan.requests))
    pbar.set_description(f"  {spec.name} @ {pt.label}")
    speed = point_probe(plan, spec, server, i)
    before = scrape(server.url)
    if sync is not None:
        sync.wait()
    load0, t0 = os.getloadavg(), time.time()
    run = run_client(args, out / "schedules" / f"{i:02d}.json", out / "logs" / f"{tag}.client.log", raw,
                     progress, timeout_s=plan.profile.run_timeout_s, cores=server.cores)
    after = scrape(server.url)
    if not server.alive():
        raise ServerError(f"{spec.name} died during {pt.label}:\n{server.log_tail()}")
    slos = [(r.slo.ttft_ms, r.slo.tbt_ms, r.slo_class) for r in plan.requests]
    # A failed request misses every gap it was to have: its length, known only for fixed-length
    # requests (one that could stop at EOS counts none rather than its whole bound).
    expected = [r.output_tokens if plan.ignore_eos else 0 for r in plan.requests]
    outcomes = outcomes_from_details(run.details, slos, expected)
    summary = summarize(outcomes, float(run.details["duration"]))
    return {
        "rate": pt.rate, "label": pt.label, "offered_rate": offered_rate(pt.arrivals),
        "repeat": plan.repeat, "seed": plan.seed, "paired_with": partner,
        "cores": sorted(server.cores) if server.cores else None,
        "summary": asdict(summary), "counters": counter_deltas(before, after),
        "recompute": recompute.deltas(before, after),  # prefill tokens computed again (bench/recompute.py)
        "client_wall_s": run.wall_s,
        # unix time around the client run: cuts this point's iterations out of the step log
        "window_unix": [round(t0, 3), round(time.time(), 3)],
        # the server's speed just before this point (a shared machine drifts by tens of percent
        # within minutes): what a replay scales its cost profile to
        "speed_probe": None if speed is None else {**asdict(speed), "prompt_tokens": plan_probe_tokens(plan),
                                                    "out_tokens": POINT_PROBE_OUT_TOKENS},
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


POINT_PROBE_BATCHES = (1, 4)
POINT_PROBE_OUT_TOKENS = 16


@functools.lru_cache(maxsize=2)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def plan_probe_tokens(plan: Plan) -> int:
    return int(mean_lengths(plan.profile, plan.seed)[0])


def point_probe(plan: Plan, spec: SystemSpec, server: Any, i: int) -> Speed | None:
    """A short speed probe (one lone request, then a batch of 4) of the server about to run point i,
    with prompts no other probe or point uses (no cache hits)."""
    if not getattr(plan.options, "point_probes", True) or spec.is_vllm:  # the probe streams SGLang's /generate
        return None
    tokenizer = _tokenizer(plan.tokenizer)
    builder, n_tok = PromptBuilder(tokenizer), plan_probe_tokens(plan)
    first = 200_000 + 1000 * plan.systems.index(spec) + 20 * i
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": builder.build(first + k, n_tok)[0]}],
                                           tokenize=False, add_generation_prompt=True)
             for k in range(probe_prompts(POINT_PROBE_BATCHES, 1))]
    try:
        return probe(server.url, texts, n_tok, out_tokens=POINT_PROBE_OUT_TOKENS, batches=POINT_PROBE_BATCHES,
                     repeats=1)
    except ProbeError as exc:  # the server stopped answering: this system fails, the sweep goes on
        raise ServerError(str(exc)) from exc


class Sweep:
    """Server lifetimes and progress bars of one run; every server is stopped in `close`."""

    def __init__(self, plan: Plan, doc: dict[str, Any]) -> None:
        self.plan, self.doc = plan, doc
        self.servers: dict[str, Any] = {}
        self.failed: set[str] = set()
        self.bar = tqdm(total=runs_per_repeat(plan) * plan.repeats, desc="A/B sweep", unit="run", position=0)
        self.inners = [tqdm(total=len(plan.requests), unit="req", position=1 + k, leave=False)
                       for k in range(2 if plan.paired else 1)]
        self.inner = self.inners[0]

    def start(self, spec: SystemSpec, cores: frozenset[int] | None = None) -> Any:
        self.bar.set_postfix_str(f"starting {spec.name}")
        stem = self.plan.out_dir / "logs" / spec.name.replace("#", "_")
        # every server logs its iterations (measurement only): what `sim --validate` calibrates to
        env = {**dict(self.plan.profile.env), STEP_LOG_ENV: f"{stem.resolve()}.steps.jsonl"}
        t0 = time.monotonic()
        try:
            server = launch(spec, self.plan.shared, Path(f"{stem}.server.log"), self.plan.profile.ready_timeout_s, env,
                            cores)
        except ServerError as exc:
            self.fail(spec, exc)
            return None
        self.doc.setdefault("startup_s", {})[spec.name] = round(time.monotonic() - t0, 1)
        self.servers[spec.name] = server
        if not spec.is_vllm and not self._pool_agrees(spec, server):
            self.stop(spec)
            return None
        return server

    def _pool_agrees(self, spec: SystemSpec, server: Any) -> bool:
        """Record the server's KV pool size; False (the system failed, loudly) when it differs from
        the pool of a system started before it (kv_pool.py says why that matters)."""
        tokens, source = kv_pool.pool_tokens(server.url, server.log_path)
        pools = self.doc.setdefault("kv_pool_tokens", {})
        pools[spec.name] = tokens
        self.doc.setdefault("kv_pool_source", {})[spec.name] = source
        try:
            kv_pool.check_same(pools, self.plan.profile.kv_tokens)
        except kv_pool.KvPoolMismatch as exc:
            self.fail(spec, exc)
            self.doc["errors"]["kv_pool"] = str(exc)
            print(f"ab_bench: error: {exc}", file=sys.stderr)
            return False
        return True

    def run(self, plan: Plan, spec: SystemSpec, i: int, pt: SweepPoint) -> None:
        server = self.servers.get(spec.name)
        if server is not None and spec.name not in self.failed:
            self.bar.set_postfix_str(f"{spec.name} @ {pt.label}")
            try:
                self.doc["results"][spec.name].append(run_point(plan, spec, server, i, pt, self.inner))
            except (ClientError, ServerError) as exc:
                self.fail(spec, exc)
                self.stop(spec)
        self.bar.update()
        save(self.plan, self.doc)

    def run_pair(self, plan: Plan, i: int, pt: SweepPoint, pair: tuple[SystemSpec, SystemSpec],
                 cores: tuple[frozenset[int], frozenset[int]]) -> None:
        """Both systems of a pair at once, each on its cores, load generators started together."""
        servers = [self.servers.get(s.name) for s in pair]
        if any(sv is None for sv in servers) or any(s.name in self.failed for s in pair):
            self.bar.update()
            return
        self.bar.set_postfix_str(f"{pair[0].name} | {pair[1].name} @ {pt.label}")
        for server, c in zip(servers, cores):
            server.pin(c)
        sync = threading.Barrier(2, timeout=self.plan.profile.ready_timeout_s)  # never wait forever on a partner
        got: list[Any] = [None, None]

        def work(k: int) -> None:
            try:
                got[k] = run_point(plan, pair[k], servers[k], i, pt, self.inners[k], sync, pair[1 - k].name)
            except threading.BrokenBarrierError:
                return  # not run: the partner's error, or the timeout recorded below, says why
            except Exception as exc:  # noqa: BLE001 - handed to the main thread below
                got[k] = exc
                sync.abort()  # the partner must not wait for a run that will not start

        threads = [threading.Thread(target=work, args=(k,)) for k in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        if got == [None, None]:  # the barrier timed out: neither side ran; say so, do not drop it silently
            self.doc["errors"][f"{pair[0].name} | {pair[1].name} @ {pt.label} (repeat {plan.repeat})"] = \
                "paired run skipped: the two sides did not both reach the start within the timeout"
        for spec, res in zip(pair, got):
            if isinstance(res, (ClientError, ServerError)):
                self.fail(spec, res)
                self.stop(spec)
            elif isinstance(res, Exception):  # a bug in the harness: stop the sweep (servers are stopped)
                raise res
            elif res is not None:
                self.doc["results"][spec.name].append(res)
        self.bar.update()
        save(self.plan, self.doc)

    def fail(self, spec: SystemSpec, exc: Exception) -> None:
        self.failed.add(spec.name)
        self.doc["errors"][spec.name] = str(exc)[-3000:]

    def stop(self, spec: SystemSpec) -> None:
        server = self.servers.pop(spec.name, None)
        if server is None:
            return
        self.doc["processes_left"][spec.name] = server.stop()
        self.doc.setdefault("servers", {})[spec.name] = {"port": server.port, "pids": sorted(server.pids)}
        save(self.plan, self.doc)

    def close(self) -> None:
        for spec in self.plan.systems:
            self.stop(spec)
        for bar in self.inners:
            bar.close()
        self.bar.close()


def runs_per_repeat(plan: Plan) -> int:
    """Runs (paired mode: pairs run at once) of one repeat of the sweep."""
    return len(plan.points) * (len(pairs_for(plan.systems)) if plan.paired else len(plan.systems))


def calibrate(sweep: Sweep, server: Any, tokenizer: Any, t_start: float) -> Plan:
    """Probe the first server, derive SLOs / rates / N, and return the re-built plan."""
    plan = sweep.plan
    sweep.bar.set_postfix_str("calibrating (speed probe)")
    mean_in, mean_out = mean_lengths(plan.profile, plan.seed)
    builder = PromptBuilder(tokenizer)
    texts, n_tok = [], int(mean_in)
    knobs = plan.profile.knobs
    for k in range(probe_prompts(knobs.probe_batches, knobs.probe_repeats)):
        content, _ = builder.build(100_000 + k, n_tok)
        texts.append(tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True))
    speed = probe(server.url, texts, n_tok, out_tokens=knobs.probe_out_tokens, batches=knobs.probe_batches,
                  repeats=knobs.probe_repeats)
    startup = sweep.doc.get("startup_s", {}).get(plan.systems[0].name, 120.0)
    n_sys = runs_per_repeat(plan) // max(1, len(plan.points)) * plan.repeats  # runs one after another per rate
    cal = derive(speed, plan.profile.kv_tokens, mean_in, mean_out, plan.profile.knobs, n_sys,
                 time.monotonic() - t_start, startup, plan.profile.num_requests)
    kept = [k for k, on in (("slos", explicit_slos(plan.options)), ("rates", plan.options.rates is not None)) if on]
    sweep.doc["calibration"] = {**asdict(cal), "mean_prompt_tokens": mean_in, "mean_output_tokens": mean_out,
                                "knobs": asdict(plan.profile.knobs), "probe_server": plan.systems[0].name,
                                "kept_as_given": kept}
    new = recalibrated(plan, cal, tokenizer)
    sweep.plan = new
    sweep.bar.reset(total=runs_per_repeat(new) * new.repeats)
    return new


def execute(plan: Plan, tokenizer: Any) -> dict[str, Any]:
    """Run the sweep; results are saved after every point (a Ctrl-C keeps what finished)."""
    t_start = time.monotonic()
    (plan.out_dir / "logs").mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict[str, Any]]] = {s.name: [] for s in plan.systems}
    doc: dict[str, Any] = {"config": {}, "results": results, "errors": {}, "processes_left": {}}
    pairs = pairs_for(plan.systems) if plan.paired else []
    halves = core_halves() if plan.paired else None
    # paired: a server starts on the cores of its side in its first pair (re-pinned before each run)
    home = {p[k].name: halves[k] for p in reversed(pairs) for k in (0, 1)} if halves else {}
    sweep = Sweep(plan, doc)
    try:
        first = sweep.start(plan.systems[0], home.get(plan.systems[0].name))
        if first is None:  # the others share its flags (and its device): starting them would only wait too
            doc["errors"]["sweep"] = f"stopped: the first system ({plan.systems[0].name}) did not start"
            doc["config"] = describe(plan, prepare_files(plan, tokenizer))
            return _finish(plan, doc, sweep, t_start)
        if plan.calibrate:
            try:
                plan = calibrate(sweep, first, tokenizer, t_start)
            except ProbeError as exc:  # nothing to derive the SLOs and rates from: stop, saying why
                doc["errors"]["calibration"] = str(exc)
                doc["config"] = describe(plan, prepare_files(plan, tokenizer))
                return _finish(plan, doc, sweep, t_start)
            pairs = pairs_for(plan.systems) if plan.paired else []  # ours' flags now carry the calibrated SLOs
        doc["config"] = describe(plan, prepare_files(plan, tokenizer))
        doc["config"] |= {"order": "paired" if plan.paired else plan.options.order, "repeats": plan.repeats,
                          "pairs": [[a.name, b.name] for a, b in pairs],
                          "core_halves": [sorted(h) for h in halves] if halves else None}
        if plan.paired or plan.interleaved:
            for spec in plan.systems[1:]:
                sweep.start(spec, home.get(spec.name))
        for k in range(plan.repeats):
            rplan = for_repeat(plan, k, tokenizer)
            if k > 0:
                prepare_files(rplan, tokenizer)
                doc["config"].setdefault("repeat_runs", []).append(
                    {"repeat": k, "seed": rplan.seed, "dir": rplan.out_dir.name,
                     "points": [{"label": pt.label, "rate": pt.rate, "offered_rate": offered_rate(pt.arrivals)}
                                for pt in rplan.points]})
            run_repeat(sweep, rplan, k, pairs, halves)
    finally:
        sweep.close()
    return _finish(plan, doc, sweep, t_start)


def _finish(plan: Plan, doc: dict[str, Any], sweep: Sweep, t_start: float) -> dict[str, Any]:
    sweep.close()
    doc["wall_s"] = round(time.monotonic() - t_start, 1)
    finish(plan, doc)
    return doc


def run_repeat(sweep: Sweep, plan: Plan, k: int, pairs: list[tuple[SystemSpec, SystemSpec]],
               halves: tuple[frozenset[int], frozenset[int]] | None) -> None:
    """One repeat of the sweep, in the plan's order."""
    if halves is not None:
        for i, pt in enumerate(plan.points):
            cores = halves if (i + k) % 2 == 0 else (halves[1], halves[0])  # sides swap cores point to point
            for pair in pairs:
                sweep.run_pair(plan, i, pt, pair, cores)
    elif plan.interleaved:
        for i, pt in enumerate(plan.points):
            for spec in (plan.systems if (i + k) % 2 == 0 else plan.systems[::-1]):
                sweep.run(plan, spec, i, pt)
    else:
        for spec in plan.systems:
            if spec.name not in sweep.servers and spec.name not in sweep.failed:
                sweep.start(spec)
            for i, pt in enumerate(plan.points):
                sweep.run(plan, spec, i, pt)
            sweep.stop(spec)


def finish(plan: Plan, doc: dict[str, Any]) -> None:
    results = {k: v for k, v in doc["results"].items() if v}
    doc["recompute_tax"] = {name: recompute.pooled_tax(pts) for name, pts in results.items()}
    cfg = doc["config"]
    cfg.setdefault("repeats", plan.repeats)
    try:
        pairs = pairs_for(plan.systems)
    except ValueError:  # one system repeated: pooled figures only, nothing to compare
        pairs = []
    cfg.setdefault("pairs", [[a.name, b.name] for a, b in pairs] if plan.paired else [])
    compared = [(a.name, b.name) for a, b in pairs] if multi_run(cfg) else []
    record_roles(cfg, [s.name for s in plan.systems if s.ours], compared)
    analyse(doc, plan.out_dir)
    save(plan, doc)


def save(plan: Plan, doc: dict[str, Any]) -> None:
    path = plan.out_dir / "ab.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    tmp.replace(path)
