"""SLO metrics computed from per-request ttft / itl lists (bench_serving --output-details).

Definitions (also in docs/ab.md):
- gaps of a request: its inter-token latencies as the client saw them, plus zero-length gaps for
  tokens that arrived in the same chunk (output_len - 1 gaps in all; like rotasched.clock).
- TTFT attainment: share of requests with ttft <= their TTFT SLO (a failed request misses).
- TBT attainment, headline: share of all gaps (pooled over requests) <= their request's TBT SLO.
- TBT attainment, per request: share of requests whose every gap meets the SLO.
- joint attainment: share of requests with TTFT met and >= TBT_MET_SHARE (90%) of gaps met.
- goodput: requests meeting both (joint) per second of benchmark duration (DistServe).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..rotasched.clock import TBT_MET_SHARE


@dataclass(frozen=True)
class RequestOutcome:
    ttft_slo_ms: float
    tbt_slo_ms: float
    success: bool
    ttft_s: float = 0.0
    itl_s: tuple[float, ...] = ()
    latency_s: float = 0.0
    output_len: int = 0
    expected_output: int = 0
    slo_class: str | None = None

    @property
    def n_gaps(self) -> int:
        n_out = self.output_len if self.success and self.output_len > 0 else self.expected_output
        return max(n_out - 1, len(self.itl_s) if self.success else 0, 0)

    def gaps_s(self) -> list[float]:
        if not self.success:
            return []
        return [*self.itl_s, *([0.0] * (self.n_gaps - len(self.itl_s)))]

    @property
    def ttft_met(self) -> bool:
        return self.success and self.ttft_s * 1000.0 <= self.ttft_slo_ms

    @property
    def gaps_met(self) -> int:
        return sum(g * 1000.0 <= self.tbt_slo_ms for g in self.gaps_s())

    @property
    def tbt_share(self) -> float:
        if not self.success:
            return 0.0
        return self.gaps_met / self.n_gaps if self.n_gaps else 1.0

    @property
    def tbt_all_met(self) -> bool:
        return self.success and self.gaps_met == self.n_gaps

    @property
    def joint_met(self) -> bool:
        return self.ttft_met and self.tbt_share >= TBT_MET_SHARE


def outcomes_from_details(details: Mapping[str, list], slos: Sequence[tuple[float, float, str | None]],
                          expected_outputs: Sequence[int]) -> list[RequestOutcome]:
    """bench_serving's --output-details record (ttfts, itls, errors, output_lens) + our SLOs."""
    n = len(slos)
    ttfts, itls, errors = details["ttfts"], details["itls"], details["errors"]
    out_lens = details.get("output_lens") or [0] * n
    e2e = details.get("e2e_latencies") or [None] * n
    if not (len(ttfts) == len(itls) == len(errors) == n):
        raise ValueError(f"details cover {len(ttfts)} requests, the workload has {n}")
    outcomes = []
    for i, (ttft_slo, tbt_slo, cls) in enumerate(slos):
        # bench_serving leaves ttft at 0.0 until a content chunk arrives: a "success" without one (a
        # stream ended by an abort's error chunk, or an immediate EOS) delivered nothing and is a miss
        ok = not errors[i] and float(ttfts[i]) > 0.0
        itl = tuple(float(x) for x in itls[i])
        latency = e2e[i] if e2e[i] is not None else float(ttfts[i]) + sum(itl)
        outcomes.append(RequestOutcome(ttft_slo, tbt_slo, ok, float(ttfts[i]), itl, float(latency),
                                       int(out_lens[i] or 0), int(expected_outputs[i]), cls))
    return outcomes


