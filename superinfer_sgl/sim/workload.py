"""Workloads for the simulator: request specs from a seeded generator or from trace files.

Every loader returns a `Workload`: requests sorted by arrival (seconds from the trace start) with
prompt and output token counts and per-request SLOs. Output lengths are replayed exactly
(ignore_eos with the trace's output length, as the paper's benchmarks do).

Sources:
  sharegpt-like   seeded generator, lognormal lengths shaped like the ShareGPT benchmark filter
                  (see SHAREGPT_LIKE: an assumption, not fitted to the real file)
  azure:conv|code the Azure LLM inference traces (Azure Public Dataset, AzureLLMInferenceDataset2023,
                  CC-BY 4.0; Patel et al., "Splitwise", ISCA 2024): ContextTokens / GeneratedTokens
  a ShareGPT JSON file ([{"conversations": [{"from": "human", ...}, {"from": "gpt", ...}]}]):
                  first human turn -> prompt, first reply -> output; tokens ~ characters / 4
  a CSV or JSONL file with an arrival time column and token counts (see _COLUMNS)
"""

from __future__ import annotations

import bisect
import csv
import datetime as dt
import json
import math
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

AZURE_DIR = Path("/work/shared/data")
AZURE_ATTRIBUTION = (
    "Azure LLM inference trace 2023 (Azure Public Dataset, CC-BY 4.0; Patel et al., "
    "'Splitwise: Efficient generative LLM inference using phase splitting', ISCA 2024)"
)
CHARS_PER_TOKEN = 4.0  # ShareGPT JSON without a tokenizer: the usual English rule of thumb


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """One request of a workload. Times in seconds from the workload start."""

    rid: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    ttft_slo: float = 5.0
    tbt_slo: float = 0.1
    priority: int = 0
    # Leading prompt tokens shared with an earlier request of the workload (a chat template's
    # system prefix): a radix-cache hit, neither recomputed nor allocated again.
    cached_tokens: int = 0
    weight: float = 1.0  # its SLO class's weight in the goodput policy (--slo-classes)
    # What the client asked for (the bound the server sees; 0: exactly `output_tokens`). A request
    # that may stop at EOS decodes `output_tokens` <= this; a fixed-length one decodes this many.
    max_new_tokens: int = 0

    def __post_init__(self) -> None:
        assert self.rid, "rid must be non-empty"
        if self.max_new_tokens == 0:
            object.__setattr__(self, "max_new_tokens", self.output_tokens)
        assert self.max_new_tokens >= self.output_tokens, (self.rid, self.max_new_tokens, self.output_tokens)
        assert math.isfinite(self.arrival) and self.arrival >= 0, (self.rid, self.arrival)
        assert self.prompt_tokens >= 1 and self.output_tokens >= 1, self.rid
        assert self.ttft_slo > 0 and self.tbt_slo > 0, self.rid
        assert 0 <= self.cached_tokens < self.prompt_tokens, (self.rid, self.cached_tokens)
        assert self.weight > 0 and math.isfinite(self.weight), (self.rid, self.weight)


