"""What a rotary KV format buys when the host pool is the limit (issue 36 item 3), in the simulator.

A host pool of fixed bytes holds more paused requests in a narrower format: the token capacity of
each format is the byte budget over its block bytes (`duplexkv.host_pool.block_bytes`, the server's
own sizing: int4's scale bytes and fp8's per-block scales counted), and rotations move that many
fewer bytes over the link. Everything else is the server as shipped (`goodput`, its quantum and
running reserve), so the only difference between the rows of one budget is the format. When the
pool is full a rotation falls back to recomputing the request (the server's host-full fallback).

What the simulator does not model: the formats' accuracy cost (measured on the real model:
docs/duplexkv.md, "Accuracy by format"), and the quantize / dequantize kernels' time (the copies
are timed at the link's speed for the format's bytes).

    python scripts/sim_host_formats.py --out results/sim_host_formats
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import subprocess
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from superinfer_sgl.duplexkv.host_pool import block_bytes
from superinfer_sgl.sim.profile import PROFILE_DIR, resolve_profile
from superinfer_sgl.sim.runner import Job, run_jobs

FORMATS = ("auto", "fp8_e4m3", "int4")
BLOCK_TOKENS = 16


def format_bytes(fmt: str, layers: int, kv_heads: int, head_dim: int) -> float:
    """Host bytes per token of `fmt` for a bfloat16 device pool (per-block overheads spread)."""
    return block_bytes(layers, kv_heads, head_dim, BLOCK_TOKENS, torch.bfloat16, fmt) / BLOCK_TOKENS


def profile_for(base: dict, host_gb: float, token_bytes: float, out: Path) -> str:
    """A copy of the profile whose host pool holds `host_gb` GiB of `token_bytes`-byte tokens and
    whose copies move that many bytes per token."""
    prof = json.loads(json.dumps(base))
    prof["server"]["host_kv_tokens"] = int(host_gb * 2**30 // token_bytes)
    prof["model"]["kv_bytes_per_token"] = int(round(token_bytes))
    prof["name"] = f"{base['name']}-host{host_gb:g}GiB-{int(round(token_bytes))}B"
    out.write_text(json.dumps(prof))
    return str(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="h100-pcie5-qwen2.5-32b")
    ap.add_argument("--workload", default="sharegpt-like")
    ap.add_argument("--rates", default="8,12", help="req/s (comma list)")
    ap.add_argument("--host-gb", default="1,4,16", help="host pool budgets in GiB (comma list)")
    ap.add_argument("--kv-heads", type=int, default=8, help="the model's KV heads (Qwen2.5-32B: 8)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--ttft-slo-ms", type=float, default=5000)
    ap.add_argument("--tbt-slo-ms", type=float, default=100)
    ap.add_argument("--duration", type=float, default=120)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--policies", default="goodput,paper", help="comma list (the server's policies)")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("results/sim_host_formats"))
    a = ap.parse_args(argv)

    resolve_profile(a.profile)  # a clear error for an unknown name
    path = Path(a.profile) if Path(a.profile).exists() else PROFILE_DIR / f"{a.profile}.json"
    base = json.loads(path.read_text())
    layers = base["model"]["layers"]
    dense = format_bytes("auto", layers, a.kv_heads, a.head_dim)
    if abs(dense - base["model"]["kv_bytes_per_token"]) > 1:
        raise SystemExit(f"--kv-heads/--head-dim give {dense:.0f} B/token in bf16, the profile says "
                         f"{base['model']['kv_bytes_per_token']}: pass the model's geometry")
    rates = [float(x) for x in a.rates.split(",")]
    budgets = [float(x) for x in a.host_gb.split(",")]
    policies = a.policies.split(",")
    per_token = {f: format_bytes(f, layers, a.kv_heads, a.head_dim) for f in FORMATS}

    jobs, keys = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for gb in budgets:
            for fmt in FORMATS:
                prof = profile_for(base, gb, per_token[fmt], Path(tmp) / f"{gb:g}-{fmt}.json")
                for policy in policies:
                    for rate in rates:
                        for s in range(a.seeds):
                            jobs.append(Job(prof, policy, a.workload, rate, a.duration, s,
                                            a.ttft_slo_ms / 1000, a.tbt_slo_ms / 1000, mixed_chunk=True))
                            keys.append((gb, fmt, policy, rate, s))
        results = run_jobs(jobs, a.jobs, progress=True)

    rows = []
    for policy, gb, rate, fmt in itertools.product(policies, budgets, rates, FORMATS):
        mine = [r for k, r in zip(keys, results) if k[:4] == (gb, fmt, policy, rate)]
        n = sum(r["requests"] for r in mine)
        rows.append({
            "policy": policy, "host_gb": gb, "format": fmt, "rate": rate, "seeds": len(mine), "requests": n,
            "host_tokens": int(gb * 2**30 // per_token[fmt]),
            "bytes_per_token": per_token[fmt],
            "joint_attainment": sum(r["both_attainment"] * r["requests"] for r in mine) / n,
            "throughput_tok_s": sum(r["throughput_tok_s"] for r in mine) / len(mine),
            "peak_rotary": max(r["peak_rotary"] for r in mine),
            "rotations_out": sum(r["rotations_out"] for r in mine),
            "host_full_fallbacks": sum(r["host_full_fallbacks"] for r in mine),
            "retractions": sum(r["retractions"] for r in mine),
        })
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    doc = {"command": "python scripts/sim_host_formats.py " + " ".join(argv or __import__("sys").argv[1:]),
           "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "commit": commit, "machine": platform.node(), "args": {k: str(v) for k, v in vars(a).items()},
           "bytes_per_token": per_token, "rows": rows}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "formats.json").write_text(json.dumps(doc, indent=1))
    lines = [f"# Host pool as the limit: rotary KV formats ({a.profile}, {a.workload}, "
             f"{a.ttft_slo_ms:g} ms / {a.tbt_slo_ms:g} ms, {a.seeds} seeds x {a.duration:g} s each)", "",
             f"`{doc['command']}` ({doc['date_utc']}, {commit})", "",
             "| policy | host pool | rate req/s | format | host tokens | most paused at once | host-full recomputes | joint | tok/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['host_gb']:g} GiB | {r['rate']:g} | {r['format']} | {r['host_tokens']:,} | {r['peak_rotary']} "
                     f"| {r['host_full_fallbacks']} | {100 * r['joint_attainment']:.1f}% | {r['throughput_tok_s']:.0f} |")
    (a.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