def _pct(values: Sequence[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if len(values) else None


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


@dataclass
class Summary:
    n: int
    completed: int
    duration_s: float
    ttft_attainment: float
    tbt_gap_attainment: float
    tbt_request_attainment: float
    joint_attainment: float
    goodput_rps: float
    request_throughput_rps: float
    output_throughput_tps: float
    p50_ttft_ms: float | None
    p99_ttft_ms: float | None
    p50_tbt_ms: float | None
    p99_tbt_ms: float | None
    p50_e2e_ms: float | None
    p99_e2e_ms: float | None
    by_class: dict[str, dict[str, float]] = field(default_factory=dict)


def summarize(outcomes: Sequence[RequestOutcome], duration_s: float) -> Summary:
    assert outcomes and duration_s > 0
    ok = [o for o in outcomes if o.success]
    gaps = [g for o in ok for g in o.gaps_s()]
    total_gaps = sum(o.n_gaps for o in outcomes)
    n = len(outcomes)
    joint = sum(o.joint_met for o in outcomes)
    s = Summary(
        n=n,
        completed=len(ok),
        duration_s=duration_s,
        ttft_attainment=sum(o.ttft_met for o in outcomes) / n,
        tbt_gap_attainment=sum(o.gaps_met for o in ok) / total_gaps if total_gaps else 1.0,
        tbt_request_attainment=sum(o.tbt_all_met for o in outcomes) / n,
        joint_attainment=joint / n,
        goodput_rps=joint / duration_s,
        request_throughput_rps=len(ok) / duration_s,
        output_throughput_tps=sum(o.n_gaps + 1 for o in ok) / duration_s,
        p50_ttft_ms=_ms(_pct([o.ttft_s for o in ok], 50)),
        p99_ttft_ms=_ms(_pct([o.ttft_s for o in ok], 99)),
        p50_tbt_ms=_ms(_pct(gaps, 50)),
        p99_tbt_ms=_ms(_pct(gaps, 99)),
        p50_e2e_ms=_ms(_pct([o.latency_s for o in ok], 50)),
        p99_e2e_ms=_ms(_pct([o.latency_s for o in ok], 99)),
    )
    classes = sorted({o.slo_class for o in outcomes if o.slo_class is not None})
    for cls in classes:
        sub = [o for o in outcomes if o.slo_class == cls]
        sub_ok = [o for o in sub if o.success]
        sub_gaps = sum(o.n_gaps for o in sub)
        s.by_class[cls] = {
            "n": len(sub),
            "ttft_attainment": sum(o.ttft_met for o in sub) / len(sub),
            "tbt_gap_attainment": sum(o.gaps_met for o in sub_ok) / sub_gaps if sub_gaps else 1.0,
            "tbt_request_attainment": sum(o.tbt_all_met for o in sub) / len(sub),
            "joint_attainment": sum(o.joint_met for o in sub) / len(sub),
            "p99_ttft_ms": _ms(_pct([o.ttft_s for o in sub_ok], 99)),
        }
    return s


# ---- across the sweep --------------------------------------------------------------------------
def max_rate_meeting(points: Iterable[tuple[float, float]], target: float = 0.9) -> dict[str, object]:
    """Highest rate up to which every swept point meets `target`, and the interpolated crossing.

    `all_met` says the crossing lies beyond the sweep (the figures are then lower bounds).
    """
    pts = sorted(points)
    last_ok: tuple[float, float] | None = None
    for rate, value in pts:
        if value >= target:
            last_ok = (rate, value)
            continue
        if last_ok is None:
            return {"max_swept": None, "interpolated": None, "all_met": False}
        (r1, v1), (r2, v2) = last_ok, (rate, value)
        cross = r1 + (v1 - target) / (v1 - v2) * (r2 - r1)
        return {"max_swept": r1, "interpolated": cross, "all_met": False}
    if last_ok is None:
        return {"max_swept": None, "interpolated": None, "all_met": False}
    return {"max_swept": last_ok[0], "interpolated": last_ok[0], "all_met": True}


# ---- Prometheus --------------------------------------------------------------------------------
def parse_prometheus(text: str) -> dict[str, float]:
    """Exposition text -> {series name: value summed over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0].strip()
        try:
            v = float(value)
        except ValueError:
            continue
        if math.isfinite(v):
            out[name] = out.get(name, 0.0) + v
    return out


# Counters we difference around every run: (report key, Prometheus series).
COUNTERS = (
    ("rotations", "superinfer_rotations_out_total"),
    ("resumes", "superinfer_resumes_total"),
    ("recompute_fallbacks", "superinfer_recompute_fallbacks_total"),
    ("retractions", "sglang:num_retracted_requests_total"),
    # decode memory shortages answered by rotation (integration/decode_shortage.py)
    ("shortage_rotations", "superinfer_decode_shortage_rotations_total"),
    # rotation copy time (integration/copy_metrics.py): CUDA events on a GPU, wall clock on a CPU
    ("copy_out_s", "superinfer_kv_copy_out_seconds_total"),
    ("copy_in_s", "superinfer_kv_copy_in_seconds_total"),
    ("copy_overlap_s", "superinfer_kv_copy_overlap_seconds_total"),
)


def counter_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float | None]:
    """Per-run counts. A labelled counter appears only at its first increment, so a missing series
    of a family the server does export (same prefix) counts 0; None where the whole family is absent
    (e.g. superinfer_ on stock SGLang, or /metrics unreachable)."""
    out: dict[str, float | None] = {}
    for key, series in COUNTERS:
        family = series.split(":")[0] + ":" if ":" in series else series.split("_")[0] + "_"
        if not any(name.startswith(family) for name in after):
            out[key] = None
        else:
            out[key] = after.get(series, 0.0) - before.get(series, 0.0)
    return out
