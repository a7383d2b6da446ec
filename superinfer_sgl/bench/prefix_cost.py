"""What the reuse predictor costs (rotasched/prefix_reuse.py), measured, not asserted:

    python -m superinfer_sgl.bench.prefix_cost --out results/prefix_cache/predictor_cost.json

- per hit: `ReusePredictor.hit` (our match_prefix hook calls it once per node on a request's
  matched path);
- per eviction round: `EvictionRanker.begin_round` over N evictable leaves (score every leaf,
  sort, pick the pin set) plus the `priority` key SGLang's heap asks for each leaf;
- per scheduler step, the worst case we can reach: a prefill batch of B requests each matching a
  path of D nodes, plus one eviction round over N leaves.
Times are medians over repeats of this process's CPU time (time.process_time): on a shared
machine wall time mostly measures waiting for a core; `wall_*` gives the wall-clock medians too.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from ..rotasched.prefix_reuse import EvictionRanker, Leaf, ReusePredictor


def _median_s(fn, repeats: int) -> tuple[float, float]:  # noqa: ANN001
    cpu, wall = [], []
    for _ in range(repeats):
        c, w = time.process_time(), time.perf_counter()
        fn()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return statistics.median(cpu), statistics.median(wall)


def measure(leaves: int, batch: int, depth: int, repeats: int) -> dict[str, float]:
    p = ReusePredictor()
    now = [0.0]
    for i in range(leaves):
        p.hit(i, float(i) * 1e-3)
    ranker = EvictionRanker(p, pool_tokens=leaves * 100)
    leaf_list = [Leaf(i, 100 + i % 500, 50) for i in range(leaves)]

    def hits() -> None:
        now[0] += 0.01
        for b in range(batch):
            for d in range(depth):
                p.hit((b * 7919 + d) % leaves, now[0])

    def round_() -> None:
        now[0] += 0.01
        ranker.begin_round(leaf_list, now[0])
        for leaf in leaf_list:
            ranker.priority(leaf.node, 0.0)

    hit_s, hit_wall = _median_s(hits, repeats)
    round_s, round_wall = _median_s(round_, max(3, repeats // 4))
    return {"leaves": leaves, "batch": batch, "depth": depth,
            "per_hit_us": hit_s / (batch * depth) * 1e6, "hits_per_step_ms": hit_s * 1e3,
            "eviction_round_ms": round_s * 1e3, "per_leaf_us": round_s / leaves * 1e6,
            "worst_step_ms": (hit_s + round_s) * 1e3,
            "wall_hits_per_step_ms": hit_wall * 1e3, "wall_eviction_round_ms": round_wall * 1e3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/prefix_cache/predictor_cost.json")
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    rows = [measure(n, b, d, args.repeats) for n, b, d in ((100, 8, 4), (1000, 32, 8), (10000, 64, 8))]
    doc = {"machine": f"{platform.node()} {platform.machine()}", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ"),
           "command": "python -m superinfer_sgl.bench.prefix_cost", "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
