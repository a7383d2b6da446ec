"""Gateway scaling run: N replicas behind SGLang's model gateway at the same per-replica rate.

For each replica count, starts `python -m superinfer_sgl.launch_cluster --replicas N`, sends
N x --requests-per-replica streaming /generate requests through the gateway with Poisson arrivals
at N x --rate-per-replica (same seed, so the 1-replica schedule is a prefix-rate of the 2-replica
one), measures TTFT and inter-token gaps at the client, reads the server's SLO verdicts from
meta_info, and stops the cluster. Writes one JSON (machine, date, command, per-run summaries and
per-request rows).

    .venv/bin/python scripts/bench_gateway.py --replicas 1 2 --out results/gateway/cpu_1v2.json

On a 2-core machine every replica shares the same two cores: twice the replicas at twice the
rate is not twice the hardware. Say so next to any figure this produces.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
TBT_MET_SHARE = 0.9  # as the server's clock and the A/B harness: >= 90% of gaps within the TBT SLO
WORDS = ("river mountain lantern harbor meadow copper violet engine garden thunder silver orchard "
         "compass falcon glacier pepper marble canyon willow ember").split()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prompt(i: int, words: int, rng: random.Random) -> str:
    return f"Request {i}. Write a story using these words: " + " ".join(rng.choice(WORDS) for _ in range(words))


def one_request(url: str, text: str, out_tokens: int, slo: dict, row: dict) -> None:
    """Stream one /generate; fill `row` with client-side TTFT/gaps and the server's verdicts."""
    t0 = time.perf_counter()
    body = {"text": text, "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": out_tokens, "ignore_eos": True,
                                "custom_params": slo}}
    seen, times, meta = 0, [], {}
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
            row["status"] = r.status_code
            if r.status_code != 200:
                row["error"] = r.text[:200]
                return
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                meta = chunk.get("meta_info", {})
                n = int(meta.get("completion_tokens", 0))
                if n > seen:
                    times.append((time.perf_counter(), n - seen))
                    seen = n
    except requests.RequestException as exc:
        row["status"], row["error"] = None, type(exc).__name__
        return
    row["tokens"] = seen
    if not times:
        return
    row["ttft_s"] = times[0][0] - t0
    gaps = []
    for (a, _), (b, k) in zip(times, times[1:]):
        gaps += [b - a] + [0.0] * (k - 1)  # tokens arriving together: zero-length gaps (as the server counts)
    row["gaps_met_share"] = (sum(g * 1000 <= slo["tbt_slo_ms"] for g in gaps) / len(gaps)) if gaps else None
    row["e2e_s"] = times[-1][0] - t0
    si = meta.get("superinfer", {})
    row["server_ttft_met"], row["server_tbt_met"] = si.get("superinfer_ttft_slo_met"), si.get("superinfer_tbt_slo_met")


