"""What a simulation run measured, with the server's own SLO definitions (rotasched.clock).

TTFT: first token time minus arrival. TBT: every inter-token gap. A request meets TBT when at
least TBT_MET_SHARE of its gaps are within its SLO (the A/B harness's joint rule); a request with a
single output token has no gap and meets it. Unfinished or dropped requests miss both.
tbt_attainment: share of requests meeting TBT; both_attainment: TTFT and TBT (the A/B's "joint");
tbt_gap_attainment: share of all gaps within their request's SLO (the A/B's TBT headline).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from superinfer_sgl.rotasched.clock import TBT_MET_SHARE
from superinfer_sgl.sim.request import Phase

if TYPE_CHECKING:
    from superinfer_sgl.sim.engine import Simulator


def _pct(xs: np.ndarray, q: float) -> float | None:
    if xs.size == 0:
        return None
    with np.errstate(invalid="ignore"):  # inf (never started) may sit next to the percentile
        v = float(np.percentile(xs, q))
    return None if math.isinf(v) else v


def request_outcomes(sim: Simulator) -> list[dict[str, object]]:
    """Per request: ttft (s or None), tbt_met, ttft_met, finished."""
    rows = []
    for r in sim.reqs:
        c = r.clock
        finished = r.phase is Phase.FINISHED
        ttft = None if c.first_token is None else c.first_token - r.spec.arrival
        share = c.tbt_share_met
        tpot = ((c.last_token - c.first_token) / (r.outputs - 1)
                if r.outputs > 1 and c.first_token is not None and c.last_token is not None else None)
        rows.append({
            "rid": r.rid,
            "ttft": ttft,
            "ttft_met": ttft is not None and ttft <= r.spec.ttft_slo + 1e-12,
            "tbt_met": finished and (share is None or share >= TBT_MET_SHARE),
            "tpot_met": finished and (tpot is None or tpot <= r.spec.tbt_slo + 1e-12),
            "finished": finished,
            "rotations": r.rotations,
            "recomputes": r.recomputes,
        })
    return rows


def summarize(sim: Simulator) -> dict[str, object]:
    rows = request_outcomes(sim)
    n = len(rows)
    ttfts = np.array([math.inf if x["ttft"] is None else x["ttft"] for x in rows], dtype=float)
    gaps = np.frombuffer(sim.gaps, dtype=float) if len(sim.gaps) else np.zeros(0)
    n_gaps = sum(r.clock.gaps for r in sim.reqs)
    missed = sum(r.clock.gaps_missed for r in sim.reqs)
    finished = sum(x["finished"] for x in rows)
    ttft_met = sum(x["ttft_met"] for x in rows)
    tbt_met = sum(x["tbt_met"] for x in rows)
    both = sum(x["ttft_met"] and x["tbt_met"] for x in rows)
    tpot_met = sum(x["tpot_met"] for x in rows)
    both_tpot = sum(x["ttft_met"] and x["tpot_met"] for x in rows)
    tokens = sum(r.outputs for r in sim.reqs)
    span = max(sim.now, 1e-9)
    s = sim.stats
    return {
        "policy": sim.policy.name,
        "profile": sim.profile.name,
        "workload": sim.workload.source,
        "requests": n,
        "finished": finished,
        "dropped": s.dropped,
        "unfinished": n - finished - s.dropped,
        "stalled": s.stalled,
        "ttft_attainment": ttft_met / n if n else None,
        "tbt_attainment": tbt_met / n if n else None,
        "both_attainment": both / n if n else None,
        "tbt_gap_attainment": 1.0 - missed / n_gaps if n_gaps else None,  # pooled, own SLOs
        "tpot_attainment": tpot_met / n if n else None,
        # DistServe's rule: TTFT met and the mean time per output token within the TBT SLO
        "joint_tpot_attainment": both_tpot / n if n else None,
        "ttft_p50_s": _pct(ttfts, 50),
        "ttft_p90_s": _pct(ttfts, 90),
        "ttft_p99_s": _pct(ttfts, 99),
        "ttft_max_s": float(ttfts.max()) if ttfts.size else None,
        "tbt_p50_s": _pct(gaps, 50),
        "tbt_p99_s": _pct(gaps, 99),
        "tbt_max_s": float(gaps.max()) if gaps.size else None,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / span,
        "goodput_req_s": both / span,
        "sim_end_s": sim.now,
        "iterations": s.iterations,
        "prefill_iterations": s.prefill_iterations,
        "rotations_out": s.rotations_out,
        "resumes": s.resumes,
        "retractions": s.retractions,
        "shortage_rotations": s.shortage_rotations,
        "host_full_fallbacks": s.host_full_fallbacks,
        "peak_rotary": s.peak_rotary,
        "peak_host_tokens": s.peak_host_tokens,
        "moved_out_gb": s.bytes_out / 1e9,
        "moved_in_gb": s.bytes_in / 1e9,
        "transfer_share": s.transfer_s / span,
        "compute_share": s.compute_s / span,
        "sched_share": s.sched_s / span,
        "eager_sync_link_load": (s.eager_bytes / (span * sim.profile.link.batched_d2h_gbps * 1e9)
                                 if sim.engine.eager_sync else None),
    }
