"""The recompute tax of one run: prefill tokens computed again over prefill tokens computed.

A request whose KV is dropped while it runs (SGLang's decode-OOM retraction, our rotation's
recompute fallback) is re-admitted and prefilled again; the tokens that extend computes a second
time, net of what the radix cache still held, are the tax (vLLM users measure theirs at 10-23%
under preemption). Stock SGLang runs without our plugin, so the harness reads the figure from
SGLang's own series (0.5.23, `--enable-metrics`), the same rule on every server:

  sglang:realtime_tokens_total{mode="prefill_compute"}       tokens extended (PrefillAdder's
                                                             log_input_tokens + replay tokens)
  sglang:prefill_effective_tokens_total{mode="input"}        the same less `reprocessed_log_input_tokens`:
                                                             extend tokens of requests SGLang marked
                                                             `retracted_stain` (KV released while running)

recomputed = the first minus the second (replay tokens are 0 outside encoder-SWA models). Our
server also exports `superinfer_prefill_tokens_total` and `superinfer_recomputed_tokens_total{cause}`
(integration/metrics.py, the same rule plus a cause), read here when present as a cross-check.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# (key, series, required labels)
LABELLED = (
    ("prefill_tokens", "sglang:realtime_tokens_total", {"mode": "prefill_compute"}),
    ("first_pass_tokens", "sglang:prefill_effective_tokens_total", {"mode": "input"}),
    ("decode_tokens", "sglang:realtime_tokens_total", {"mode": "decode"}),
    ("retracted_input_tokens", "sglang:num_retracted_input_tokens_total", {}),
    ("retracted_output_tokens", "sglang:num_retracted_output_tokens_total", {}),
    ("ours_prefill_tokens", "superinfer_prefill_tokens_total", {}),
    ("ours_recomputed_tokens", "superinfer_recomputed_tokens_total", {}),
)
PREFIX = "recompute:"  # keys added to a scrape (runner.scrape), apart from parse_prometheus's names
_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def labelled(text: str) -> dict[str, float]:
    """Exposition text -> {PREFIX + key: value summed over the label sets matching LABELLED}.
    A key is absent when its series is."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m or line.startswith("#"):
            continue
        name, labels, value = m.group(1), dict(_LABEL.findall(m.group(2) or "")), m.group(3)
        for key, series, want in LABELLED:
            if name == series and all(labels.get(k) == v for k, v in want.items()):
                try:
                    out[PREFIX + key] = out.get(PREFIX + key, 0.0) + float(value)
                except ValueError:
                    pass
    return out


def deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """Per-run token counts and the tax. None where a series is not exported (an SGLang without
    these counters, a server without --enable-metrics, superinfer_ series on stock); a series
    that exists only after the run (first increment) counts from 0."""
    out: dict[str, Any] = {}
    for key, _, _ in LABELLED:
        k = PREFIX + key
        out[key] = None if k not in after else after[k] - before.get(k, 0.0)
    pre, first = out["prefill_tokens"], out["first_pass_tokens"]
    out["recomputed_tokens"] = None if pre is None or first is None else max(0.0, pre - first)
    out["tax"] = tax(out["recomputed_tokens"], pre)
    return out


def tax(recomputed: float | None, computed: float | None) -> float | None:
    """Recomputed over computed prefill tokens; None when unknown or nothing was computed."""
    if recomputed is None or not computed:
        return None
    return recomputed / computed


def pooled_tax(points: list[Mapping[str, Any]]) -> dict[str, Any]:
    """Sum of recomputed over sum of computed prefill tokens across runs (runs without the
    counters are left out and counted in `runs_without`)."""
    rec = comp = 0.0
    used = without = 0
    for p in points:
        r = p.get("recompute") or {}
        if r.get("recomputed_tokens") is None or r.get("prefill_tokens") is None:
            without += 1
            continue
        rec += r["recomputed_tokens"]
        comp += r["prefill_tokens"]
        used += 1
    return {"recomputed_tokens": rec if used else None, "prefill_tokens": comp if used else None,
            "tax": tax(rec, comp) if used else None, "runs": used, "runs_without": without}


def tax_markdown(results: Mapping[str, list[Mapping[str, Any]]]) -> str:
    """Per system and rate (pooled over its runs): recomputed / computed prefill tokens."""
    rates = sorted({p["rate"] for pts in results.values() for p in pts})
    lines = ["Recompute tax (prefill tokens computed again / prefill tokens computed; SGLang's own "
             "counters, the same rule on every server):", "",
             "| system | " + " | ".join(f"{r:.3g} req/s" for r in rates) + " | all |",
             "|---|" + "---|" * (len(rates) + 1)]
    for system, pts in results.items():
        cells = [_cell(pooled_tax([p for p in pts if p["rate"] == r])) for r in rates]
        lines.append(f"| `{system}` | " + " | ".join(cells) + f" | {_cell(pooled_tax(list(pts)))} |")
    return "\n".join(lines) + "\n"


def _cell(t: Mapping[str, Any]) -> str:
    if not t["runs"]:
        return "-"
    if t["tax"] is None:
        return "0 / 0"
    return f"{100 * t['tax']:.2f}% ({t['recomputed_tokens']:.0f} / {t['prefill_tokens']:.0f})"
