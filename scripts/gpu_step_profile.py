#!/usr/bin/env python3
"""Iteration time of a Qwen2.5-32B-shaped forward on the GPU machine, fitted to the simulator's StepModel.

Needs only torch (the GPU machine has no SGLang and no model weights): each of the 64 layers runs the
real layer's matrix products (QKV, O, gate/up, down at Qwen2.5-32B's shapes, bf16, random weights),
grouped-query attention over a KV cache of the given context (torch SDPA), SiLU-and-mul and the
residual adds; the LM head runs on the rows that produce a token. Norms and rotary embeddings are
left out (elementwise, under 1% of a step). Two weight sets alternate across layers; each is ~1 GB,
20x the L2, so every layer reads its weights from HBM as a real 32B model's would. No scheduler, no
CUDA graphs: the simulator's base_s (per-iteration overhead) is not measured here.

Measures, with CUDA events (median of --iters after a warm-up):
  ceilings   device-to-device copy GB/s (bytes read + written), bf16 8192^3 matrix product TFLOP/s
  decode     B requests x one token, each with C tokens of context, for several B and C
  prefill    one request of P tokens, causal, for several P
and fits (least squares): floor_s (the weight-read time of a memory-bound step), per_decode_token_s,
per_context_token_s, per_prefill_token_s, per_prefill_pair_s, prefill_base_s. Writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    """Qwen2.5-32B (Hugging Face config)."""

    layers: int = 64
    hidden: int = 5120
    intermediate: int = 27648
    q_heads: int = 40
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 152064


def bench(fn, iters: int) -> float:
    """Median seconds of fn() on the current stream, timed with CUDA events after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def ceilings(iters: int) -> dict:
    n = 2**30  # 1 GiB each way
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 256)
    dst = torch.empty_like(src)
    copy_s = bench(lambda: dst.copy_(src), iters)
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_s = bench(lambda: a @ b, iters)
    del src, dst, a, b
    return {"d2d_copy_gbps": 2 * n / copy_s / 1e9, "bf16_matmul_tflops": 2 * 8192**3 / mm_s / 1e12}