@dataclass(frozen=True)
class Workload:
    requests: tuple[RequestSpec, ...]
    source: str  # what it is and, for third-party data, its attribution

    def __post_init__(self) -> None:
        arrivals = [r.arrival for r in self.requests]
        assert arrivals == sorted(arrivals), "requests must be sorted by arrival"
        assert len({r.rid for r in self.requests}) == len(self.requests), "duplicate rid"

    @property
    def duration(self) -> float:
        return self.requests[-1].arrival if self.requests else 0.0

    def with_slo(self, ttft_slo: float, tbt_slo: float) -> Workload:
        reqs = tuple(replace(r, ttft_slo=ttft_slo, tbt_slo=tbt_slo) for r in self.requests)
        return Workload(reqs, self.source)

    def with_max_new_tokens(self, max_new_tokens: int) -> Workload:
        """Every request asks for up to `max_new_tokens` (or its own length, where longer: the
        trace's work is kept) and stops at EOS after its trace length: the server knows only the
        bound, as with a client that sets one max_tokens for every request."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        reqs = tuple(replace(r, max_new_tokens=max(max_new_tokens, r.output_tokens)) for r in self.requests)
        return Workload(reqs, self.source + f"; max_new_tokens {max_new_tokens}")


@dataclass(frozen=True)
class LengthModel:
    """Lognormal token lengths, resampled until they pass the benchmark's length filter."""

    in_median: float
    in_sigma: float
    out_median: float
    out_sigma: float
    min_tokens: int = 4
    max_prompt: int = 1024
    max_total: int = 2048

    def sample(self, rng: random.Random) -> tuple[int, int]:
        while True:
            p = round(rng.lognormvariate(math.log(self.in_median), self.in_sigma))
            o = round(rng.lognormvariate(math.log(self.out_median), self.out_sigma))
            if self.min_tokens <= p <= self.max_prompt and o >= self.min_tokens and p + o <= self.max_total:
                return p, o


# ShareGPT-like lengths. Assumption: the filter of vLLM's/SGLang's ShareGPT benchmark sampler
# (prompt 4..1024, output >= 4, total <= 2048) applied to lognormals whose filtered means come out at
# about 250 prompt and 200 output tokens, in the range commonly reported for that benchmark
# (about 200-300 prompt, about 200 output tokens). Not fitted to the real file (not available here).
SHAREGPT_LIKE = LengthModel(in_median=190.0, in_sigma=1.1, out_median=125.0, out_sigma=1.05)


def poisson_arrivals(rate: float, duration: float, rng: random.Random) -> list[float]:
    """Poisson process of `rate` per second over [0, duration)."""
    assert rate > 0 and duration > 0, (rate, duration)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def sharegpt_like(rate: float, duration: float, seed: int = 0,
                  lengths: LengthModel = SHAREGPT_LIKE) -> Workload:
    """Poisson arrivals at `rate` req/s for `duration` s with ShareGPT-like lengths."""
    rng = random.Random(seed)
    arrivals = poisson_arrivals(rate, duration, rng)
    reqs = []
    for i, t in enumerate(arrivals):
        p, o = lengths.sample(rng)
        reqs.append(RequestSpec(f"s{i}", t, p, o))
    src = f"sharegpt-like generator (seed {seed}, Poisson {rate:g} req/s, {duration:g} s)"
    return Workload(tuple(reqs), src)


def _timestamp(value: str) -> float:
    value = value.strip()
    try:
        return float(value)
    except ValueError:
        pass
    # Azure: "2023-11-16 18:17:03.9799600" (7 fractional digits; fromisoformat takes 6).
    head, _, frac = value.partition(".")
    stamp = dt.datetime.fromisoformat(head)
    return stamp.timestamp() + (float("0." + frac) if frac else 0.0)


_COLUMNS = {
    "arrival": ("arrival", "arrival_s", "timestamp", "time", "TIMESTAMP", "arrival_time"),
    "prompt": ("prompt_tokens", "input_tokens", "prompt_len", "input_len", "ContextTokens"),
    "output": ("output_tokens", "max_new_tokens", "output_len", "GeneratedTokens"),
    "ttft": ("ttft_slo_ms",),
    "tbt": ("tbt_slo_ms",),
    "priority": ("priority",),
    "rid": ("rid", "id"),
}


def _pick(row: dict, key: str) -> object | None:
    for name in _COLUMNS[key]:
        if name in row and row[name] not in (None, ""):
            return row[name]
    custom = row.get("custom_params")
    if isinstance(custom, dict) and key in ("ttft", "tbt"):
        return custom.get(_COLUMNS[key][0])
    return None


