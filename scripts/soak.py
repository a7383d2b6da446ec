"""Bounded overload soak: several times capacity for a few minutes, loopback only.

Starts our server (unless --url is given), sends Poisson arrivals with random prompt/output lengths
and SLO classes, disconnects a share of clients mid-stream, then reports completed / failed /
aborted requests and, once idle, the rotary and host-pool usage, which must be back at zero.

    python scripts/soak.py --duration 180 --rate 2.0 --out results/soak.json
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import requests
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from serverutil import Server, start_server  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while bright stars shine above quiet hills".split()
CLASSES = ["interactive", "standard", "batch", None]


def one_request(url: str, rng: random.Random, disconnect: bool, results: dict[str, int], lock: threading.Lock) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 200)))
    params: dict = {"temperature": 0, "max_new_tokens": rng.randint(8, 160), "ignore_eos": True}
    cls = rng.choice(CLASSES)
    if cls:
        params["custom_params"] = {"slo_class": cls}
    body = {"text": prompt, "sampling_params": params, "stream": True}
    outcome = "completed"
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=900) as r:
            if r.status_code != 200:
                outcome = f"http_{r.status_code}"
            else:
                for i, line in enumerate(r.iter_lines()):
                    if disconnect and i >= 3:
                        outcome = "disconnected"
                        break
                    if line and b"[DONE]" not in line and b'"finish_reason":{"type":"abort"' in line:
                        outcome = "aborted_by_server"
    except requests.RequestException as exc:
        outcome = f"error_{type(exc).__name__}"
    with lock:
        results[outcome] = results.get(outcome, 0) + 1


def metrics(url: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in requests.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("superinfer_"):
            key, value = line.rsplit(" ", 1)
            out[key] = out.get(key, 0.0) + float(value)
    return out


def wait_idle(url: str, timeout: float) -> dict[str, float]:
    deadline, m = time.time() + timeout, {}
    while time.time() < deadline:
        m = metrics(url)
        if m.get("superinfer_rotary_requests", 1) == 0 and m.get("superinfer_host_pool_blocks_used", 1) == 0:
            break
        time.sleep(2)
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="use a running server (started with --enable-metrics)")
    ap.add_argument("--duration", type=float, default=180.0, help="seconds of arrivals")
    ap.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--disconnect-share", type=float, default=0.1)
    ap.add_argument("--max-total-tokens", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/soak.json")
    args = ap.parse_args()

    server: Server | None = None
    url = args.url
    if url is None:
        log = ROOT / "results" / "soak_server.log"
        log.parent.mkdir(exist_ok=True)
        server = start_server(["--enable-metrics", "--max-total-tokens", str(args.max_total_tokens),
                               "--ttft-slo-ms", "8000", "--tbt-slo-ms", "400"], log)
        url = server.url
    rng = random.Random(args.seed)
    results: dict[str, int] = {}
    lock = threading.Lock()
    threads: list[threading.Thread] = []
    started = time.time()
    try:
        with tqdm(total=int(args.duration), desc="soak (s)") as bar:
            while time.time() - started < args.duration:
                t = threading.Thread(target=one_request, daemon=True, args=(
                    url, random.Random(rng.random()), rng.random() < args.disconnect_share, results, lock))
                t.start()
                threads.append(t)
                time.sleep(rng.expovariate(args.rate))
                bar.n = int(min(args.duration, time.time() - started))
                bar.refresh()
        for t in tqdm(threads, desc="draining"):
            t.join(timeout=900)
        final = wait_idle(url, timeout=120)
        health = requests.get(url + "/health", timeout=30).status_code
    finally:
        left = server.stop() if server is not None else []
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()} ({__import__('os').cpu_count()} cores)",
        "args": vars(args), "sent": len(threads), "outcomes": results, "health_after": health,
        "processes_left_after_shutdown": left,
        "rotary_requests_after": final.get("superinfer_rotary_requests"),
        "host_pool_blocks_used_after": final.get("superinfer_host_pool_blocks_used"),
        "rotations_out": final.get("superinfer_rotations_out_total"),
        "resumes": final.get("superinfer_resumes_total"),
        "recompute_fallbacks": final.get("superinfer_recompute_fallbacks_total"),
        "sglang_retractions": final.get("superinfer_sglang_retractions_total"),
        "aborted_rotary": final.get("superinfer_aborted_rotary_total"),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
