"""The soak's greedy exactness sample, probed on its own (issue 38 item 5): the soak's four exact
prompts (soak_requests.EXACT_PROMPTS) served again and again beside filler requests on a server
made to rotate, recompute and retract as often as it can, every output compared with the prompt
served alone.

The soak sends a handful of exactness samples in a run (4-6 in the CI soak, 20-27 in the long
ones); one differed once (2026-11-24, docs/reliability.md "The exactness sample"). This probe sends
hundreds in minutes through the paths that could change a greedy output: forced rotations
(SUPERINFER_TEST_ROTATE_INTERVAL), a host pool too small for every rotation (the recompute
fallback), SGLang's forced decode retraction (SGLANG_TEST_RETRACT), eager sync on or off, radix
prefix hits (the prompts repeat), several copies of a prompt in one batch. It checks three things:

- the references: each prompt served alone with and without `return_logprob` (the soak takes its
  reference with logprobs, its samples without) gives the same tokens;
- every sample equals its reference, or differs only by a near-tie flip (soak_requests.near_tie:
  the reference's best two within TIE_LOGPROB_GAP at the first difference, the runner-up taken);
  each differing sample is listed with its rotations and recomputes;
- SUPERINFER_VERIFY_ROTATION's counters: no rotated KV byte changed.

    python scripts/soak_exact.py --rounds 15 --out /tmp/exact.json

`--rounds 0` serves only the references (each prompt alone, still under the forced rotations):
with the default 3 MB host pool the 89-token fox prompt takes the recompute fallback at every forced
rotation; before the fix of 2026-11-28 (a fallback's request now waits a step under the overlap
scheduler) its output repeated tokens, and `--server-arg=--disable-overlap-schedule` gives the
output to compare with (docs/reliability.md, "The exactness sample that differed"). Exit status 1
when any of the three checks fails.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serverutil import start_server  # noqa: E402
from soak_requests import EXACT_PROMPTS, EXACT_TOKENS, WORDS, near_tie  # noqa: E402


def _post(url: str, body: dict) -> dict:
    r = requests.post(url + "/generate", json=body, timeout=900)
    r.raise_for_status()
    return r.json()


def _greedy(text: str, n: int, **extra: Any) -> dict:
    return {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}, **extra}


def references(url: str) -> dict[str, dict[str, Any]]:
    """Each prompt alone: tokens with and without return_logprob, and the top two per position."""
    out = {}
    for p in EXACT_PROMPTS:
        with_lp = _post(url, _greedy(p, EXACT_TOKENS, return_logprob=True, top_logprobs_num=2))
        plain = _post(url, _greedy(p, EXACT_TOKENS))
        tops = with_lp["meta_info"].get("output_top_logprobs") or []
        meta = with_lp["meta_info"].get("superinfer") or {}
        top2 = [[(float(lp), int(tok)) for lp, tok, *_ in top] for top in tops]
        gaps = [t[0][0] - t[1][0] for t in top2 if len(t) >= 2]
        out[p] = {"tokens": list(with_lp["output_ids"]), "tokens_without_logprob": list(plain["output_ids"]),
                  "top2": top2, "min_gap": min(gaps) if gaps else None,
                  "min_gap_at": gaps.index(min(gaps)) if gaps else None,
                  "rotations": meta.get("superinfer_rotations"), "recomputes": meta.get("superinfer_recomputes")}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from superinfer_sgl.bench.servers import shared_flags
    from superinfer_sgl.model_prep import prepare_default_model

    model = args.model_path or str(prepare_default_model())
    flags = shared_flags(model, args.max_total_tokens, 256, "cpu", ("--dtype", "float32", "--log-level", "info"))
    flags += ["--rotary-pool-gb", str(args.rotary_pool_gb), "--eager-sync" if args.eager_sync else "--no-eager-sync",
              *args.server_arg]
    env = {"SUPERINFER_VERIFY_ROTATION": "1"}
    if args.rotate_interval:
        env["SUPERINFER_TEST_ROTATE_INTERVAL"] = str(args.rotate_interval)
    if args.retract_interval:
        env.update(SGLANG_TEST_RETRACT="1", SGLANG_TEST_RETRACT_INTERVAL=str(args.retract_interval))
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    server = start_server(flags, Path(args.log_dir) / "soak_exact.log", env=env)
    rng = random.Random(args.seed)
    report: dict[str, Any] = {"args": vars(args), "server_flags": flags, "server_env": env}
    samples: list[dict[str, Any]] = []
    try:
        refs = references(server.url)
        report["references"] = {p[:40]: {k: v for k, v in r.items() if k != "top2"} for p, r in refs.items()}
        t0 = time.time()
        with ThreadPoolExecutor(args.copies * len(EXACT_PROMPTS) + args.fillers) as pool:
            for _ in range(args.rounds):
                bodies = [(p, _greedy(p, EXACT_TOKENS)) for p in EXACT_PROMPTS for _ in range(args.copies)]
                bodies += [(None, _greedy(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 120))),
                                          rng.randint(4, 48))) for _ in range(args.fillers)]
                rng.shuffle(bodies)
                futures = []
                for p, body in bodies:
                    futures.append((p, pool.submit(_post, server.url, body)))
                    time.sleep(rng.uniform(0, 0.05))
                for p, fut in futures:
                    out = fut.result()
                    if p is None:
                        continue
                    got, ref = list(out["output_ids"]), refs[p]["tokens"]
                    meta = (out.get("meta_info") or {}).get("superinfer") or {}
                    one = {"prompt": p[:40], "equal": got == ref, "rotations": meta.get("superinfer_rotations"),
                           "recomputes": meta.get("superinfer_recomputes")}
                    if got != ref:
                        one.update(got=got, reference=ref, **near_tie(got, ref, refs[p]["top2"]))
                    samples.append(one)
        report["seconds"] = round(time.time() - t0, 1)
        report["metrics"] = {k: v for k, v in server.metrics().items()
                             if k.startswith(("superinfer_kv_verify_total", "superinfer_rotations_out_total",
                                              "superinfer_resumes_total", "superinfer_recompute_fallbacks_total",
                                              "superinfer_recomputed_tokens_total"))}
    finally:
        report["processes_left"] = server.stop()
    changed = sum(v for k, v in report["metrics"].items() if 'outcome="changed"' in k)
    differing = [s for s in samples if not s["equal"]]
    report["samples"] = len(samples)
    report["equal"] = len(samples) - len(differing)
    report["near_ties"] = sum(bool(s.get("near_tie")) for s in differing)
    report["rotated_samples"] = sum(bool(s["rotations"]) for s in samples)
    report["recomputed_samples"] = sum(bool(s["recomputes"]) for s in samples)
    report["differing"] = differing
    report["failed"] = [name for name, bad in (
        ("reference with return_logprob differs from the plain reference",
         any(r["tokens"] != r["tokens_without_logprob"] for r in refs.values())),
        ("a sample differs beyond a near-tie", any(not s.get("near_tie") for s in differing)),
        ("rotated KV changed", changed > 0)) if bad]
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--copies", type=int, default=2, help="copies of each exact prompt per round")
    ap.add_argument("--fillers", type=int, default=8, help="random requests per round")
    ap.add_argument("--max-total-tokens", type=int, default=1024, help="device KV pool: small, for retractions")
    ap.add_argument("--rotary-pool-gb", type=float, default=0.003, help="host pool: small, for recompute fallbacks")
    ap.add_argument("--rotate-interval", type=int, default=2, help="a forced rotation every N iterations (0: none)")
    ap.add_argument("--retract-interval", type=int, default=7, help="SGLang's forced retraction (0: off)")
    ap.add_argument("--eager-sync", action=argparse.BooleanOptionalAction, default=True,
                    help="eager sync (the CPU default was on until 2026-11-24 16:43, when the differing sample was seen)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="one more server flag, e.g. --server-arg=--disable-overlap-schedule (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-path")
    ap.add_argument("--log-dir", default="/tmp/soak_exact")
    ap.add_argument("--out", default="/tmp/soak_exact/report.json")
    args = ap.parse_args(argv)
    report = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    for prompt, ref in report["references"].items():
        print("REFERENCE", json.dumps({"prompt": prompt, **{k: ref[k] for k in ("rotations", "recomputes", "tokens")}}))
    print(json.dumps({k: report[k] for k in ("samples", "equal", "near_ties", "rotated_samples", "recomputed_samples",
                                             "metrics", "failed")}, indent=1))
    for s in report["differing"]:
        print("DIFFERS", json.dumps(s))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
