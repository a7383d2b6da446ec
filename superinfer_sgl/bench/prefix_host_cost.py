"""What the prefix host tier costs on this machine's CPU (integration/prefix_host.py), measured:

    python -m superinfer_sgl.bench.prefix_host_cost --out results/prefix_cache/host_cost.json

On SGLang's real radix tree (Python tree core) over an MHATokenToKVPool on the CPU with a model's
KV geometry (default SmolLM2-135M's, the embedded CPU model: 30 layers, 3 KV heads of 64, float32;
`--geometry llama8b`: 32 x 8 x 128, bfloat16), with our hooks:

- demotion: one leaf of n tokens evicted and copied to host (our evict_device_leaf hook: the
  store's decision plus the DuplexKV copy, torch path), per token;
- restore: a request's match that brings it back (allocate, copy, insert, match again), per token;
- the hooks' cost when nothing moves, per call (on a one-layer pool: nothing is copied there): a match with a request when the host store holds
  entries none of which continues it (what every waiting request pays each step), and an evicted
  leaf below the demotion threshold (dropped as before).
Times are medians over repeats of wall time (time.perf_counter) and of this process's CPU time.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

GEOMETRIES = {"smollm2-135m": (30, 3, 64, "float32"), "llama8b": (32, 8, 128, "bfloat16"), "tiny": (1, 1, 4, "float32")}


def _tree(pool_tokens: int, host_tokens: int, geometry: str, min_score: float | None) -> tuple[Any, Any]:
    import torch
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    from ..integration.tree_replay import HookedTreeCore, kv_pool

    layers, heads, dim, dtype = GEOMETRIES[geometry]
    hooked = HookedTreeCore(host_tokens, min_score).__enter__()
    pool = kv_pool(pool_tokens, 1, layers, heads, dim, getattr(torch, dtype))
    alloc = TokenToKVPoolAllocator(pool_tokens, torch.float32, "cpu", pool, False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1,
                             tree_components=(ComponentType.FULL,))
    params.tree_core_backend = "python"
    cache = UnifiedRadixCache(params)
    cache._alloc = alloc
    ticks = iter(range(10**9))
    cache.tree_core._superinfer_prefix.clock = lambda: next(ticks) * 0.01
    return cache, hooked


def _req(rid: str) -> Any:
    return SimpleNamespace(rid=rid, session=None, extra_key=None,
                           sampling_params=SimpleNamespace(custom_params={"slo_class": "interactive"}))


def _match(cache: Any, ids: list[int], rid: str | None) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return cache.match_prefix(MatchPrefixParams(key=RadixKey(list(ids)), req=_req(rid) if rid else None))


def _insert(cache: Any, ids: list[int]) -> None:
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    m = _match(cache, ids, None)
    new = cache._alloc.alloc(len(ids) - m.device_prefix_len)
    path = cache.tree_core.collect_full_device_indices(m.last_device_node, cache.tree_core.root_node.id)
    cache.insert(InsertParams(key=RadixKey(list(ids)), value=torch.cat([path, new.to(torch.int64)]),
                              prev_prefix_len=m.device_prefix_len))


def _evict_all(cache: Any) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache.evict(EvictParams(num_tokens=cache.evictable_size()))


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def copy_cost(geometry: str, n: int, repeats: int) -> dict[str, Any]:
    """Per token: a demotion of an n-token leaf and its restore by a request's match."""
    cache, hooked = _tree(4 * n + 64, 2 * n + 64, geometry, 0.0)
    try:
        host = cache.tree_core._superinfer_prefix.host
        dem, res, dem_cpu, res_cpu = [], [], [], []
        for r in range(repeats):
            ids = [100_000 * (r + 1) + k for k in range(n)]
            _insert(cache, ids)
            _match(cache, ids, f"warm{r}")  # one hit, so the leaf's history is real
            d0, c0 = host.demote_s, time.process_time()
            _evict_all(cache)
            dem_cpu.append(time.process_time() - c0)
            dem.append(host.demote_s - d0)
            assert len(host.store) >= 1
            r0, c0 = host.restore_s, time.process_time()
            m = _match(cache, ids + [1], f"back{r}")
            res_cpu.append(time.process_time() - c0)
            res.append(host.restore_s - r0)
            assert m.device_prefix_len == n, (m.device_prefix_len, n)
            _evict_all(cache)
            host.store.clear()
        host.check()
        bpt = host.engine.host_pool.bytes_per_token
        return {"geometry": geometry, "tokens": n, "bytes_per_token": bpt,
                "demote_us_per_token": _med(dem) / n * 1e6, "restore_us_per_token": _med(res) / n * 1e6,
                "demote_ms": _med(dem) * 1e3, "restore_ms": _med(res) * 1e3,
                "demote_GBps": bpt * n / _med(dem) / 1e9, "restore_GBps": bpt * n / _med(res) / 1e9,
                "evict_round_cpu_ms": _med(dem_cpu) * 1e3, "restore_match_cpu_ms": _med(res_cpu) * 1e3}
    finally:
        hooked.__exit__(None, None, None)


