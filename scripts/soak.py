"""Fault soak: many requests at several times capacity, with faults injected, every request
accounted for, and the server's own counters back at zero once idle (issue 17).

Starts a server (ours, or stock SGLang with --system stock, same shared flags), measures its
capacity with a short closed-loop calibration, then sends --requests requests as Poisson arrivals
at --load times that capacity: a mix of SLO classes (custom_params, service_tier, x-smg-priority),
prompts from a few tokens to over the KV pool (those must be refused with a 400), and faults drawn
at random:

  disconnect   a streaming client closes its connection after a few chunks (many are rotary then:
               ours runs with SUPERINFER_TEST_ROTATE_INTERVAL forcing rotations)
  timeout      a client gives up while its request still waits (read timeout), then closes
  abort        SGLang's /abort_request with the request's rid, after a random delay
  burst        a burst of long-output requests at once: rotations beyond the small host pool
               (--rotary-pool-gb) take the recompute fallback
  constrained  a regex or JSON-schema constrained request
  n2           n=2 samples of one prompt
  exact        a fixed prompt whose greedy tokens must equal the same prompt served alone on the
               quiet server before the load (float32)
  sigterm      (--sigterm-at F) SIGTERM to the server after a share F of the arrivals, let SGLang's
               graceful drain finish the requests in flight (at most --sigterm-drain-s), check that
               no process survives, restart, go on

Each request ends in exactly one outcome: completed (with exactly max_new_tokens tokens under
ignore_eos: anything else is a defect), refused (an expected 400), cancelled (by its client:
disconnect, timeout or abort), or errored (anything else: unexpected status, a server-side abort,
a connection error outside a SIGTERM window). After the drain: the server's rotary requests, host
pool blocks, running and queued requests and token usage must be back at zero, its rotated KV
bytes unchanged (SUPERINFER_VERIFY_ROTATION), and after shutdown no process may survive. Peak RSS
of the server's processes and the host pool's peak against its size are recorded. The JSON
report lists every invariant and which failed; the exit status is 1 if any did.

    .venv/bin/python scripts/soak.py --requests 10000 --load 3 --out results/soak_faults/ours.json
    .venv/bin/python scripts/soak.py --system stock --requests 10000 --load 3 --out results/soak_faults/stock.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psutil
import requests
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from serverutil import Server, start_server  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # soak_requests, beside this script

from soak_requests import (  # noqa: E402,F401 (names used here and by tests: soak.near_tie)
    WORDS, CLASSES, EXACT_PROMPTS, EXACT_TOKENS, TIE_LOGPROB_GAP, REGEX, SCHEMA, SHARES,
    BURST_SIZE, Outcome, Shared, _prompt, Sizes, build_request, _token_count, _finish, run_request,
    _abort, _read_stream, _check_answer, near_tie, _check_one, _check_constrained,
)
import soak_leak  # noqa: E402


def server_args(args: argparse.Namespace) -> tuple[list[str], dict[str, str], bool]:
    from superinfer_sgl.bench.servers import shared_flags
    from superinfer_sgl.model_prep import prepare_default_model

    model = args.model_path or str(prepare_default_model())
    device = "cuda" if _has_cuda() else "cpu"
    shared = shared_flags(model, args.max_total_tokens, args.chunked_prefill_size, device,
                          ("--dtype", "float32", "--log-level", "info"))
    if args.system == "stock":
        return shared, ({"SUPERINFER_CPU_COMPAT": "1"} if device == "cpu" else {}), True
    ours = [*shared, "--rotary-pool-gb", str(args.rotary_pool_gb)]
    env = {"SUPERINFER_VERIFY_ROTATION": "1"}
    if args.rotate_interval:
        env["SUPERINFER_TEST_ROTATE_INTERVAL"] = str(args.rotate_interval)
    return ours, env, False


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def metrics(url: str, prefixes: tuple[str, ...] = ("superinfer_", "sglang:")) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(prefixes):
            key, value = line.rsplit(" ", 1)
            out[key] = out.get(key, 0.0) + float(value)
    return out


def gauge(m: dict[str, float], name: str) -> float | None:
    """A series summed over its label sets (None: the server does not export it)."""
    values = [v for k, v in m.items() if k.split("{")[0] == name]
    return sum(values) if values else None


class Sampler(threading.Thread):
    """Every second: peak RSS of each server process, peak host pool blocks and rotary requests."""

    def __init__(self, shared: Shared, server_ref: list[Server]) -> None:
        super().__init__(daemon=True)
        self.shared, self.server_ref = shared, server_ref
        self.stop_event = threading.Event()
        self.rss_peak: dict[str, float] = {}  # process name -> peak MiB
        self.rss_total_peak = 0.0
        self.pool_peak = 0.0
        self.pool_total: float | None = None
        self.rotary_peak = 0.0
        self.last_metrics: dict[str, float] = {}

    def run(self) -> None:
        while not self.stop_event.wait(1.0):
            try:
                root = psutil.Process(self.server_ref[0].proc.pid)
                total = 0.0
                for p in [root, *root.children(recursive=True)]:
                    mib = p.memory_info().rss / 2**20
                    total += mib
                    name = _proc_name(p)
                    self.rss_peak[name] = max(self.rss_peak.get(name, 0.0), mib)
                self.rss_total_peak = max(self.rss_total_peak, total)
            except psutil.Error:
                pass
            if self.shared.restarting.is_set():
                continue
            try:
                m = metrics(self.shared.url)
            except requests.RequestException:
                continue
            self.last_metrics = m
            self.pool_peak = max(self.pool_peak, gauge(m, "superinfer_host_pool_blocks_used") or 0.0)
            self.rotary_peak = max(self.rotary_peak, gauge(m, "superinfer_rotary_requests") or 0.0)
            self.pool_total = gauge(m, "superinfer_host_pool_blocks_total") or self.pool_total


def _proc_name(p: psutil.Process) -> str:
    """scheduler, detokenizer, launcher (the HTTP server's process) or the process's own name."""
    try:
        name = p.name()
        for role in ("scheduler", "detoken"):
            if name.startswith("sglang::" + role[:6]):
                return "detokenizer" if role == "detoken" else role
        return "launcher" if "launch_server" in " ".join(p.cmdline()) else name
    except psutil.Error:
        return "?"


def wait_idle(url: str, timeout: float, ours: bool) -> dict[str, float]:
    """The metrics once the server is idle (or the last ones seen at the timeout)."""
    deadline, m = time.time() + timeout, {}
    while time.time() < deadline:
        m = metrics(url)
        busy = [gauge(m, "sglang:num_running_reqs"), gauge(m, "sglang:num_queue_reqs"),
                gauge(m, "sglang:token_usage")]
        if ours:
            busy += [gauge(m, "superinfer_rotary_requests"), gauge(m, "superinfer_host_pool_blocks_used")]
        if all(v == 0 for v in busy if v is not None):
            return m
        time.sleep(2)
    return m


# ---- the soak --------------------------------------------------------------------------------

def calibrate(url: str, seconds: float, sz: Sizes, seed: int) -> float:
    """Closed-loop capacity: plain requests of the soak's mix from 8 clients, completions per
    second over at least `seconds` and at least 16 completions."""
    rng = random.Random(seed)
    done, t0 = [0], time.time()
    lock = threading.Lock()

    def client(k: int) -> None:
        local = random.Random(rng.random() + k)
        while time.time() < t0 + seconds or (done[0] < 16 and time.time() < t0 + 6 * seconds):
            body, headers = build_request(-1, "plain", local, sz)
            body["stream"] = False
            r = requests.post(url + "/generate", json=body, headers=headers, timeout=600)
            if r.status_code == 200:
                with lock:
                    done[0] += 1

    threads = [threading.Thread(target=client, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(done[0], 1) / (time.time() - t0)


def pick_kind(rng: random.Random, shares: dict[str, float]) -> str:
    x = rng.random()
    for kind, share in shares.items():
        if x < share:
            return kind
        x -= share
    return "plain"


def soak(args: argparse.Namespace) -> dict:
    cmd_args, env, stock = server_args(args)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    incarnation = [0]

    def start() -> Server:
        incarnation[0] += 1
        return start_server(cmd_args, log_dir / f"soak_{args.system}_{incarnation[0]}.log", stock=stock, env=env)

    server_ref = [start()]
    shared = Shared(server_ref[0].url)
    sz = Sizes(args.max_total_tokens, args.max_prompt_words, args.max_new_tokens)
    shares = {**SHARES, **json.loads(args.shares or "{}")}
    sampler = Sampler(shared, server_ref)
    report: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                              "command": " ".join([Path(sys.executable).name, *sys.argv]),
                              "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, "
                                         f"{'CUDA' if _has_cuda() else 'no GPU'}, {platform.platform()}",
                              "system": args.system, "args": vars(args), "server_flags": cmd_args,
                              "server_env": env, "shares": shares}
    outcomes: list[Outcome] = []
    threads: list[threading.Thread] = []
    left_after: list[list[int]] = []
    counters_before_restart: list[dict[str, float]] = []
    try:
        for p in EXACT_PROMPTS:  # the reference: each prompt alone on the quiet server
            r = requests.post(shared.url + "/generate", timeout=600, json={
                "text": p, "sampling_params": {"temperature": 0, "max_new_tokens": EXACT_TOKENS, "ignore_eos": True},
                "return_logprob": True, "top_logprobs_num": 2})
            r.raise_for_status()
            shared.exact_reference[p] = list(r.json()["output_ids"])
            tops = r.json()["meta_info"].get("output_top_logprobs") or []
            shared.exact_top2[p] = [[(float(lp), int(tok)) for lp, tok, *_ in top] for top in tops]
        capacity = args.capacity or calibrate(shared.url, args.calibrate_s, sz, args.seed)
        rate = args.load * capacity
        report.update(capacity_req_per_s=round(capacity, 3), arrival_rate_req_per_s=round(rate, 3))
        print(f"capacity {capacity:.2f} req/s -> arrivals at {rate:.2f} req/s ({args.load}x)", flush=True)
        sampler.start()
        leak_sampler = soak_leak.start(args, server_ref, shared)  # per-minute RSS (--leak-out)
        rng = random.Random(args.seed)
        inflight = threading.BoundedSemaphore(args.max_inflight)
        sigterm_at = int(args.sigterm_at * args.requests) if args.sigterm_at else None
        expected = min(args.requests, int(rate * args.duration_s) or args.requests)  # --duration-s: spread by time
        every = max(1, expected // max(1, args.exact_samples))
        exact_at = {every // 2 + k * every for k in range(args.exact_samples)}
        i = 0
        started = time.time()
        with tqdm(total=args.requests, desc=f"soak {args.system}", mininterval=5) as bar:
            while i < args.requests and not (args.duration_s and time.time() - started > args.duration_s):
                if sigterm_at is not None and i == sigterm_at:
                    counters_before_restart.append(dict(sampler.last_metrics))
                    left_after.append(_sigterm_and_restart(shared, server_ref, start, args.sigterm_drain_s, report))
                    sigterm_at = None
                kind = "exact" if i in exact_at else pick_kind(rng, shares)
                batch = BURST_SIZE if kind == "burst" else 1
                for _ in range(min(batch, args.requests - i)):
                    o = Outcome(i, kind)
                    body, headers = build_request(i, kind, rng, sz)
                    o.rid = body.get("rid")
                    outcomes.append(o)
                    inflight.acquire()
                    t = threading.Thread(target=_client, daemon=True,
                                         args=(o, body, headers, shared, random.Random(rng.random()), inflight))
                    t.start()
                    threads.append(t)
                    i += 1
                    bar.update(1)
                time.sleep(rng.expovariate(rate) * batch)
        report["arrival_seconds"] = round(time.time() - started, 1)
        hung = []
        for t, o in tqdm(list(zip(threads, outcomes)), desc="draining", mininterval=5):
            t.join(timeout=max(1.0, args.drain_timeout_s - (time.time() - started)))
            if t.is_alive():
                hung.append({"i": o.i, "kind": o.kind, "rid": o.rid})
        report["drain_seconds"] = round(time.time() - started, 1)
        report["clients_still_waiting_after_drain"] = len(hung)
        report["clients_still_waiting"] = hung
        final = wait_idle(shared.url, args.idle_timeout_s, not stock)
        report["health_after"] = requests.get(shared.url + "/health", timeout=30).status_code
        report["leak"] = soak_leak.finish(leak_sampler, args)
    finally:
        sampler.stop_event.set()
        left_after.append(server_ref[0].stop())
    report.update(_summary(outcomes, shared, sampler, final, counters_before_restart, left_after, stock))
    return report


def _client(o: Outcome, body: dict, headers: dict[str, str], shared: Shared, rng: random.Random,
            inflight: threading.BoundedSemaphore) -> None:
    try:
        while shared.restarting.is_set():  # arrivals during a restart wait for the new server
            time.sleep(0.5)
        run_request(o, body, headers, shared, rng)
    finally:
        inflight.release()


def _sigterm_and_restart(shared: Shared, server_ref: list[Server], start: Any, drain_s: float,
                         report: dict[str, Any]) -> list[int]:
    shared.restarting.set()
    window = [time.time(), 0.0]
    shared.sigterm_windows.append(window)  # type: ignore[arg-type]
    print("SIGTERM to the server", flush=True)
    # The graceful drain serves every request in flight first: a backlog takes a while on a slow machine.
    left = server_ref[0].stop(signal.SIGTERM, timeout=drain_s)
    report.setdefault("sigterm_exit_seconds", []).append(round(time.time() - window[0], 1))
    window[1] = time.time() + 5  # a client's connection error surfaces a moment later
    server_ref[0] = start()
    shared.url = server_ref[0].url
    shared.sigterm_windows[-1] = tuple(window)  # type: ignore[assignment]
    shared.restarting.clear()
    print(f"restarted at {shared.url}; processes that survived the SIGTERM: {left}", flush=True)
    return left


def _summary(outcomes: list[Outcome], shared: Shared, sampler: Sampler, final: dict[str, float],
             before_restart: list[dict[str, float]], left_after: list[list[int]], stock: bool) -> dict:
    by_outcome = Counter(o.outcome for o in outcomes)
    by_kind = {k: dict(Counter(o.outcome for o in outcomes if o.kind == k)) for k in sorted({o.kind for o in outcomes})}
    errors = Counter(o.detail.split(":")[0] if o.detail.startswith(("http", "server SIGTERM")) else o.detail[:60]
                     for o in outcomes if o.outcome == "errored")
    sigterm_errors = sum(1 for o in outcomes if o.outcome == "errored" and o.detail.startswith("server SIGTERM"))
    wrong_tokens = [asdict(o) for o in outcomes if "WRONG TOKEN COUNT" in o.detail][:20]
    unexpected = [asdict(o) for o in outcomes if o.outcome == "errored" and not o.detail.startswith("server SIGTERM")]

    def total(name: str) -> float | None:
        vals = [gauge(m, name) for m in [*before_restart, final]]
        vals = [v for v in vals if v is not None]
        return sum(vals) if vals else None

    def kv_checks(outcome: str) -> float:  # over every server of the run (a restart starts them again)
        return sum(v for m in [*before_restart, final] for k, v in m.items() if "kv_verify" in k and f'outcome="{outcome}"' in k)

    exact = shared.exact_results
    idle = {name: gauge(final, name) for name in (
        "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
        "superinfer_rotary_requests", "superinfer_host_pool_blocks_used")}
    checks = {
        "every request accounted for": by_outcome.get("pending", 0) == 0 and sum(by_outcome.values()) == len(outcomes),
        "no client still waiting after the drain": True,  # filled in below
        "completed requests have exactly max_new_tokens tokens": not wrong_tokens,
        "no unexpected error": not unexpected,
        "idle: running, queued, token usage, rotary, host pool all zero":
            all(v == 0 for v in idle.values() if v is not None),
        "rotated KV bytes unchanged on resume (verify)":
            stock or kv_checks("changed") == 0,
        "greedy exactness sample equal to served alone (or a near-tie flip)":
            bool(exact) and all(e["equal"] or e.get("near_tie") for e in exact),
        "no process left after each shutdown": all(not left for left in left_after),
    }
    return {
        "sent": len(outcomes), "outcomes": dict(by_outcome), "by_kind": by_kind,
        "errors_by_kind": dict(errors.most_common(20)), "errored_in_sigterm_window": sigterm_errors,
        "unexpected_errors_sample": unexpected[:20], "wrong_token_counts_sample": wrong_tokens,
        "faults_injected": {k: sum(1 for o in outcomes if o.kind == k) for k in
                            ("disconnect", "timeout", "abort", "burst", "constrained", "n2", "oversize", "exact")},
        "sigterm_restarts": len(before_restart),
        "rotations_out": total("superinfer_rotations_out_total"),
        "resumes": total("superinfer_resumes_total"),
        "recompute_fallbacks": total("superinfer_recompute_fallbacks_total"),
        "sglang_retractions": total("superinfer_sglang_retractions_total"),
        "aborted_while_rotary": total("superinfer_aborted_rotary_total"),
        "kv_verified_identical": kv_checks("identical"),
        "kv_verified_changed": kv_checks("changed"),
        "kv_unverified": kv_checks("unverified"),
        "idle_gauges": idle,
        "host_pool_blocks_peak": sampler.pool_peak, "host_pool_blocks_configured": sampler.pool_total,
        "rotary_requests_peak": sampler.rotary_peak,
        "rss_peak_mib_by_process": {k: round(v, 1) for k, v in sampler.rss_peak.items() if v > 0},
        "rss_peak_mib_total": round(sampler.rss_total_peak, 1),
        "exactness": {"samples": len(exact), "equal": sum(e["equal"] for e in exact),
                      "near_ties": sum(bool(e.get("near_tie")) for e in exact), "details": exact[:50]},
        "latency_s_p50_p99": _percentiles([o.latency_s for o in outcomes if o.outcome == "completed"]),
        "processes_left_after_shutdown": left_after,
        "invariants": checks,
    }


def _percentiles(xs: list[float]) -> list[float] | None:
    if not xs:
        return None
    xs = sorted(xs)
    return [round(xs[len(xs) // 2], 2), round(xs[min(len(xs) - 1, int(len(xs) * 0.99))], 2)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system", choices=("ours", "stock"), default="ours")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--load", type=float, default=3.0, help="arrival rate in multiples of the measured capacity")
    ap.add_argument("--capacity", type=float, help="requests/s; skips the calibration")
    ap.add_argument("--calibrate-s", type=float, default=20.0)
    ap.add_argument("--shares", help='JSON: share of each fault kind, e.g. {"abort": 0.1}')
    ap.add_argument("--sigterm-at", type=float, default=0.0,
                    help="SIGTERM and restart the server after this share of the arrivals (0: never)")
    ap.add_argument("--sigterm-drain-s", type=float, default=240.0,
                    help="how long the server may take to drain and exit after the SIGTERM")
    ap.add_argument("--max-total-tokens", type=int, default=2048, help="device KV pool (tokens)")
    ap.add_argument("--max-prompt-words", type=int, default=200, help="longest ordinary prompt (~tokens)")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="most output tokens of an ordinary request")
    ap.add_argument("--exact-samples", type=int, default=12, help="greedy exactness requests, evenly spaced")
    ap.add_argument("--chunked-prefill-size", type=int, default=256)
    ap.add_argument("--rotary-pool-gb", type=float, default=0.02,
                    help="ours: a small host pool, so bursts take the recompute fallback")
    ap.add_argument("--rotate-interval", type=int, default=6,
                    help="ours: SUPERINFER_TEST_ROTATE_INTERVAL, a forced rotation every N iterations (0: off)")
    ap.add_argument("--max-inflight", type=int, default=400, help="client threads at most")
    ap.add_argument("--drain-timeout-s", type=float, default=3600.0)
    ap.add_argument("--idle-timeout-s", type=float, default=120.0)
    ap.add_argument("--model-path")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", default="/tmp/soak_logs")
    ap.add_argument("--out", default="results/soak_faults/soak.json")
    soak_leak.add_args(ap)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    report = soak(args)
    report["invariants"]["no client still waiting after the drain"] = report["clients_still_waiting_after_drain"] == 0
    if report.get("leak"):
        report["invariants"]["no process's RSS slope over the bound after the warm-up"] = not report["leak"]["over_bound"]
    report["invariants_failed"] = [k for k, ok in report["invariants"].items() if not ok]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2, default=str))
    print(json.dumps({k: report[k] for k in ("sent", "outcomes", "faults_injected", "rotations_out",
                                             "recompute_fallbacks", "exactness", "invariants_failed")},
                     indent=2, default=str))
    return report


if __name__ == "__main__":
    sys.exit(1 if main()["invariants_failed"] else 0)
