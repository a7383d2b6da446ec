"""User trace files -> token-length records (with timestamps when the trace has them).

Supported:
- CSV with a timestamp column and token counts, e.g. the Azure LLM inference traces
  (TIMESTAMP, ContextTokens, GeneratedTokens; Azure Public Dataset, CC-BY 4.0, Patel et al.,
  "Splitwise", ISCA 2024);
- JSONL with timestamp + token counts, e.g. Mooncake traces ({"timestamp": ms, "input_length",
  "output_length", ...});
- ShareGPT JSON (a list of {"conversations": [{"from": "human"|"gpt", "value": ...}, ...]}):
  lengths only, counted with the model's tokenizer; no timestamps.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from ..rotasched.slo import Slo
from .workloads import BenchRequest

# Column / key names we recognise (case-insensitive), first match wins.
TIME_KEYS = ("timestamp", "time", "arrival_time", "arrival")
INPUT_KEYS = ("contexttokens", "input_length", "input_tokens", "prompt_tokens", "prompt_len")
OUTPUT_KEYS = ("generatedtokens", "output_length", "output_tokens", "completion_tokens", "output_len")


class TraceError(ValueError):
    """A trace file we cannot read; the message names the file and the problem."""


@dataclass(frozen=True)
class TraceRecord:
    timestamp_s: float | None
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class LengthFit:
    """How trace lengths are fitted to a small model/machine: scale, then clip to [lo, hi]."""

    scale: float = 1.0
    max_input: int = 1 << 30
    max_output: int = 1 << 30
    min_tokens: int = 1

    def fit(self, n: int, hi: int) -> int:
        return max(self.min_tokens, min(hi, round(n * self.scale)))


def load_trace(path: str | Path, tokenizer: object | None = None) -> list[TraceRecord]:
    p = Path(path)
    if not p.is_file():
        raise TraceError(f"trace {p} does not exist")
    head = p.read_text(errors="replace")[:4096].lstrip()
    if p.suffix.lower() == ".csv":
        return load_csv(p)
    if head.startswith("["):
        if tokenizer is None:
            raise TraceError(f"{p}: a ShareGPT JSON trace needs the model's tokenizer to count tokens")
        return load_sharegpt(p, tokenizer)
    return load_jsonl(p)


def _pick(row: dict, keys: Sequence[str], path: Path, what: str, required: bool = True) -> object:
    lower = {k.lower(): v for k, v in row.items()}
    for k in keys:
        if k in lower and lower[k] not in (None, ""):
            return lower[k]
    if required:
        raise TraceError(f"{path}: no {what} column/key (looked for {', '.join(keys)})")
    return None


def parse_timestamp(value: object) -> float:
    """Seconds: a number (ms if large, see _numeric_seconds) or 'YYYY-MM-DD HH:MM:SS.fffffff'."""
    if isinstance(value, (int, float)):
        return float(value)
    text = str(value).strip()
    try:
        return float(text)
    except ValueError:
        pass
    whole, _, frac = text.partition(".")
    try:
        base = datetime.fromisoformat(whole.replace("T", " "))
    except ValueError as exc:
        raise TraceError(f"unreadable timestamp {text!r}") from exc
    digits = "".join(c for c in frac if c.isdigit())  # Azure writes 7 fractional digits
    return base.timestamp() + (float("0." + digits) if digits else 0.0)


def load_csv(path: Path) -> list[TraceRecord]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return _records(rows, path, numeric_ms=False)


def load_jsonl(path: Path) -> list[TraceRecord]:
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise TraceError(f"{path}:{n}: bad JSON: {exc}") from None
    # Mooncake writes integer milliseconds; a JSONL trace with numbers is read as milliseconds.
    return _records(rows, path, numeric_ms=True)


def _records(rows: list[dict], path: Path, numeric_ms: bool) -> list[TraceRecord]:
    if not rows:
        raise TraceError(f"{path}: empty trace")
    out = []
    for row in rows:
        stamp = _pick(row, TIME_KEYS, path, "timestamp", required=False)
        ts = None
        if stamp is not None:
            ts = parse_timestamp(stamp)
            if numeric_ms and isinstance(stamp, (int, float)):
                ts /= 1000.0
        n_in = int(float(_pick(row, INPUT_KEYS, path, "input token count")))  # type: ignore[arg-type]
        n_out = int(float(_pick(row, OUTPUT_KEYS, path, "output token count")))  # type: ignore[arg-type]
        out.append(TraceRecord(ts, n_in, n_out))
    return out


def load_sharegpt(path: Path, tokenizer: object) -> list[TraceRecord]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TraceError(f"{path}: bad JSON: {exc}") from None
    encode: Callable[[str], list[int]] = tokenizer.encode  # type: ignore[attr-defined]
    out = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, answer = turns[0].get("value", ""), turns[1].get("value", "")
        out.append(TraceRecord(None, len(encode(prompt)), len(encode(answer))))
    if not out:
        raise TraceError(f"{path}: no conversation with a prompt and an answer")
    return out


def to_requests(records: Sequence[TraceRecord], slo: Slo, fit: LengthFit = LengthFit(),
                start: int = 0, limit: int | None = None) -> list[BenchRequest]:
    """A window of the trace as requests; timestamps (if any) become arrival_s."""
    window = records[start: None if limit is None else start + limit]
    if not window:
        raise TraceError(f"trace window start={start} limit={limit} is empty ({len(records)} records)")
    return [
        BenchRequest(i, fit.fit(r.input_tokens, fit.max_input), fit.fit(r.output_tokens, fit.max_output),
                     slo, arrival_s=r.timestamp_s)
        for i, r in enumerate(window)
    ]