def hook_cost(geometry: str, entries: int, repeats: int) -> dict[str, Any]:
    """Per call, when nothing moves: a request's match with `entries` unrelated entries on host, and
    an evicted leaf below the threshold; against the same calls without the host tier."""
    out: dict[str, Any] = {"geometry": geometry, "host_entries": entries}
    for arm, host_tokens in (("with_host", 64 * (entries + 8)), ("without_host", 0)):
        cache, hooked = _tree(64 * (entries + 8), host_tokens, geometry, 0.0)
        try:
            for e in range(entries):  # demoted prompts that no later request continues
                _insert(cache, [900_000 + 1000 * e + k for k in range(48)])
            _evict_all(cache)
            probe = list(range(5000, 5064))
            _insert(cache, probe)
            walls, cpus = [], []
            for r in range(repeats):
                c, w = time.process_time(), time.perf_counter()
                _match(cache, probe + [r], f"q{r}")
                cpus.append(time.process_time() - c)
                walls.append(time.perf_counter() - w)
            out[f"match_{arm}_us"] = _med(walls) * 1e6
            out[f"match_{arm}_cpu_us"] = _med(cpus) * 1e6
        finally:
            hooked.__exit__(None, None, None)
    out["match_hook_extra_us"] = out["match_with_host_us"] - out["match_without_host_us"]
    # a leaf under the threshold: the hook scores it and lets SGLang drop it
    cache, hooked = _tree(4096, 4096, geometry, 1.0)
    try:
        host = cache.tree_core._superinfer_prefix.host
        per = []
        for r in range(repeats):
            _insert(cache, [700_000 + 100 * r + k for k in range(16)])
            d0 = host.demote_s
            _evict_all(cache)
            per.append(host.demote_s - d0)
        assert host.store.demoted == 0
        out["rejected_leaf_us"] = _med(per) * 1e6
    finally:
        hooked.__exit__(None, None, None)
    return out


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", category=UserWarning)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/prefix_cache/host_cost.json")
    ap.add_argument("--geometry", default="smollm2-135m", choices=sorted(GEOMETRIES))
    ap.add_argument("--tokens", default="16,128,1024")
    ap.add_argument("--entries", default="10,100,1000")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    rows = [copy_cost(args.geometry, int(n), args.repeats) for n in args.tokens.split(",")]
    for r in rows:
        print(json.dumps(r), flush=True)
    # nothing is copied on these paths: a one-layer pool keeps 1000 entries within this machine's RAM
    hooks = [hook_cost("tiny", int(e), args.repeats * 4) for e in args.entries.split(",")]
    for h in hooks:
        print(json.dumps(h), flush=True)
    doc = {"config": vars(args), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "machine": f"{platform.machine()}, {platform.processor() or '?'}, torch threads 1", "copy": rows,
           "hooks": hooks}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