class Model:
    def __init__(self, shape: Shape) -> None:
        self.s = shape
        qkv = (shape.q_heads + 2 * shape.kv_heads) * shape.head_dim

        def w(rows: int, cols: int) -> torch.Tensor:
            return torch.randn(rows, cols, dtype=torch.bfloat16, device="cuda") * rows**-0.5

        self.sets = [dict(qkv=w(shape.hidden, qkv), o=w(shape.q_heads * shape.head_dim, shape.hidden),
                          gate_up=w(shape.hidden, 2 * shape.intermediate), down=w(shape.intermediate, shape.hidden))
                     for _ in range(2)]
        self.lm_head = w(shape.hidden, shape.vocab)

    def weight_bytes(self) -> int:
        per_layer = sum(t.numel() * 2 for t in self.sets[0].values())
        return per_layer * self.s.layers + self.lm_head.numel() * 2

    def _mlp_and_out(self, x: torch.Tensor, attn: torch.Tensor, w: dict) -> torch.Tensor:
        h = x + attn @ w["o"]
        g, u = (h @ w["gate_up"]).chunk(2, dim=-1)
        return h + (F.silu(g) * u) @ w["down"]

    def decode(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """x [B, hidden]; k, v [B, kv_heads, C, head_dim] (one layer's cache, read by every layer)."""
        s, b = self.s, x.shape[0]
        group = s.q_heads // s.kv_heads
        for layer in range(s.layers):
            w = self.sets[layer % 2]
            q = (x @ w["qkv"])[:, : s.q_heads * s.head_dim]
            q = q.view(b, s.kv_heads, group, s.head_dim)  # the query heads sharing one KV head
            attn = F.scaled_dot_product_attention(q, k, v).reshape(b, -1)
            x = self._mlp_and_out(x, attn, w)
        return x @ self.lm_head

    def prefill(self, x: torch.Tensor) -> torch.Tensor:
        """x [P, hidden]: one causal request."""
        s, p = self.s, x.shape[0]
        group = s.q_heads // s.kv_heads
        for layer in range(s.layers):
            w = self.sets[layer % 2]
            qkv = x @ w["qkv"]
            q, k, v = qkv.split([s.q_heads * s.head_dim, s.kv_heads * s.head_dim, s.kv_heads * s.head_dim], dim=-1)
            q = q.view(p, s.q_heads, s.head_dim).transpose(0, 1)[None]
            # KV heads repeated for the query heads: keeps SDPA on its flash kernel (P x 40 x 128 x 2
            # extra bytes per layer, ~1% of the layer's time at P=8192)
            k = k.view(p, s.kv_heads, s.head_dim).transpose(0, 1).repeat_interleave(group, dim=0)[None]
            v = v.view(p, s.kv_heads, s.head_dim).transpose(0, 1).repeat_interleave(group, dim=0)[None]
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = self._mlp_and_out(x, attn[0].transpose(0, 1).reshape(p, -1), w)
        return x[-1:] @ self.lm_head


def measure(model: Model, decode_points: list[tuple[int, int]], prefill_points: list[int], iters: int) -> dict:
    s = model.s
    rows: dict[str, list[dict]] = {"decode": [], "prefill": []}
    with torch.inference_mode():
        for b, c in decode_points:
            x = torch.randn(b, s.hidden, dtype=torch.bfloat16, device="cuda")
            k = torch.randn(b, s.kv_heads, c, s.head_dim, dtype=torch.bfloat16, device="cuda")
            v = torch.randn_like(k)
            t = bench(lambda: model.decode(x, k, v), iters)
            rows["decode"].append(dict(batch=b, context_per_req=c, context=b * c, seconds=t))
            print(f"  decode  B={b:>5} C={c:>6}  {t * 1e3:9.2f} ms", flush=True)
            del x, k, v
        for p in prefill_points:
            x = torch.randn(p, s.hidden, dtype=torch.bfloat16, device="cuda")
            t = bench(lambda: model.prefill(x), iters)
            rows["prefill"].append(dict(tokens=p, pairs=p * p / 2, seconds=t))
            print(f"  prefill P={p:>6}          {t * 1e3:9.2f} ms", flush=True)
            del x
    return rows


def fit(rows: dict, weight_bytes: int, hbm_gbps: float) -> dict:
    """StepModel parameters from the measured points (see sim/profile.py for the formula)."""
    dec = rows["decode"]
    # Context term: at a fixed batch, time grows with the KV read.
    by_b: dict[int, list[dict]] = {}
    for r in dec:
        by_b.setdefault(r["batch"], []).append(r)
    slopes = []
    for pts in by_b.values():
        if len({p["context"] for p in pts}) >= 2:
            x = np.array([p["context"] for p in pts], float)
            y = np.array([p["seconds"] for p in pts], float)
            slopes.append(np.polyfit(x, y, 1)[0])
    per_context = max(0.0, float(np.median(slopes))) if slopes else 0.0
    # Weight term: the smallest batch is memory-bound (floor); the largest gives the per-token cost.
    no_ctx = sorted(((r["batch"], r["seconds"] - per_context * r["context"]) for r in dec))
    floor = no_ctx[0][1]
    b_max, t_max = no_ctx[-1]
    per_decode = t_max / b_max
    # Prefill: base + max(floor, per_token * P) + pair * P^2/2, fitted where compute-bound.
    pre = rows["prefill"]
    a = np.array([[1.0, r["tokens"], r["pairs"]] for r in pre])
    y = np.array([r["seconds"] for r in pre])
    (base, per_tok, pair), *_ = np.linalg.lstsq(a, y, rcond=None)
    return dict(floor_s=floor, per_decode_token_s=per_decode, per_context_token_s=per_context,
                prefill_base_s=max(0.0, float(base)), per_prefill_token_s=max(0.0, float(per_tok)),
                per_prefill_pair_s=max(0.0, float(pair)),
                weight_read_at_hbm_s=weight_bytes / (hbm_gbps * 1e9),
                decode_batch_at_floor=floor / per_decode)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--layers", type=int, default=64, help="fewer for a quick check (times scale)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (run it on the GPU machine)")
    shape = Shape(layers=args.layers)
    t0 = time.time()
    ceil = ceilings(args.iters)
    print(f"ceilings: copy {ceil['d2d_copy_gbps']:.0f} GB/s, bf16 matmul {ceil['bf16_matmul_tflops']:.0f} TFLOP/s")
    model = Model(shape)
    decode_points = [(1, 512), (8, 512), (32, 512), (128, 512), (256, 512), (512, 512), (1024, 128),
                     (2048, 64), (64, 256), (64, 1024), (64, 4096), (256, 2048)]
    prefill_points = [512, 1024, 2048, 4096, 8192]
    rows = measure(model, decode_points, prefill_points, args.iters)
    fitted = fit(rows, model.weight_bytes(), ceil["d2d_copy_gbps"])  # a copy counts bytes read + written
    result = dict(meta=dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                            time=time.strftime("%Y-%m-%d %H:%M:%S"), shape=asdict(shape),
                            weight_bytes=model.weight_bytes(), iters=args.iters, wall_s=time.time() - t0),
                  ceilings=ceil, points=rows, fit=fitted)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print("fit:", " ".join(f"{k}={v:.4g}" for k, v in fitted.items()))


if __name__ == "__main__":
    main()
