"""Scale SLOs, rates and request count to the machine's measured speed (cpu profile).

A shared CPU machine's decode step time moves by an order of magnitude with what else runs on it,
so fixed CPU SLOs would be either trivially met or never met. Before the sweep we
probe the first (stock) server, then derive everything time-like from the measurement:

  B          = KV budget / (mean prompt + mean output tokens): the batch at which memory binds
  step(B)    = decode step time at batch B (linear through the probed batch sizes)
  prefill    = mean prompt x prefill time per token (from the TTFT of a lone request)
  TBT SLO    = max(tbt_per_step x step(B), step(B) + prefill): a gap may hold one mean prefill
  TTFT SLO   = ttft_per_service x (prefill + mean output x step(B)): about one request's lifetime
               in a full batch, as the paper's 5 s is for ShareGPT on its GPUs
  (SLO classes keep their ratios to the default: TTFT and TBT each scale by their own factor)
  capacity c = 1 / (prefill + mean output x step(B) / B)   [req/s]
  rates      = c x rate_multipliers
  N          = requests per point so that the sweep fits the time budget (at least min_requests)

Both systems then run with the same derived values; the JSON records the probe and every number.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import requests


@dataclass(frozen=True)
class Speed:
    """Probe results: prefill cost per prompt token and median decode gap per batch size."""

    prefill_ms_per_token: float
    steps_ms: tuple[tuple[int, float], ...]  # (batch, median inter-token gap in ms)

    def step_at(self, batch: float) -> float:
        pts = sorted(self.steps_ms)
        if len(pts) == 1:
            return pts[0][1]
        (b0, s0), (b1, s1) = pts[0], pts[-1]
        slope = max(0.0, (s1 - s0) / (b1 - b0))
        return s0 + slope * (batch - b0)


@dataclass(frozen=True)
class CalibrationKnobs:
    tbt_per_step: float = 2.0
    ttft_per_service: float = 1.0
    # up to 2x the estimate: the targets are read where stock's TTFT attainment falls to 50% or below
    rate_multipliers: tuple[float, ...] = (0.6, 1.0, 1.4, 2.0)
    budget_s: float = 1200.0
    min_requests: int = 16
    # the speed probe: batch sizes, tokens generated per request, runs per batch size (fastest kept)
    probe_batches: tuple[int, ...] = (1, 4, 8)
    probe_out_tokens: int = 24
    probe_repeats: int = 2


@dataclass(frozen=True)
class Calibration:
    speed: Speed
    batch: float
    step_ms: float
    tbt_slo_ms: float
    ttft_slo_ms: float
    capacity_rps: float
    rates: tuple[float, ...]
    num_requests: int
    est_sweep_s: float


def _round2(x: float) -> float:
    """Two significant digits: SLOs a reader can quote."""
    if x <= 0:
        return x
    from math import floor, log10

    digits = 1 - int(floor(log10(x)))
    return round(x, digits)


def derive(speed: Speed, kv_tokens: int, mean_in: float, mean_out: float, knobs: CalibrationKnobs,
           n_systems: int, elapsed_s: float, startup_s: float, max_requests: int) -> Calibration:
    batch = max(1.0, kv_tokens / (mean_in + mean_out))
    step = speed.step_at(batch)
    prefill = mean_in * speed.prefill_ms_per_token
    tbt = _round2(max(knobs.tbt_per_step * step, step + prefill))
    ttft = _round2(knobs.ttft_per_service * (prefill + mean_out * step))
    cap = 1000.0 / (prefill + mean_out * step / batch)
    rates = tuple(_round2(cap * m) for m in knobs.rate_multipliers)
    # Time of one point with N requests at rate r: arrivals N/r, plus the backlog past capacity
    # drained at c, plus one request's latency, plus the load generator's warmup.
    single_s = (prefill + mean_out * step) / 1000.0
    per_req = sum(1.0 / r + max(0.0, (1.0 - cap / r) / cap) for r in rates) * n_systems
    fixed = (single_s + min(mean_out, 32) * speed.step_at(1) / 1000.0 + 3.0) * len(rates) * n_systems
    left = knobs.budget_s - elapsed_s - startup_s * (n_systems - 1) - 30.0
    n = int(min(max_requests, max(knobs.min_requests, (left - fixed) / per_req)))  # --num-requests caps
    return Calibration(speed, batch, step, tbt, ttft, cap, rates, n, fixed + n * per_req)


# ---- the probe ---------------------------------------------------------------------------------
class ProbeError(RuntimeError):
    """A probe request failed or streamed no token: the server is not answering as it should."""


def _stream_times(url: str, text: str, out_tokens: int, times: list[list[float]], slot: int,
                  errors: list[str]) -> None:
    body = {"text": text, "stream": True,
            "sampling_params": {"max_new_tokens": out_tokens, "ignore_eos": True, "temperature": 0}}
    t0 = time.perf_counter()
    marks, seen = [t0], 0
    try:
        with requests.post(url + "/generate", json=body, stream=True, timeout=900) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                n = json.loads(line[5:]).get("meta_info", {}).get("completion_tokens", seen + 1)
                if n > seen:
                    marks.append(time.perf_counter())
                    seen = n
    except (requests.RequestException, ValueError) as exc:  # a thread's error would vanish: hand it back
        errors.append(f"{type(exc).__name__}: {exc}")
    times[slot] = marks


def _concurrent(url: str, texts: Sequence[str], out_tokens: int) -> list[list[float]]:
    """Each text's [send time, token times...]; a ProbeError when any request failed or streamed
    no token."""
    times: list[list[float]] = [[] for _ in texts]
    errors: list[str] = []
    threads = [threading.Thread(target=_stream_times, args=(url, t, out_tokens, times, i, errors))
               for i, t in enumerate(texts)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    empty = sum(len(m) < 2 for m in times)
    if errors or empty:
        raise ProbeError(f"speed probe of {url}: {empty} of {len(texts)} requests streamed no token"
                         f"{'; ' + errors[0] if errors else ''}")
    return times


def probe(url: str, texts: Sequence[str], prompt_tokens: int, out_tokens: int = 24,
          batches: Sequence[int] = (1, 4, 8), repeats: int = 2) -> Speed:
    """`texts`: distinct prompts of `prompt_tokens` tokens, at least probe_prompts(...) of them.

    Each batch size runs `repeats` times and keeps its fastest median gap (and the fastest lone
    TTFT): on a shared machine a probe is only ever slowed down by others, never sped up, and one
    slowed probe would scale every SLO."""
    need = probe_prompts(batches, repeats)
    assert len(texts) >= need, f"probe needs {need} prompts"
    _concurrent(url, texts[:1], out_tokens)  # warm the server's first-request paths
    used, steps, ttfts = 1, [], []
    for b in batches:
        best = float("inf")
        for _ in range(repeats):
            runs = _concurrent(url, texts[used: used + b], out_tokens)
            used += b
            gaps = [y - x for marks in runs for x, y in zip(marks[1:], marks[2:])]
            if not gaps:
                raise ProbeError(f"speed probe of {url}: no request streamed two tokens apart")
            best = min(best, 1000.0 * statistics.median(gaps))
            if b == 1:
                ttfts.append(runs[0][1] - runs[0][0])
        steps.append((b, best))
    ttft = min(ttfts) if ttfts else 0.0
    return Speed(prefill_ms_per_token=1000.0 * ttft / prompt_tokens, steps_ms=tuple(steps))


def probe_prompts(batches: Sequence[int] = (1, 4, 8), repeats: int = 2) -> int:
    """Distinct prompts a probe uses (no radix-cache hits: the lone TTFT measures a full prefill)."""
    return 1 + repeats * sum(batches)
