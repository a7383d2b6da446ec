#!/usr/bin/env python3
"""Measure a cost profile for the simulator from our own CPU server, and write it as JSON.

Starts `python -m superinfer_sgl.launch_server --scheduler sglang` (stock scheduling, default
SmolLM2-135M model) on a free port with a small KV pool, then over /generate (streaming, token ids,
ignore_eos, greedy):
  prefill  TTFT of one request alone at several prompt lengths  -> base + per token + per pair
  decode   median inter-token gap of B identical concurrent requests at two context lengths
           -> base + per decoding request + per context token
and what a client pays outside the scheduler on the A/B's path (server.request_overhead_s: TTFT
through /v1/chat/completions minus TTFT through /generate for the same templated ids), and times
the server's own CPU rotation path (duplexkv.RotationEngine, transfer "torch") for the model's KV
shape at a few sizes -> the link model. Fits by least squares; keeps the raw points.

Then the whole cost of a rotation as the server pays it (step.per_resume_s): two RotaSched servers
side by side, one forcing a rotation every few iterations (SUPERINFER_TEST_ROTATE_INTERVAL), run
the same batch of identical requests in alternation; (forced - plain wall time) / rotations, less
what the simulator already charges for the resume's one-token extend.

Usage: python scripts/profile_cpu_server.py [--out profiles/cpu-smollm2-135m.json] [--port 31234]
       [--max-total-tokens 16384] [--quick] [--resume-only | --overhead-only]
Takes about 4-6 minutes on a 2-core machine (server starts included); --resume-only and
--overhead-only re-measure one figure into an existing profile (about 1-2 minutes each).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests

REPO = Path(__file__).resolve().parents[1]

VOCAB_SAFE = (1000, 40000)  # token ids to draw prompts from (inside SmolLM2's 49152 vocabulary)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(port: int, max_total_tokens: int, log: Path, scheduler: str = "sglang",
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "superinfer_sgl.launch_server", "--scheduler", scheduler,
           "--port", str(port), "--max-total-tokens", str(max_total_tokens)]
    print("starting:", " ".join(cmd), env or "", flush=True)
    return subprocess.Popen(cmd, cwd=REPO, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True, env={**os.environ, **(env or {})})


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see its log")
        try:
            if requests.get(base + "/health_generate", timeout=30).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError("server not ready")


def stream(base: str, prompt_len: int, new_tokens: int, seed: int) -> list[float]:
    """Send one streaming request; return [send time, chunk arrival times...] (perf_counter)."""
    rng = random.Random(seed)
    ids = [rng.randint(*VOCAB_SAFE) for _ in range(prompt_len)]
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}}
    times = [time.perf_counter()]
    with requests.post(base + "/generate", json=body, stream=True, timeout=600) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                times.append(time.perf_counter())
    return times


def low(xs: list[float]) -> float:
    """10th percentile: the least-contended samples on a shared machine."""
    return sorted(xs)[len(xs) // 10]


def measure_prefill(base: str, lengths: list[int], reps: int) -> list[dict]:
    rows = []
    for n in lengths:
        ttfts = []
        for k in range(reps):
            t = stream(base, n, 1, seed=hash((n, k)) & 0xFFFF)
            ttfts.append(t[1] - t[0])
        rows.append({"prompt_tokens": n, "ttft_s": statistics.median(ttfts), "ttft_low_s": min(ttfts),
                     "samples": ttfts})
        print(f"prefill {n:5d} tokens: {statistics.median(ttfts) * 1000:7.1f} ms (min {min(ttfts) * 1000:.1f})",
              flush=True)
    return rows


def measure_decode(base: str, batch: int, ctx: int, new_tokens: int, skip: int = 4) -> dict:
    with ThreadPoolExecutor(batch) as pool:
        futs = [pool.submit(stream, base, ctx, new_tokens, 7919 * i + ctx) for i in range(batch)]
        runs = [f.result() for f in futs]
    gaps = [b - a for t in runs for a, b in zip(t[1 + skip:-1], t[2 + skip:])]
    gap = statistics.median(gaps)
    # Context of the batch at mid-run: every request holds its prompt plus about half its outputs.
    context = batch * (ctx + (skip + new_tokens) // 2)
    print(f"decode batch {batch:3d} ctx {ctx:5d}: {gap * 1000:7.1f} ms/step (p10 {low(gaps) * 1000:.1f})",
          flush=True)
    return {"batch": batch, "prompt_tokens": ctx, "context_tokens": context, "step_s": gap,
            "step_low_s": low(gaps)}


def _first_content_s(resp: requests.Response) -> float:
    """Seconds until the first streamed chunk carrying output (chat: non-empty delta content)."""
    for line in resp.iter_lines():
        if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        choice = (chunk.get("choices") or [{}])[0]
        if "text" in chunk or (choice.get("delta") or {}).get("content"):
            return time.perf_counter()
    raise RuntimeError("stream ended without output")


def measure_overhead(base: str, reps: int) -> dict:
    """What a client pays outside the scheduler on the A/B's path: TTFT through
    /v1/chat/completions (chat template, tokenization, OpenAI streaming) minus TTFT through
    /generate with the same templated token ids. Every prompt is distinct (no prefix-cache hits
    beyond the template's)."""
    from transformers import AutoTokenizer

    from superinfer_sgl.model_prep import prepare_default_model
    from superinfer_sgl.sim.validate import chat_ids

    tok = AutoTokenizer.from_pretrained(prepare_default_model())
    chat, gen = [], []
    for k in range(reps):
        for path in ("chat", "generate"):
            words = " ".join(f"{path}{k}w{i}" for i in range(60))
            msgs = [{"role": "user", "content": f"[{path} {k}] {words}"}]
            t0 = time.perf_counter()
            if path == "chat":
                body = {"model": "default", "messages": msgs, "max_tokens": 2, "stream": True,
                        "temperature": 0}
                with requests.post(base + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
                    r.raise_for_status()
                    chat.append(_first_content_s(r) - t0)
            else:
                ids = chat_ids(tok, msgs)
                t0 = time.perf_counter()  # tokenizing here is not the server's time
                body = {"input_ids": ids, "stream": True,
                        "sampling_params": {"max_new_tokens": 2, "ignore_eos": True, "temperature": 0}}
                with requests.post(base + "/generate", json=body, stream=True, timeout=600) as r:
                    r.raise_for_status()
                    gen.append(_first_content_s(r) - t0)
    overhead = max(0.0, statistics.median(chat) - statistics.median(gen))
    print(f"request overhead (chat path): {overhead * 1000:.1f} ms (chat TTFT {statistics.median(chat) * 1000:.1f}"
          f" ms, /generate {statistics.median(gen) * 1000:.1f} ms)", flush=True)
    return {"chat_ttft_s": chat, "generate_ttft_s": gen, "overhead_s": overhead}


def run_batch(base: str, batch: int, ctx: int, new_tokens: int) -> tuple[float, int]:
    """`batch` identical-length requests at once; (wall seconds, rotations they went through)."""
    def one(i: int) -> int:
        rng = random.Random(7919 * i + ctx)
        body = {"input_ids": [rng.randint(*VOCAB_SAFE) for _ in range(ctx)],
                "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}}
        resp = requests.post(base + "/generate", json=body, timeout=600)
        resp.raise_for_status()
        return int(resp.json()["meta_info"].get("superinfer", {}).get("superinfer_rotations", 0))

    t0 = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        rotations = sum(pool.map(one, range(batch)))
    return time.perf_counter() - t0, rotations


def measure_resume(max_total_tokens: int, reps: int, every: int = 4, batch: int = 8, ctx: int = 128,
                   new_tokens: int = 96) -> dict:
    """Extra server time per rotation (out + resume through a one-token mixed extend)."""
    servers = {}
    try:
        for name, env in (("plain", {}), ("forced", {"SUPERINFER_TEST_ROTATE_INTERVAL": str(every)})):
            port = free_port()
            log = REPO / "results" / f"sim_cpu_profile_resume_{name}.log"
            servers[name] = (f"http://127.0.0.1:{port}", start_server(port, max_total_tokens, log, "rotasched", env))
        for base, proc in servers.values():
            wait_ready(base, proc)
            run_batch(base, batch, ctx, 8)  # warm-up
        runs: dict[str, list[tuple[float, int]]] = {"plain": [], "forced": []}
        for _ in range(reps):  # alternate, so both see the same machine state
            for name, (base, _proc) in servers.items():
                runs[name].append(run_batch(base, batch, ctx, new_tokens))
        print("resume runs (s, rotations):", runs, flush=True)
    finally:
        for _base, proc in servers.values():
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)
    plain = statistics.median(t for t, _ in runs["plain"])
    forced = statistics.median(t for t, _ in runs["forced"])
    rotations = statistics.median(n for _, n in runs["forced"])
    assert rotations > 0, "the forced server did not rotate"
    per = (forced - plain) / rotations
    print(f"rotation cost: {per * 1000:.1f} ms per rotation ({rotations} per run, "
          f"plain {plain:.2f} s, forced {forced:.2f} s)", flush=True)
    return {"batch": batch, "prompt_tokens": ctx, "new_tokens": new_tokens, "rotate_every": every,
            "runs": runs, "plain_s": plain, "forced_s": forced, "rotations": rotations,
            "per_rotation_s": per}


def fit_step(prefill: list[dict], decode: list[dict], stat: str = "median") -> dict:
    """Least squares: decode t = base + e*B + f*C; prefill t = a + b*L + c*L^2 (a >= base).
    stat "median" fits typical times; "low" the least-contended ones (min / 10th percentile)."""
    dkey, pkey = ("step_s", "ttft_s") if stat == "median" else ("step_low_s", "ttft_low_s")
    A = np.array([[1.0, d["batch"], d["context_tokens"]] for d in decode])
    y = np.array([d[dkey] for d in decode])
    (base, per_req, per_ctx), *_ = np.linalg.lstsq(A, y, rcond=None)
    P = np.array([[1.0, p["prompt_tokens"], p["prompt_tokens"] ** 2] for p in prefill])
    z = np.array([p[pkey] for p in prefill])
    (a, b, c), *_ = np.linalg.lstsq(P, z, rcond=None)
    clamp = lambda v: float(max(v, 0.0))  # noqa: E731 - a negative slope is measurement noise
    return {
        "base_s": clamp(base),
        "prefill_base_s": clamp(a - clamp(base)),
        "floor_s": 0.0,
        "per_prefill_token_s": clamp(b),
        "per_decode_token_s": clamp(per_req),
        "per_context_token_s": clamp(per_ctx),
        "per_prefill_pair_s": clamp(2.0 * c),  # pairs of one prompt alone = L^2 / 2
        "per_prefill_req_s": 0.0,
        "per_resume_s": 0.0,
    }


OVERHEAD_ASSUMPTION = (
    "request_overhead_s = median TTFT through /v1/chat/completions (the A/B's path) minus median "
    "TTFT through /generate with the same templated token ids, distinct prompts, server idle")
RESUME_ASSUMPTION = (
    "per_resume_s = extra wall time per forced rotation of a RotaSched server (mixed resume on) over "
    "the same batch without rotations, less the resume's one-token extend: the scheduler's "
    "rotate-out, restore and re-admission work and the slower mixed iteration")


def resume_cost(step: dict, resume: dict) -> float:
    """step.per_resume_s: the measured cost per rotation, less the one-token extend the simulator
    already charges the resume's (mixed) iteration."""
    return max(0.0, resume["per_rotation_s"] - step["per_prefill_token_s"]
               - step["per_prefill_pair_s"] * (resume["prompt_tokens"] + resume["new_tokens"] / 2))


def model_shape() -> dict:
    from superinfer_sgl.model_prep import prepare_default_model

    cfg = json.loads((Path(prepare_default_model()) / "config.json").read_text())
    heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    layers = cfg["num_hidden_layers"]
    return {"name": "SmolLM2-135M-Instruct", "layers": layers, "kv_heads": heads, "head_dim": head_dim,
            "kv_bytes_per_token": layers * 2 * heads * head_dim * 2}  # bf16 KV


def measure_link(shape: dict, sizes: list[int], reps: int = 5) -> list[dict]:
    """The CPU rotation path: RotationEngine.save (out) and load (in), transfer 'torch'."""
    import torch

    from superinfer_sgl.duplexkv import DevicePoolView, HostKVPool, RotationEngine

    rows_needed = max(sizes) + 16
    dev = DevicePoolView.synthetic(rows_needed, shape["layers"], shape["kv_heads"], shape["head_dim"],
                                   torch.bfloat16)
    host = HostKVPool(-(-rows_needed // 16) * 2, shape["layers"], shape["kv_heads"], shape["head_dim"],
                      16, torch.bfloat16, pin=False)
    engine = RotationEngine(dev, host, "torch")
    out = []
    for n in sizes:
        slots = torch.arange(1, n + 1, dtype=torch.int64)
        engine.free(engine.save(slots))  # warm-up: first touch of the pools' pages
        t_out, t_in = [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            hk = engine.save(slots)
            t1 = time.perf_counter()
            engine.load(hk, slots)
            t2 = time.perf_counter()
            engine.free(hk)
            t_out.append(t1 - t0)
            t_in.append(t2 - t1)
        nbytes = n * shape["kv_bytes_per_token"]
        row = {"tokens": n, "bytes": nbytes, "segment_bytes": nbytes // (2 * shape["layers"]),
               "out_s": statistics.median(t_out), "in_s": statistics.median(t_in)}
        row["out_gbps"], row["in_gbps"] = nbytes / row["out_s"] / 1e9, nbytes / row["in_s"] / 1e9
        print(f"rotate {n:5d} tokens ({nbytes / 2**20:6.2f} MiB): out {row['out_gbps']:5.2f} GB/s, "
              f"in {row['in_gbps']:5.2f} GB/s", flush=True)
        out.append(row)
    return out


def build_profile(shape: dict, step: dict, link: list[dict], raw: dict, max_total: int) -> dict:
    bench = REPO / "results" / "bench_policy.json"
    per_view = json.loads(bench.read_text())["mean_us"] / json.loads(bench.read_text())["n"] / 1e6 \
        if bench.exists() else 6.4e-7
    return {
        "name": "cpu-smollm2-135m",
        "comment": "Measured on our CPU dev server by scripts/profile_cpu_server.py; stock SGLang scheduling.",
        "sources": [f"measured {raw['date']} on {raw['machine']} ({raw['cpus']} CPUs, load average "
                    f"{raw['loadavg_before']} before / {raw['loadavg_after']} after)",
                    "results/bench_policy.json: lvf_decide cost per request view"],
        "assumptions": [
            "prefill intercept = TTFT of a lone request, so it includes HTTP and tokenizer-free "
            "request overhead; decode = median inter-token gap of identical concurrent requests",
            "rotation = RotationEngine 'torch' path on CPU (what the server uses), one direction at "
            "a time (duplex: none); segment = one layer's K (or V) of the moved tokens",
            "kv_tokens = the --max-total-tokens of the profiling run; replays override it",
            RESUME_ASSUMPTION,
            OVERHEAD_ASSUMPTION,
        ],
        "model": {"name": shape["name"], "layers": shape["layers"],
                  "kv_bytes_per_token": shape["kv_bytes_per_token"]},
        "server": {"kv_tokens": max_total, "chunked_prefill_tokens": 8192, "max_prefill_tokens": 16384,
                   "max_running_requests": 4096, "host_kv_tokens": 2_000_000,
                   "request_overhead_s": raw["overhead"]["overhead_s"],
                   # SGLang's overlap scheduler with a synchronous CPU forward (docs/sim.md)
                   "emit_after_next_step": True},
        "step": step,
        "link": {"name": "CPU memory (RotationEngine torch path)",
                 "segment_bytes": [r["segment_bytes"] for r in link],
                 "per_copy_d2h_gbps": [round(r["out_gbps"], 3) for r in link],
                 "per_copy_h2d_gbps": [round(r["in_gbps"], 3) for r in link],
                 "batched_d2h_gbps": round(link[-1]["out_gbps"], 3),
                 "batched_h2d_gbps": round(link[-1]["in_gbps"], 3)},
        "scheduler": {"lvf_s_per_view": per_view},
        "measurements": raw,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "profiles" / "cpu-smollm2-135m.json")
    ap.add_argument("--port", type=int, default=0, help="0: pick a free one")
    ap.add_argument("--max-total-tokens", type=int, default=16384)
    ap.add_argument("--quick", action="store_true", help="fewer points (a smoke run)")
    ap.add_argument("--stat", choices=("median", "low"), default="median",
                    help="fit typical (median) or least-contended (min / p10) times")
    ap.add_argument("--resume-only", action="store_true",
                    help="re-measure only step.per_resume_s into the existing --out profile")
    ap.add_argument("--overhead-only", action="store_true",
                    help="re-measure only server.request_overhead_s into the existing --out profile")
    args = ap.parse_args()
    reps = 2 if args.quick else 5
    if args.overhead_only:
        profile = json.loads(args.out.read_text())
        port = args.port or free_port()
        log = REPO / "results" / "sim_cpu_profile_overhead.log"
        proc = start_server(port, args.max_total_tokens, log)
        try:
            wait_ready(f"http://127.0.0.1:{port}", proc)
            stream(f"http://127.0.0.1:{port}", 16, 4, seed=1)  # warm-up
            over = measure_overhead(f"http://127.0.0.1:{port}", 2 * reps)
        finally:
            os.killpg(proc.pid, 15)
            proc.wait(timeout=60)
        over["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        profile["server"]["request_overhead_s"] = over["overhead_s"]
        profile["measurements"]["overhead"] = over
        if OVERHEAD_ASSUMPTION not in profile["assumptions"]:
            profile["assumptions"].append(OVERHEAD_ASSUMPTION)
        args.out.write_text(json.dumps(profile, indent=1) + "\n")
        print("wrote", args.out, "request_overhead_s:", over["overhead_s"])
        return
    if args.resume_only:
        profile = json.loads(args.out.read_text())
        resume = measure_resume(args.max_total_tokens, reps)
        resume["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        resume["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
        profile["step"]["per_resume_s"] = resume_cost(profile["step"], resume)
        profile["measurements"]["resume"] = resume
        if RESUME_ASSUMPTION not in profile["assumptions"]:
            profile["assumptions"].append(RESUME_ASSUMPTION)
        args.out.write_text(json.dumps(profile, indent=1) + "\n")
        print("wrote", args.out, "per_resume_s:", profile["step"]["per_resume_s"])
        return
    port = args.port or free_port()
    base = f"http://127.0.0.1:{port}"
    lengths = [32, 256, 1024] if args.quick else [32, 128, 256, 512, 1024]
    decodes = [(1, 64), (8, 64)] if args.quick else [(1, 64), (4, 64), (8, 64), (16, 64), (4, 768), (8, 768)]
    raw: dict = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 "machine": platform.node() or "unknown", "cpus": os.cpu_count(),
                 "loadavg_before": [round(x, 2) for x in os.getloadavg()],
                 "env": {k: v for k, v in os.environ.items() if k.startswith(("SUPERINFER_", "SGLANG_"))}}
    log = REPO / "results" / "sim_cpu_profile_server.log"
    log.parent.mkdir(exist_ok=True)
    proc = start_server(port, args.max_total_tokens, log)

    def stop(signum: int, _frame: object) -> None:  # threads may be blocked in HTTP reads
        os.killpg(proc.pid, signal.SIGTERM)
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        wait_ready(base, proc)
        stream(base, 16, 4, seed=1)  # warm-up
        raw["prefill"] = measure_prefill(base, lengths, reps=2 if args.quick else 3)
        raw["decode"] = [measure_decode(base, b, c, 16 if args.quick else 24) for b, c in decodes]
        raw["overhead"] = measure_overhead(base, 2 * reps)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)
    raw["resume"] = measure_resume(args.max_total_tokens, reps)
    shape = model_shape()
    raw["link"] = measure_link(shape, [64, 512, 2048])
    raw["loadavg_after"] = [round(x, 2) for x in os.getloadavg()]
    raw["fit_stat"] = args.stat
    raw["fit_low"] = fit_step(raw["prefill"], raw["decode"], "low")
    step = fit_step(raw["prefill"], raw["decode"], args.stat)
    step["per_resume_s"] = resume_cost(step, raw["resume"])
    profile = build_profile(shape, step, raw["link"], raw, args.max_total_tokens)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(profile, indent=1) + "\n")
    print("wrote", args.out, "\nstep fit:", json.dumps(profile["step"]))


if __name__ == "__main__":
    main()