def from_rows(rows: Iterable[dict], source: str, time_scale: float = 1.0) -> Workload:
    """Requests from dict rows (CSV or JSONL): arrival times are shifted to start at 0."""
    parsed = []
    for i, row in enumerate(rows):
        arrival, prompt, output = _pick(row, "arrival"), _pick(row, "prompt"), _pick(row, "output")
        if arrival is None or prompt is None or output is None:
            raise ValueError(f"row {i}: needs an arrival time, prompt tokens and output tokens: {row}")
        ttft, tbt, prio = _pick(row, "ttft"), _pick(row, "tbt"), _pick(row, "priority")
        rid = _pick(row, "rid")
        parsed.append((_timestamp(str(arrival)), int(float(prompt)), int(float(output)),
                       5.0 if ttft is None else float(ttft) / 1000.0,
                       0.1 if tbt is None else float(tbt) / 1000.0,
                       0 if prio is None else int(prio), str(rid) if rid is not None else f"t{i}"))
    parsed.sort(key=lambda x: x[0])
    t0 = parsed[0][0] if parsed else 0.0
    reqs = tuple(RequestSpec(rid, (t - t0) * time_scale, max(1, p), max(1, o), ttft, tbt, prio)
                 for t, p, o, ttft, tbt, prio, rid in parsed)
    return Workload(reqs, source)


def served_rows(cfg: dict, rows: list[dict], points: Sequence[dict]) -> list[dict]:
    """The harness's request rows as served at `points` (points of one repeat: same requests).
    Fixed-length requests: as recorded. Requests that could stop at EOS (ab_bench --no-ignore-eos):
    a row's `output_tokens` was only the bound the server saw, now its `max_new_tokens`; its length
    is what the model decoded, the median over the points that completed it (greedy: nearly always
    one value); a request no point completed keeps its bound."""
    if cfg.get("ignore_eos", True):
        return rows
    seen: list[list[int]] = [[] for _ in rows]
    for p in points:
        got = p["requests"]
        if len(got["output_len"]) != len(rows):
            raise ValueError(f"a point at {p.get('rate')} req/s holds {len(got['output_len'])} requests, "
                             f"the repeat {len(rows)}")
        for i, (ok, n) in enumerate(zip(got["success"], got["output_len"])):
            if ok and n:
                seen[i].append(int(n))
    return [{**r, "output_tokens": min(int(r["output_tokens"]), round(statistics.median(lens))) if lens
             else int(r["output_tokens"]), "max_new_tokens": int(r["output_tokens"])} for r, lens in zip(rows, seen)]


def recorded_workload(reqs: Sequence[dict], arrivals: Sequence[float], source: str,
                      prompt_ids: Sequence[Sequence[int]] | None = None) -> Workload:
    """The A/B harness's request rows (prompt_tokens, output_tokens, ttft_slo_ms, tbt_slo_ms,
    priority, weight[, max_new_tokens: the bound of a request that could stop at EOS]) at their arrival offsets, request i as `ab{i}`. With the prompts' token ids,
    each request's cached_tokens is its longest common prefix with any earlier arrival (what
    SGLang's radix cache finds at admission if nothing was evicted)."""
    assert len(arrivals) == len(reqs), (len(arrivals), len(reqs))
    order = sorted(range(len(reqs)), key=lambda i: float(arrivals[i]))
    cached = earlier_prefixes([prompt_ids[i] for i in order]) if prompt_ids else [0] * len(order)
    specs = []
    for i, hit in zip(order, cached):
        r = reqs[i]
        prompt = int(r["prompt_tokens"])
        specs.append(RequestSpec(f"ab{i}", float(arrivals[i]), prompt, int(r["output_tokens"]),
                                 float(r["ttft_slo_ms"]) / 1000.0, float(r["tbt_slo_ms"]) / 1000.0,
                                 int(r.get("priority") or 0), cached_tokens=min(hit, prompt - 1),
                                 weight=float(r.get("weight") or 1.0), max_new_tokens=int(r.get("max_new_tokens") or 0)))
    return Workload(tuple(specs), source)


