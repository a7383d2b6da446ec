"""Rotation on a GPU server: our launcher inside SGLang on CUDA, forced rotations, bytes and tokens checked.

Runs on the lent GPU machine (scripts/gpu_server_check.sh calls it). Two servers side by side on the
same random-weight model (--load-format dummy; bfloat16 on CUDA, float32 on CPU): SGLang's stock
scheduling (the control) and RotaSched with a rotation forced every few iterations, eager copies on
and the KV byte check (SUPERINFER_VERIFY_ROTATION=1). Each gets the e2e suite's prompts alone, then all at once.

What it shows: the byte check is the lossless proof (KV bytes hashed at rotate-out equal the bytes
the request reads after resuming; `changed` must be 0). Token equality with the request served
alone is reported for both servers: where the control itself differs, the GPU kernels are not batch
invariant and token equality cannot tell rotation apart from batching.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from serverutil import Server, generate, start_server  # noqa: E402

SYSTEM = "You are a helpful assistant that answers briefly and precisely. "
PROMPTS = [
    SYSTEM + "Name three colours of the rainbow.",
    SYSTEM + "What is two plus two?",
    SYSTEM + "Describe a cat in one sentence.",
    "The quick brown fox jumps over the lazy dog. " * 12 + "Summarise this text.",
    SYSTEM + "Write a haiku about the sea.",
    "List the planets of the solar system in order from the sun:",
    SYSTEM + "Describe a cat in one sentence, then a dog.",
    "Once upon a time, in a small village by the mountains,",
]
NEW_TOKENS = 48
COUNTERS = ('superinfer_rotations_out_total', 'superinfer_resumes_total',
            'superinfer_kv_verify_total{outcome="identical"}', 'superinfer_kv_verify_total{outcome="changed"}',
            'superinfer_rotation_bytes_total{direction="out"}', 'superinfer_rotation_bytes_total{direction="in"}',
            'superinfer_rotation_bytes_total{direction="eager_out"}',
            'superinfer_prefetches_total{outcome="started"}', 'superinfer_prefetches_total{outcome="hit"}',
            'superinfer_prefetches_total{outcome="cancelled"}')


def served(server: Server) -> dict:
    alone = {p: generate(server, p, max_new_tokens=NEW_TOKENS)["output_ids"] for p in PROMPTS}
    before = server.metrics()
    t0 = time.time()
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: generate(server, p, max_new_tokens=NEW_TOKENS), PROMPTS))
    wall = time.time() - t0
    after = server.metrics()
    same = [r["output_ids"] == alone[p] for p, r in zip(PROMPTS, together)]
    rotations = sum(r["meta_info"].get("superinfer", {}).get("superinfer_rotations", 0) for r in together)
    return {"equal_to_alone": sum(same), "of": len(PROMPTS), "rotations_in_meta": rotations,
            "concurrent_wall_s": round(wall, 3),
            "counters": {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", required=True, help="config.json + tokenizer (weights: dummy)")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script on the dev machine")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    # bfloat16 on CUDA: SGLang's RMSNorm there (sgl_kernel) has no float32 kernel
    dtype = "bfloat16" if a.device == "cuda" else "float32"
    common = ["--model-path", a.model_path, "--load-format", "dummy", "--device", a.device, "--dtype", dtype,
              "--max-total-tokens", "4096", "--chunked-prefill-size", "64", "--enable-metrics"]
    if a.device == "cuda":
        common += ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--disable-cuda-graph",
                   "--mem-fraction-static", "0.1"]
    rota_env = {"SUPERINFER_TEST_ROTATE_INTERVAL": "3", "SUPERINFER_VERIFY_ROTATION": "1"}
    specs = {"control": (["--scheduler", "sglang", *common], None),
             "rotasched": ([*common, "--eager-sync"], rota_env)}
    result: dict = {"model": json.loads((Path(a.model_path) / "config.json").read_text()).get("model_type"),
                    "new_tokens": NEW_TOKENS}
    with cf.ThreadPoolExecutor(2) as pool:  # start both at once: the startups are most of the time
        futs = {n: pool.submit(start_server, args, a.out / f"{n}.log", env=env) for n, (args, env) in specs.items()}
        servers = {}
        for n, f in futs.items():
            try:
                servers[n] = f.result()
            except RuntimeError as exc:
                result[n] = {"error": str(exc)[-2000:]}
    try:
        for n, s in servers.items():
            result[n] = served(s)
            (a.out / "lossless.json").write_text(json.dumps(result, indent=1))
    finally:
        for n, s in servers.items():
            result.setdefault(n, {})["processes_left"] = s.stop()
    (a.out / "lossless.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    rota = result.get("rotasched", {}).get("counters", {})
    ok = rota.get('superinfer_kv_verify_total{outcome="identical"}', 0) > 0 and \
        rota.get('superinfer_kv_verify_total{outcome="changed"}', 1) == 0
    print("LOSSLESS BYTES:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
