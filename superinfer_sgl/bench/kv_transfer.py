"""KV transfer benchmark for DuplexKV: GB/s and latency of the rotation engine's own copy paths.

    python -m superinfer_sgl.bench.kv_transfer                 # the GPU run (scripts/bench_kv_transfer.py too)
    python -m superinfer_sgl.bench.kv_transfer --quick         # one block size + the rotation, a minute or two
    python -m superinfer_sgl.bench.kv_transfer --cpu-smoke     # tiny sizes on a CPU

Needs only torch (+ triton for the kernel paths), no SGLang, so it runs on the GPU machine. Sections:
  sweep      block sizes (64 KB .. 16 MB per block of block_tokens x layers x {K,V}), one way and
             both ways at once, for the ceiling, the engine's paths and the HiCache-like reference
             (transfer_rig.py says what each is)
  sm_sweep   both kernel paths at one block size with 1..all programs
  segments, segments_graph
             back-to-back copies of one contiguous segment size (the simulator's link model),
             issued from Python and from a captured CUDA graph
  tuning     both kernel paths for several tile sizes and warp counts
  ring       triton-dma's staging ring (slots x slot size) at 2 MB blocks, beside its serial form and
             the ceiling
  rotation   a Llama-3-8B-shaped request (32 layers, 8 KV heads, head_dim 128, bf16, 4096 tokens)
             out, in, and both at once through RotationEngine, checked bit-exact; on a GPU also the
             path `auto` picks by its startup probe
The JSON is rewritten after each section, so a run cut off by its time limit keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

from ..duplexkv.staging_ring import DEFAULT_RING_SLOTS, DEFAULT_SLOT_BYTES
from .transfer_rig import KERNEL_METHODS, MB, METHODS, Config, Shape, Streams
from .transfer_sweeps import (
    run_ring_sweep,
    run_rotation,
    run_segment_sweep,
    run_segment_sweep_graph,
    run_sm_sweep,
    run_sweep,
    run_tuning_sweep,
)

SECTIONS = {"sweep": run_sweep, "sm_sweep": run_sm_sweep, "segments": run_segment_sweep,
            "segments_graph": run_segment_sweep_graph, "tuning": run_tuning_sweep, "ring": run_ring_sweep,
            "rotation": run_rotation}
QUICK_SECTIONS = ("rotation", "sweep")


def config_from_args(args: argparse.Namespace) -> Config:
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        raise SystemExit("no CUDA device: run with --cpu-smoke")
    methods = [m for m in METHODS if m not in KERNEL_METHODS or cuda or os.environ.get("TRITON_INTERPRET") == "1"]
    if args.methods:
        unknown = set(args.methods.split(",")) - set(METHODS)
        if unknown:
            raise SystemExit(f"unknown methods {sorted(unknown)}; known: {METHODS}")
        methods = [m for m in methods if m in args.methods.split(",")]
    ring = {k: v for k, v in (("ring_slots", args.ring_slots),
                              ("ring_slot_bytes", args.ring_slot_mb and int(args.ring_slot_mb * MB))) if v}
    if cuda:
        return Config(
            device=torch.device("cuda"),
            shape=Shape(8, 128, torch.bfloat16, 32),
            block_sizes=[4 * MB] if args.quick else [64 * 2**10, 256 * 2**10, MB, 4 * MB, 16 * MB],
            volume=int(args.gib * 2**30),
            iters=args.iters,
            max_sms=args.max_sms,
            max_copy_ops=4096 if args.quick else 16384,  # quick: per-page methods cut to a few seconds
            methods=methods,
            rotation=dict(layers=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, tokens=4096, block_tokens=16),
            ring=ring,
        )
    return Config(
        device=torch.device("cpu"),
        shape=Shape(2, 16, torch.float16, 4),
        block_sizes=[2**10, 4 * 2**10, 16 * 2**10],
        volume=64 * 2**10,
        iters=2,
        max_sms=args.max_sms,
        max_copy_ops=256,
        methods=methods,
        rotation=dict(layers=2, kv_heads=2, head_dim=16, dtype=torch.float16, tokens=64, block_tokens=4),
        ring=ring,
    )


def meta(cfg: Config) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    cuda = cfg.device.type == "cuda"
    return dict(
        device=torch.cuda.get_device_name(cfg.device) if cuda else f"cpu ({platform.processor() or platform.machine()})",
        sms=torch.cuda.get_device_properties(cfg.device).multi_processor_count if cuda else None,
        torch=torch.__version__,
        triton=triton_version,
        triton_interpret=os.environ.get("TRITON_INTERPRET") == "1",
        mode="gpu" if cuda else "cpu-smoke",
        kv_heads=cfg.shape.kv_heads,
        head_dim=cfg.shape.head_dim,
        dtype=str(cfg.shape.dtype),
        volume_bytes_per_direction=cfg.volume,
        max_sms=cfg.max_sms,
        iters=cfg.iters,
        ring=cfg.ring or dict(ring_slots=DEFAULT_RING_SLOTS, ring_slot_bytes=DEFAULT_SLOT_BYTES),
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
    )


def plot(result: dict, png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (re-plot with --plot-from)", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5), sharey=True)
    for ax, direction in zip(axes, ("out", "in", "both")):
        rows = [r for r in result["sweep"] if r.get("direction") == direction]
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["block_bytes"], r["gbps_per_direction"]) for r in rows if r["method"] == method)
            ax.plot([p[0] / 2**10 for p in pts], [p[1] for p in pts], marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (KiB)")
        ax.set_title({"out": "device -> host", "in": "host -> device", "both": "both at once (per direction)"}[direction])
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("GB/s")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"KV transfer, {result['meta']['device']}")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    return True


def summarize(result: dict) -> None:
    print(f"device: {result['meta']['device']}")
    for r in result.get("sweep", []):
        if "error" in r:
            print(f"  {r['method']:<34} {r['block_bytes']:>9} B  ERROR {r['error']}")
            continue
        if r["direction"] == "out-one-block":
            print(f"  {r['method']:<34} {r['block_bytes']:>9} B  one block out {r['latency_us']:10.1f} us")
        else:
            print(f"  {r['method']:<34} {r['block_bytes']:>9} B  {r['direction']:<5} {r['gbps_per_direction']:9.3f} GB/s")
    for r in result.get("sm_sweep", []):
        if "error" not in r:
            print(f"  {r['method']:<14} {r['direction']:<3} {r['programs']:>4} programs {r['gbps']:8.2f} GB/s")
    for key, label in (("segments", "segment"), ("segments_graph", "graph segment")):
        for r in result.get(key, []):
            if "error" not in r:
                print(f"  {label} {r['segment_bytes']:>9} B x {r['copies']:>5} {r['direction']:<4} "
                      f"{r['gbps_per_direction']:8.2f} GB/s")
    for r in result.get("tuning", []):
        if "error" not in r:
            print(f"  tuning {r['method']:<14} tile {r['tile_words']:>6} warps {r['num_warps']:>2} {r['direction']:<4} "
                  f"{r['gbps_per_direction']:8.2f} GB/s")
    for r in result.get("ring", []):
        if "error" not in r:
            ring = f"{r['ring_slots']} x {r['slot_bytes'] / MB:g} MiB" if "ring_slots" in r else ""
            print(f"  ring {r['method']:<18} {ring:<14} {r['direction']:<4} {r['gbps_per_direction']:8.2f} GB/s")
    for line in ceiling_ratios(result.get("sweep", []) + result.get("ring", [])):
        print(line)
    for r in result.get("rotation", []):
        if "error" in r:
            print(f"  rotation {r['transfer']:<14} ERROR {r['error']}")
        elif "chosen" in r:
            print(f"  rotation auto picks {r['chosen']} (probe, duplex ms per path: {r['probe_duplex_ms']})")
        else:
            print(f"  rotation {r['transfer']:<14} out {r['out_ms']:9.2f} ms ({r['out_gbps']:.2f} GB/s) "
                  f"in {r['in_ms']:9.2f} ms ({r['in_gbps']:.2f} GB/s) both {r['duplex_ms']:9.2f} ms "
                  f"({r['duplex_gbps_per_direction']:.2f} GB/s each way; engine copy ms {r['engine_copy_ms']}) "
                  f"exact={r['bit_exact']}")


def ceiling_ratios(rows: list[dict]) -> list[str]:
    """Each dma path's GB/s as a share of the pinned cudaMemcpy on the same rig (issue 34: >= 90%)."""
    ceiling = {(r["block_bytes"], r["direction"]): r["gbps_per_direction"] for r in rows
               if r.get("method") == "memcpy-ceiling" and "gbps_per_direction" in r}
    lines = []
    for r in rows:
        key = (r.get("block_bytes"), r.get("direction"))
        if r.get("method") in ("triton-dma", "triton-dma-serial", "triton-hybrid") and key in ceiling \
                and "gbps_per_direction" in r:
            ring = f" ring {r['ring_slots']}x{r['slot_blocks']} blocks" if "ring_slots" in r else ""
            lines.append(f"  {r['method']:<18} {key[0]:>9} B {key[1]:<5}{ring} "
                         f"{100 * r['gbps_per_direction'] / ceiling[key]:6.1f}% of the pinned copy")
    return lines


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m superinfer_sgl.bench.kv_transfer", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=None, help="JSON path (default: results/kv_transfer_<device>.json)")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")
    p.add_argument("--max-sms", type=int, default=8, help="cap on the kernel paths' persistent grid")
    p.add_argument("--gib", type=float, default=1.0, help="GiB moved per direction per measurement (GPU)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--ring-slots", type=int, default=None,
                   help=f"triton-dma's staging ring: slots (default {DEFAULT_RING_SLOTS}, the engine's)")
    p.add_argument("--ring-slot-mb", type=float, default=None,
                   help=f"triton-dma's staging ring: MiB per slot (default {DEFAULT_SLOT_BYTES / MB:g}, the engine's)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny CPU run (Triton paths need TRITON_INTERPRET=1)")
    p.add_argument("--quick", action="store_true",
                   help=f"only {', '.join(QUICK_SECTIONS)} (one 4 MB block size on a GPU)")
    p.add_argument("--methods", help=f"comma list from {','.join(METHODS)} (default: all that can run here)")
    p.add_argument("--sections", help=f"comma list from {','.join(SECTIONS)} (default: all, or --quick's)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds: start no section after this much time has passed")
    p.add_argument("--plot-from", type=Path, default=None, help="only re-plot an existing JSON")
    return p.parse_args(argv)