def earlier_prefixes(seqs: Sequence[Sequence[int]]) -> list[int]:
    """For each sequence, its longest common prefix with any earlier one. The longest match in a
    set is with a lexicographic neighbour, so a sorted list of the earlier ones suffices."""
    seen: list[tuple[int, ...]] = []
    out = []
    for seq in seqs:
        key = tuple(seq)
        i = bisect.bisect_left(seen, key)
        out.append(max([_lcp(key, seen[j]) for j in (i - 1, i) if 0 <= j < len(seen)], default=0))
        seen.insert(i, key)
    return out


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return n


def load_table(path: Path) -> Workload:
    text = path.read_text()
    if path.suffix in (".jsonl", ".ndjson"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        rows = list(csv.DictReader(text.splitlines()))
    return from_rows(rows, f"trace file {path.name}")


def load_sharegpt_json(path: Path, rate: float, duration: float, seed: int = 0) -> Workload:
    """ShareGPT conversations with Poisson arrivals; lengths from the first human/reply pair."""
    data = json.loads(path.read_text())
    pairs = []
    for conv in data:
        turns = conv.get("conversations") or conv.get("items") or []
        if len(turns) < 2:
            continue
        p = max(1, round(len(turns[0].get("value", "")) / CHARS_PER_TOKEN))
        o = max(1, round(len(turns[1].get("value", "")) / CHARS_PER_TOKEN))
        if 4 <= p <= 1024 and o >= 4 and p + o <= 2048:
            pairs.append((p, o))
    if not pairs:
        raise ValueError(f"{path}: no usable conversations")
    rng = random.Random(seed)
    arrivals = poisson_arrivals(rate, duration, rng)
    reqs = tuple(RequestSpec(f"g{i}", t, *rng.choice(pairs)) for i, t in enumerate(arrivals))
    return Workload(reqs, f"ShareGPT file {path.name} (tokens ~ chars/{CHARS_PER_TOKEN:g}), "
                          f"Poisson {rate:g} req/s, {duration:g} s, seed {seed}")


def load_azure(kind: str, duration: float | None = None, rate: float | None = None,
               start: float = 0.0, data_dir: Path = AZURE_DIR) -> Workload:
    """An Azure trace window [start, start+duration) of the real timestamps.

    With `rate`, arrival times are compressed or stretched so the window averages `rate` req/s
    (the trace's lengths and burstiness are kept).
    """
    path = data_dir / f"AzureLLMInferenceTrace_{kind}.csv"
    base = load_table(path)
    reqs = [r for r in base.requests if r.arrival >= start and (duration is None or r.arrival < start + duration)]
    if not reqs:
        raise ValueError(f"{path}: no requests in the window")
    t0 = reqs[0].arrival
    span = max(reqs[-1].arrival - t0, 1e-9)
    scale = 1.0 if rate is None else (len(reqs) / rate) / span
    out = tuple(replace(r, arrival=(r.arrival - t0) * scale) for r in reqs)
    how = "real timestamps" if rate is None else f"timestamps scaled to {rate:g} req/s"
    window = f", from {start:g} s into the trace" if start else ""
    return Workload(out, f"{AZURE_ATTRIBUTION}, {kind}{window}, {how}")


def stats(requests: Sequence[RequestSpec]) -> dict[str, float]:
    n = len(requests)
    if n == 0:
        return {"requests": 0}
    span = max(requests[-1].arrival - requests[0].arrival, 1e-9)
    return {
        "requests": n,
        "rate": (n - 1) / span if n > 1 else 0.0,
        "mean_prompt": sum(r.prompt_tokens for r in requests) / n,
        "mean_output": sum(r.output_tokens for r in requests) / n,
        "max_total": max(r.prompt_tokens + r.output_tokens for r in requests),
    }
