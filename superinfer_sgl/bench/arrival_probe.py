"""TTFT parity by arrival state: one probe request at a time, on stock SGLang and on ours, either
into an idle server or while another request is decoding.

    python -m superinfer_sgl.bench.arrival_probe [--prompts 40] [--our-args=--no-mixed-resume]
        [--out results/arrival_probe/cpu.json]

The paired A/B's below-capacity median TTFT pools both states; this splits them, so a difference
can be put on the step that causes it. `idle`: the probe arrives at an idle server (a plain
prefill on both). `busy`: a background request with a fixed output length is decoding when the
probe arrives, at a phase that varies with the prompt, so the probe's prefill either stalls the
decode batch (stock SGLang) or rides with it as a mixed step (ours, `--mixed-resume`). Each prompt
is sent to both servers in turn (the one going first alternates); the servers run on separate
cores, swapped halfway (`--swap`), so a core's speed is not charged to one system. Reported per
state (`summarize`): both medians, and ours against stock probe by probe. Every probe has its own
prompt (nothing comes from the radix cache); the cpu profile's model, KV pool, prefill chunk and
prompt lengths.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import requests
from scipy import stats

from .profiles import CPU_OUR_FLAGS, PROFILES
from .prompts import PromptBuilder
from .servers import OUR_MODULE, STOCK_MODULE, SystemSpec, launch, shared_flags
from .workloads import sharegpt_like

KINDS = ("idle", "busy")
SYSTEMS = ("sglang", "superinfer")
PROBE_TOKENS = 2  # only the first token is timed
BACKGROUND = (64, 40)  # the decoding request's prompt and output tokens (about 1.5 s of decode on the CPU)
LEAD_S = 0.3  # the background request's prefill is over by then (64 tokens: ~0.1 s) ...
PHASE_S = 0.04  # ... plus a phase spread over about one CPU decode step
SETTLE_S = 0.5  # pause before each probe: the previous one's server is idle again
DEFAULT_OUT = Path("results/arrival_probe/cpu.json")


def first_token_s(url: str, messages: list[dict[str, str]], max_tokens: int = PROBE_TOKENS) -> float:
    """Seconds from sending a streamed chat completion to its first content chunk (SGLang sends
    its role chunk, content "", with the first token's output: the same moment)."""
    t0 = time.perf_counter()
    with requests.post(f"{url}/v1/chat/completions", stream=True, timeout=120,
                       json={"model": "default", "messages": messages, "max_tokens": max_tokens,
                             "temperature": 0, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {") and b'"content":"' in line:
                return time.perf_counter() - t0
    raise RuntimeError(f"{url}: the stream ended without a content chunk")


def busy_first_token_s(url: str, messages: list[dict[str, str]], background: list[dict[str, str]],
                       phase_s: float) -> float:
    """first_token_s while `background` (BACKGROUND[1] output tokens) is decoding."""
    body = {"model": "default", "messages": background, "max_tokens": BACKGROUND[1], "ignore_eos": True,
            "temperature": 0}
    errors: list[BaseException] = []

    def send() -> None:
        try:
            requests.post(f"{url}/v1/chat/completions", json=body, timeout=120).raise_for_status()
        except BaseException as exc:  # noqa: BLE001 (re-raised in the caller's thread)
            errors.append(exc)

    bg = threading.Thread(target=send, daemon=True)
    bg.start()
    time.sleep(LEAD_S + phase_s)
    try:
        return first_token_s(url, messages)
    finally:
        bg.join()
        if errors:
            raise errors[0]


def summarize(records: Sequence[Mapping[str, Any]], seed: int = 0) -> dict[str, Any]:
    """Per arrival state, over the probes both systems served (a prompt under one core assignment):
    each system's median TTFT (ms), ours minus stock per probe (mean, with its t interval) and ours
    / stock per probe (median, with a bootstrap interval). Per probe, because the prompts' lengths
    differ: a ratio of the two medians would compare different prompts."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        ms = {(r["system"], r["swap"], r["prompt"]): r["ttft_s"] * 1e3 for r in records if r["kind"] == kind}
        probes = sorted({(w, p) for (_, w, p) in ms if all((s, w, p) in ms for s in SYSTEMS)})
        if len(probes) < 2:
            continue
        stock, ours = (np.array([ms[(s, w, p)] for w, p in probes]) for s in SYSTEMS)
        diff, ratio = ours - stock, ours / stock
        t_ci = stats.ttest_1samp(diff, 0.0).confidence_interval(0.95)
        boot = stats.bootstrap((ratio,), np.median, confidence_level=0.95, n_resamples=2000,
                               method="percentile", rng=np.random.default_rng(seed)).confidence_interval
        out[kind] = {"n": len(probes), "sglang_median_ms": round(float(np.median(stock)), 1),
                     "superinfer_median_ms": round(float(np.median(ours)), 1),
                     "diff_ms": {"mean": round(float(diff.mean()), 2), "ci": [round(float(t_ci.low), 2),
                                                                              round(float(t_ci.high), 2)]},
                     "ratio": {"median": round(float(np.median(ratio)), 4),
                               "ci": [round(float(boot.low), 4), round(float(boot.high), 4)]}}
    return out


def _messages(builder: PromptBuilder, idx: int, tokens: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": builder.build(idx, tokens)[0]}]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from ..model_prep import prepare_default_model

    profile = PROFILES["cpu"]
    model = args.model_path or str(prepare_default_model())
    builder = PromptBuilder(AutoTokenizer.from_pretrained(model))
    reqs = sharegpt_like(args.prompts, args.seed, profile.slo, profile.inputs, profile.outputs)
    # every probe its own prompt (its own tag up front): nothing comes from the radix cache
    prompts = {kind: [_messages(builder, base + r.idx, r.prompt_tokens) for r in reqs]
               for kind, base in zip(KINDS, (300_000, 310_000))}
    background = [_messages(builder, 320_000 + k, BACKGROUND[0]) for k in range(len(reqs))]
    shared = shared_flags(model, profile.kv_tokens, profile.chunked_prefill, "cpu", profile.server_flags)
    specs = {"sglang": SystemSpec("sglang", STOCK_MODULE),
             "superinfer": SystemSpec("superinfer", OUR_MODULE, (*CPU_OUR_FLAGS, *args.our_args))}
    logs = args.out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    two_cores = (os.cpu_count() or 1) >= 2
    records: list[dict[str, Any]] = []
    for swap in range(2 if args.swap else 1):
        servers: dict[str, Any] = {}
        try:
            for k, name in enumerate(SYSTEMS):
                cores = frozenset({(k + swap) % 2}) if two_cores else None
                servers[name] = launch(specs[name], shared, logs / f"{name}_{swap}.server.log",
                                       profile.ready_timeout_s, dict(profile.env), cores)
            for i in range(len(reqs)):
                phase = PHASE_S * ((7 * i) % 10) / 10
                for kind in KINDS:
                    msgs = prompts[kind][i]
                    for name in (SYSTEMS if (i + swap) % 2 else SYSTEMS[::-1]):
                        time.sleep(SETTLE_S)
                        url = servers[name].url
                        ttft = (first_token_s(url, msgs) if kind == "idle"
                                else busy_first_token_s(url, msgs, background[i], phase))
                        records.append({"system": name, "swap": swap, "kind": kind, "prompt": i,
                                        "prompt_tokens": reqs[i].prompt_tokens, "ttft_s": round(ttft, 6)})
                print(f"swap {swap}: prompt {i + 1}/{len(reqs)}", flush=True)
        finally:
            for s in servers.values():
                s.stop()
    return {"config": {"argv": ["python", "-m", "superinfer_sgl.bench.arrival_probe", *args.argv],
                       "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                       "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                   "git_commit": _commit()},
                       "model": model, "shared_server_flags": shared, "our_flags": list(specs["superinfer"].flags),
                       "background": {"prompt_tokens": BACKGROUND[0], "output_tokens": BACKGROUND[1],
                                      "lead_s": LEAD_S, "phase_s": PHASE_S}},
            "summary": summarize(records), "records": records}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def table(summary: Mapping[str, Any]) -> str:
    lines = ["| arrival | probes | stock median TTFT ms | ours | ours - stock, mean ms (95% CI) | ours / stock, median (95% CI) |",
             "|---|---|---|---|---|---|"]
    for kind, s in summary.items():
        d, r = s["diff_ms"], s["ratio"]
        lines.append(f"| {kind} | {s['n']} | {s['sglang_median_ms']} | {s['superinfer_median_ms']} | "
                     f"{d['mean']:+.1f} ({d['ci'][0]:+.1f}..{d['ci'][1]:+.1f}) | "
                     f"{r['median']:.3f} ({r['ci'][0]:.3f}..{r['ci'][1]:.3f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=40, help="probe prompts (cpu profile lengths)")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--model-path", default=None, help="default: the embedded default model")
    ap.add_argument("--our-args", type=lambda s: s.split(), default=[],
                    help="extra flags for our server (attach a value that starts with '--': --our-args=--no-mixed-resume)")
    ap.add_argument("--swap", action=argparse.BooleanOptionalAction, default=True,
                    help="a second run with the two servers' cores swapped")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    args.argv = argv
    doc = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(table(doc["summary"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
