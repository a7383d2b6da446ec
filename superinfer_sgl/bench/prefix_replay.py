"""Prefix-hit share without a model: the A/B's workloads replayed on SGLang's own radix tree.

    python -m superinfer_sgl.bench.prefix_replay --out results/prefix_cache/replay.json

Each request, in arrival order, is matched against a UnifiedRadixCache (SGLang's Python tree core
on the CPU, a KV allocator of --kv-tokens and no model), its matched path locked, the tree evicted
until its uncached prompt and its output fit, and its prompt + output inserted, as SGLang's
scheduler does for a finished request. Outputs are seeded random tokens; a conversation's next
turn extends its previous prompt and that output. Arms: SGLang's lru, lfu, slru and tlru strategies
(the Python classes the Rust core mirrors) and ours, the predictive strategy installed by the same
hooks the server uses (integration/prefix_cache.py), on the workload's clock; and ours with the
host tier (`predictive+host`: --prefix-host-tokens = --host-tokens, demotion threshold
--demote-min-score; the tree's allocator then has a real, tiny MHATokenToKVPool on the CPU, 1 layer,
1 head of 4 floats, so every demotion and restore copies rows through DuplexKV). What it leaves
out: running requests holding memory beside the cache, and timing; the live A/B (prefix_ab.py)
has both.

    python -m superinfer_sgl.bench.prefix_replay --sweep --first-seed 0 --seeds 3   # threshold x budget
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from ..integration.tree_replay import HookedTreeCore, TreeReplay, kv_pool
from .prefix_stats import OURS
from .prefix_workloads import VOCAB, conversations, tenants, unique

# lru_big: stock LRU on a device pool of --kv-tokens + --host-tokens (what the host tier's extra
# memory would give if it were device memory: a reference, not an arm of the decision)
POLICIES = ("lru", "lfu", "slru", "tlru", "predictive", "predictive+host", "lru_big")


def _events(kind: str, seed: int, rate: float, duration: float) -> list[tuple[float, int, str, list[int], int]]:
    """(time, order, rid, prompt, output length) in time order; conversations unrolled with a
    fixed 1 s service time before each think time."""
    if kind == "conversations":
        out = []
        for c in conversations(seed, rate, duration):
            t = c.arrival_s
            out.append((t, len(out), f"c{c.idx}.0", list(c.first), c.output_tokens, c.idx, 0))
            for k, (user, think) in enumerate(zip(c.user_turns, c.think_s)):
                t += 1.0 + think
                out.append((t, len(out), f"c{c.idx}.{k + 1}", list(user), c.output_tokens, c.idx, k + 1))
        return sorted(out)
    reqs = tenants(seed, rate, duration) if kind == "tenants" else unique(seed, rate, duration)
    return [(r.arrival_s, r.idx, f"r{r.idx}", list(r.input_ids), r.output_tokens, -1, 0) for r in reqs]


def replay(policy: str, kind: str, seed: int, rate: float, duration: float, kv_tokens: int,
           tlru: dict[str, int], host_tokens: int = 0, min_score: float | None = None) -> dict[str, Any]:
    if policy == "predictive+host":
        with HookedTreeCore(host_tokens, min_score):
            return _replay(policy, kind, seed, rate, duration, kv_tokens, tlru, kv_pool(kv_tokens))
    if policy == "predictive":
        with HookedTreeCore():
            return _replay(policy, kind, seed, rate, duration, kv_tokens, tlru)
    if policy == "lru_big":
        return _replay(policy, kind, seed, rate, duration, kv_tokens + host_tokens, tlru)
    return _replay(policy, kind, seed, rate, duration, kv_tokens, tlru)


def _replay(policy: str, kind: str, seed: int, rate: float, duration: float, kv_tokens: int,
            tlru: dict[str, int], kvcache: Any = None) -> dict[str, Any]:
    rng = np.random.default_rng([seed, 9])
    rep = TreeReplay("predictive" if policy in OURS else "lru" if policy == "lru_big" else policy, kv_tokens, tlru,
                     kvcache)
    history: dict[int, list[int]] = {}
    start = time.process_time()
    for t, _, rid, ids, n_out, conv, turn in _events(kind, seed, rate, duration):
        if conv >= 0:
            ids = history.get(conv, []) + ids  # the previous prompt and answer, then the new message
        out = [int(x) for x in rng.integers(VOCAB[0], VOCAB[1], size=n_out)]
        rep.serve(rid, ids, out, t)
        if conv >= 0:
            history[conv] = ids + out
    cpu = time.process_time() - start
    row = {"policy": policy, "workload": kind, "prompt_tokens": rep.prompt, "cached_tokens": rep.cached,
           "hit_share": rep.cached / max(1, rep.prompt), "cpu_s": cpu}
    state = getattr(rep.cache.tree_core, "_superinfer_prefix", None)
    if state is not None and state.host is not None:
        state.host.check()  # no leaked host block, the store's budget held
        row["host"] = state.host.counters()
        row["restored_share"] = row["host"]["restored_tokens"] / max(1, rep.prompt)
    return row


def table(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per workload and policy: mean hit share over seeds; each of ours minus each other policy,
    paired by seed, with a 95% t interval (scipy): row["minus"][ours] = [mean, lo, hi]."""
    from scipy import stats

    out = []
    policies = [p for p in POLICIES if any(r["policy"] == p for r in rows)]
    for kind in sorted({r["workload"] for r in rows}):
        by = {p: {r["seed"]: r["hit_share"] for r in rows if r["workload"] == kind and r["policy"] == p}
              for p in policies}
        for p in policies:
            row: dict[str, Any] = {"workload": kind, "policy": p, "seeds": len(by[p]),
                                   "hit_share": float(np.mean(list(by[p].values()))), "minus": {}}
            restored = [r["restored_share"] for r in rows if r["workload"] == kind and r["policy"] == p
                        and "restored_share" in r]
            if restored:
                row["restored_share"] = float(np.mean(restored))
            for ours in OURS:
                if ours == p or ours not in by:
                    continue
                seeds = sorted(by[p].keys() & by[ours].keys())
                d = np.array([by[ours][s] - by[p][s] for s in seeds])
                lo = hi = float(d.mean())
                if len(d) > 1 and d.std() > 0:
                    lo, hi = (float(x) for x in stats.t.interval(0.95, len(d) - 1, loc=d.mean(), scale=stats.sem(d)))
                row["minus"][ours] = [float(d.mean()), lo, hi]
            out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="results/prefix_cache/replay.json")
    ap.add_argument("--kv-tokens", type=int, default=800)
    ap.add_argument("--duration", type=float, default=600.0)
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--first-seed", type=int, default=3, help="seeds 0-2 were used while building the predictor")
    ap.add_argument("--rates", default="tenants=1.0,conversations=0.3,unique=0.5")
    ap.add_argument("--tlru-threshold", type=int, default=64)
    ap.add_argument("--tlru-next", type=int, default=11)
    ap.add_argument("--host-tokens", type=int, default=800,
                    help="the predictive+host arm's host budget in tokens (default: the device pool's size)")
    ap.add_argument("--demote-min-score", type=float, default=None,
                    help="the demotion threshold (default: prefix_host_store.DEMOTE_MIN_SCORE)")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--sweep", action="store_true",
                    help="only predictive and predictive+host over thresholds x host budgets (--sweep-*)")
    ap.add_argument("--sweep-scores", default="0.0,0.1,0.2,0.3,0.4,0.5,0.6")
    ap.add_argument("--sweep-host", default="200,400,800,1600")
    ap.add_argument("--summarize", help="add the table to an existing result file")
    args = ap.parse_args(argv)
    if args.sweep:
        return sweep(args)
    if args.summarize:
        doc = json.loads(Path(args.summarize).read_text())
        doc["table"] = table(doc["rows"])
        Path(args.summarize).write_text(json.dumps(doc, indent=1))
        for row in doc["table"]:
            print(json.dumps(row))
        return 0
    rates = {k: float(v) for k, v in (kv.split("=") for kv in args.rates.split(","))}
    tlru = {"threshold": args.tlru_threshold, "next_prompt_estimate": args.tlru_next}
    rows = []
    for kind, rate in rates.items():
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            for policy in args.policies.split(","):
                rows.append({"seed": seed, "rate": rate, **replay(policy, kind, seed, rate, args.duration,
                                                                   args.kv_tokens, tlru, args.host_tokens,
                                                                   args.demote_min_score)})
                print(json.dumps(rows[-1]), flush=True)
    doc = {"config": vars(args), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows,
           "table": table(rows)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


def sweep(args: argparse.Namespace) -> int:
    """Hit share of predictive+host per (threshold, host budget) minus predictive alone, mean over
    seeds and workloads (the reuse workloads; the control has no reuse to gain)."""
    rates = {k: float(v) for k, v in (kv.split("=") for kv in args.rates.split(","))}
    rates.pop("unique", None)
    tlru = {"threshold": args.tlru_threshold, "next_prompt_estimate": args.tlru_next}
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    base = {(k, s): replay("predictive", k, s, r, args.duration, args.kv_tokens, tlru)["hit_share"]
            for k, r in rates.items() for s in seeds}
    rows = []
    for host in (int(x) for x in args.sweep_host.split(",")):
        for score in (float(x) for x in args.sweep_scores.split(",")):
            for kind, rate in rates.items():
                gains, restored = [], []
                for s in seeds:
                    r = replay("predictive+host", kind, s, rate, args.duration, args.kv_tokens, tlru, host, score)
                    gains.append(r["hit_share"] - base[(kind, s)])
                    restored.append(r["restored_share"])
                rows.append({"host_tokens": host, "min_score": score, "workload": kind,
                             "gain_points": 100 * float(np.mean(gains)), "restored_share": float(np.mean(restored))})
                print(json.dumps(rows[-1]), flush=True)
    doc = {"config": vars(args), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
