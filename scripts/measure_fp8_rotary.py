"""What lossy rotary host blocks (--rotary-kv-dtype fp8_e4m3 or int4) cost in accuracy, on the real model.

Starts our server twice on the default model (SmolLM2-135M-Instruct, float32 on CPU) with forced
rotations every N iterations (SUPERINFER_TEST_ROTATE_INTERVAL): once with the default bit-exact
rotation, once with lossy host blocks (--format: fp8_e4m3, the default, or int4). Each server gets the same prompts, all at once (so requests are
batched and rotated; --concurrency in flight), greedy, with the chosen tokens' logprobs. The bit-exact server answers the
batch twice: its second pass against its first is the noise floor of batching alone (CPU float32
kernels depend on the batch's shape); the lossy pass against the first bit-exact pass is the cost.

Reported per comparison: sequences identical, greedy token agreement (positions equal / positions),
the first divergence, and mean / max |logprob difference| of the chosen tokens over the common prefix
(positions before the first divergence, where both runs condition on the same tokens).

    PYTHONPATH=$PWD:$PWD/triton_kernels .venv/bin/python scripts/measure_fp8_rotary.py \
        --prompts 16 --max-new-tokens 32 --rotate-interval 4 --concurrency 4 --out results/fp8_rotary/smollm2_cpu.json
    PYTHONPATH=$PWD:$PWD/triton_kernels .venv/bin/python scripts/measure_fp8_rotary.py --format int4 \
        --prompts 16 --max-new-tokens 32 --rotate-interval 4 --concurrency 4 --out results/int4_rotary/smollm2_cpu.json

The report names the lossy run and its comparison by format: "fp8" / "fp8_vs_exact" for fp8_e4m3 (as
before this option existed), "int4" / "int4_vs_exact" for int4.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serverutil import Server  # noqa: E402

COMMON = ["--dtype", "float32", "--max-total-tokens", "4096", "--chunked-prefill-size", "64", "--log-level", "info"]
TOPICS = ["the history of Rome", "how a refrigerator works", "why the sky is blue", "the rules of chess",
          "photosynthesis", "the French revolution", "black holes", "how to bake bread", "the water cycle",
          "machine learning", "the Pacific ocean", "volcanoes", "the printing press", "jazz music",
          "the human heart", "electric cars", "the moon landing", "honey bees", "the stock market",
          "ancient Egypt", "solar panels", "the Olympic games", "rainforests", "the internet",
          "Shakespeare", "earthquakes", "coffee", "the Roman alphabet", "glaciers", "vaccines",
          "the Great Wall of China", "submarines"]
STYLES = ["Explain {} to a child.", "Write a short paragraph about {}.", "List three facts about {}.",
          "What is the most surprising thing about {}?"]


# --format -> the short name of its run and report keys ("fp8" keeps the fp8-only script's names)
FORMATS = {"fp8_e4m3": "fp8", "int4": "int4"}


def prompts(n: int) -> list[str]:
    return [STYLES[i % len(STYLES)].format(TOPICS[i % len(TOPICS)]) + f" (#{i})" for i in range(n)]


def start(port: int, extra: list[str], env: dict[str, str], log: Path, timeout_s: float = 400) -> Server:
    cmd = [sys.executable, "-m", "superinfer_sgl.launch_server", "--port", str(port), *COMMON, *extra]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, **env})
    server = Server(proc, port, log)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-3000:]}")
        try:
            if "ready to roll" in server.log() and requests.get(server.url + "/health", timeout=5).ok:
                return server
        except requests.RequestException:
            pass
        time.sleep(1)
    server.stop()
    raise RuntimeError(f"server did not start in {timeout_s}s")


def generate_all(server: Server, texts: list[str], max_new: int, concurrency: int) -> list[dict]:
    def one(text: str) -> dict:
        body = {"text": text, "return_logprob": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True}}
        r = requests.post(server.url + "/generate", json=body, timeout=1200)
        r.raise_for_status()
        meta = r.json()["meta_info"]
        return {"tokens": [t[1] for t in meta["output_token_logprobs"]],
                "logprobs": [t[0] for t in meta["output_token_logprobs"]],
                "rotations": meta.get("superinfer", {}).get("superinfer_rotations", 0),
                "recomputes": meta.get("superinfer", {}).get("superinfer_recomputes", 0)}

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, texts))


def compare(a: list[dict], b: list[dict]) -> dict:
    equal = positions = identical = 0
    first_div: list[int] = []
    diffs: list[float] = []
    for x, y in zip(a, b):
        n = min(len(x["tokens"]), len(y["tokens"]))
        same = [x["tokens"][i] == y["tokens"][i] for i in range(n)]
        equal += sum(same)
        positions += n
        identical += all(same) and len(x["tokens"]) == len(y["tokens"])
        k = same.index(False) if False in same else n
        if k < n:
            first_div.append(k)
        diffs += [abs(x["logprobs"][i] - y["logprobs"][i]) for i in range(k)
                  if x["logprobs"][i] is not None and y["logprobs"][i] is not None]
    return {
        "sequences": len(a), "sequences_identical": identical,
        "token_agreement": equal / max(positions, 1), "positions": positions,
        "first_divergence": sorted(first_div),
        "mean_abs_logprob_diff_common_prefix": statistics.fmean(diffs) if diffs else 0.0,
        "max_abs_logprob_diff_common_prefix": max(diffs, default=0.0),
        "logprob_positions": len(diffs),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--rotate-interval", type=int, default=2)
    ap.add_argument("--concurrency", type=int, default=4,
                    help="requests in flight at once (many more, with frequent forced rotations, make "
                         "little progress on a 2-core CPU)")
    ap.add_argument("--format", choices=sorted(FORMATS), default="fp8_e4m3",
                    help="the lossy host format measured against bit-exact rotation (--rotary-kv-dtype)")
    ap.add_argument("--port", type=int, default=32180, help="the lossy server uses port + 1")
    ap.add_argument("--out", type=Path, default=None,
                    help="default: results/fp8_rotary/smollm2_cpu.json (fp8_e4m3), "
                         "results/int4_rotary/smollm2_cpu.json (int4)")
    args = ap.parse_args()
    lossy = FORMATS[args.format]
    if args.out is None:
        args.out = ROOT / f"results/{lossy}_rotary/smollm2_cpu.json"
    live: list[Server] = []

    def on_term(*_: object) -> None:  # a timeout's TERM: stop our server (requests may be in flight)
        for server in live:
            server.stop()
        os._exit(143)

    signal.signal(signal.SIGTERM, on_term)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    texts = prompts(args.prompts)
    env = {"SUPERINFER_TEST_ROTATE_INTERVAL": str(args.rotate_interval)}
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    runs: dict[str, list[dict]] = {}
    for name, port, extra in (("exact", args.port, []), (lossy, args.port + 1, ["--rotary-kv-dtype", args.format])):
        server = start(port, extra, env, Path(tempfile.gettempdir()) / f"{lossy}_rotary_server_{name}.log")
        live[:] = [server]
        try:
            t0 = time.time()
            runs[name] = generate_all(server, texts, args.max_new_tokens, args.concurrency)
            if name == "exact":
                runs["exact_again"] = generate_all(server, texts, args.max_new_tokens, args.concurrency)
            print(f"{name}: {time.time() - t0:.0f} s", flush=True)
        finally:
            server.stop()
    report = {
        "command": " ".join(["python", *sys.argv]),
        "started_utc": started, "finished_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_avg_at_end": os.getloadavg(),
        "model": "SmolLM2-135M-Instruct (server default), float32 on CPU",
        "prompts": args.prompts, "concurrency": args.concurrency, "max_new_tokens": args.max_new_tokens,
        "rotate_interval": args.rotate_interval,
        "rotations": {k: sum(r["rotations"] for r in v) for k, v in runs.items()},
        "recompute_fallbacks": {k: sum(r["recomputes"] for r in v) for k, v in runs.items()},
        **({} if args.format == "fp8_e4m3" else {"format": args.format}),
        f"{lossy}_vs_exact": compare(runs["exact"], runs[lossy]),
        "exact_vs_exact_again (noise floor: batching alone)": compare(runs["exact"], runs["exact_again"]),
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "command"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