def sections(args: argparse.Namespace) -> list[str]:
    names = args.sections.split(",") if args.sections else list(QUICK_SECTIONS if args.quick else SECTIONS)
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; known: {list(SECTIONS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.plot_from:
        plot(json.loads(args.plot_from.read_text()), args.plot or args.plot_from.with_suffix(".png"))
        return 0
    names = sections(args)
    cfg = config_from_args(args)
    streams = Streams(cfg.device)
    device = torch.cuda.get_device_name() if cfg.device.type == "cuda" else "cpu"
    out = args.out or Path("results") / f"kv_transfer_{slug(device)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"meta": {**meta(cfg), "sections": names}, "skipped": []}
    t_start = time.perf_counter()
    for name in names:  # the JSON is rewritten after each section: a cut-off run keeps its data
        if args.time_limit is not None and time.perf_counter() - t_start > args.time_limit:
            result["skipped"].append(name)
            continue
        t0 = time.perf_counter()
        result[name] = SECTIONS[name](cfg, streams)
        out.write_text(json.dumps(result, indent=1))
        print(f"[{name}: {time.perf_counter() - t0:.1f} s]", file=sys.stderr, flush=True)
    out.write_text(json.dumps(result, indent=1))
    summarize(result)
    png = args.plot or out.with_suffix(".png")
    print(f"wrote {out}" + (f" and {png}" if "sweep" in result and plot(result, png) else ""))
    return 0


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")


if __name__ == "__main__":
    sys.exit(main())