def summarize(rows: list[dict], slo: dict, duration_s: float) -> dict:
    ok = [r for r in rows if r.get("status") == 200 and r.get("ttft_s") is not None]
    ttft = [r["ttft_s"] * 1000 <= slo["ttft_slo_ms"] for r in ok]
    tbt = [r["gaps_met_share"] is None or r["gaps_met_share"] >= TBT_MET_SHARE for r in ok]
    joint = [a and b for a, b in zip(ttft, tbt)]
    server_joint = [r["server_ttft_met"] and r["server_tbt_met"] for r in ok
                    if r.get("server_ttft_met") is not None and r.get("server_tbt_met") is not None]
    ttfts = sorted(r["ttft_s"] * 1000 for r in ok)
    n = len(rows)
    return {
        "requests": n, "completed": len(ok), "failed": n - len(ok),
        # attainment over all requests sent: a failed request counts as a miss
        "joint_attainment": sum(joint) / n, "ttft_attainment": sum(ttft) / n, "tbt_attainment": sum(tbt) / n,
        "server_joint_attainment": sum(server_joint) / n if server_joint else None,
        "output_tokens_per_s": sum(r.get("tokens", 0) for r in ok) / duration_s,
        "duration_s": duration_s,
        "ttft_ms_p50": ttfts[len(ttfts) // 2] if ttfts else None,
        "ttft_ms_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None,
    }


def start_cluster(n: int, args: argparse.Namespace, log_dir: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    ports = [free_port() for _ in range(n)]
    cmd = [sys.executable, "-m", "superinfer_sgl.launch_cluster", "--replicas", str(n), "--port", str(port),
           "--replica-ports", ",".join(map(str, ports)), "--gateway-prometheus-port", str(free_port()),
           "--gateway-policy", args.policy, "--log-dir", str(log_dir / f"replicas{n}"), *args.server_args]
    out = open(log_dir / f"cluster{n}.out", "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.time() + 900
    while "cluster ready" not in (log_dir / f"cluster{n}.out").read_text():
        if proc.poll() is not None or time.time() > deadline:
            stop(proc)
            raise SystemExit(f"cluster of {n} did not start; see {log_dir}/cluster{n}.out")
        time.sleep(1)
    return proc, f"http://127.0.0.1:{port}"


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()


def run(n: int, args: argparse.Namespace, log_dir: Path) -> dict:
    rng = random.Random(args.seed)
    total, rate = n * args.requests_per_replica, n * args.rate_per_replica
    arrivals, t = [], 0.0
    for _ in range(total):
        t += rng.expovariate(rate)
        arrivals.append(t)
    texts = [prompt(i, args.prompt_words, rng) for i in range(total)]
    slo = {"ttft_slo_ms": args.ttft_slo_ms, "tbt_slo_ms": args.tbt_slo_ms}
    proc, url = start_cluster(n, args, log_dir)
    try:
        for i in range(2):  # warm each replica's first request outside the measurement
            one_request(url, f"warmup {i}", 4, slo, {})
        rows = [{"i": i, "arrival_s": a} for i, a in enumerate(arrivals)]
        threads = []
        t0 = time.perf_counter()
        for text, row in zip(texts, rows):
            delay = t0 + row["arrival_s"] - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            th = threading.Thread(target=one_request, args=(url, text, args.output_tokens, slo, row))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
        duration = time.perf_counter() - t0
        load = os.getloadavg()
    finally:
        stop(proc)
    return {"replicas": n, "rate_rps": rate, "load_avg_1m_after": load[0],
            "summary": summarize(rows, slo, duration), "rows": rows}


def _interrupt(signum: int, _frame: object) -> None:
    raise KeyboardInterrupt  # so run()'s finally stops the cluster it started


def main() -> int:
    signal.signal(signal.SIGTERM, _interrupt)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rate-per-replica", type=float, default=1.5)
    p.add_argument("--requests-per-replica", type=int, default=60)
    p.add_argument("--prompt-words", type=int, default=60)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--ttft-slo-ms", type=float, default=2000)
    p.add_argument("--tbt-slo-ms", type=float, default=310)
    p.add_argument("--policy", default="round_robin", help="the gateway's routing policy (launch_cluster --gateway-policy)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("server_args", nargs="*", default=[],
                   help="after --: arguments for every replica (launch_server)")
    args = p.parse_args()
    args.server_args = args.server_args or ["--enable-metrics", "--rotary-pool-gb", "1"]
    log_dir = args.out.with_suffix("")
    log_dir.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runs = [run(n, args, log_dir) for n in args.replicas]
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started_utc": started, "commit": commit,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
        "note": "every replica runs on the same machine and shares its cores",
        "slo": {"ttft_ms": args.ttft_slo_ms, "tbt_ms": args.tbt_slo_ms, "tbt_met_share": TBT_MET_SHARE},
        "runs": runs,
    }
    args.out.write_text(json.dumps(result, indent=1))
    for r in runs:
        s = r["summary"]
        print(f"{r['replicas']} replica(s) at {r['rate_rps']:.2f} req/s: joint {s['joint_attainment']:.1%} "
              f"(TTFT {s['ttft_attainment']:.1%}, TBT {s['tbt_attainment']:.1%}; server's verdicts "
              f"{s['server_joint_attainment']}), {s['output_tokens_per_s']:.1f} out tok/s, "
              f"P50/P99 TTFT {s['ttft_ms_p50']:.0f}/{s['ttft_ms_p99']:.0f} ms, {s['failed']} failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
