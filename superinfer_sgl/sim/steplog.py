"""Read a server's step log (patches/step_log.py) and measure the machine's speed from it.

A replay's cost profile was measured at another time; on a shared machine the speed during an A/B
point differs by tens of percent, and a probe before the point sees only its own few seconds.
The step log holds every iteration the server ran during the point: compared with what the
profile predicts for the same batch shapes, it gives the point's decode and prefill speed factors
(`speed_scales`) from thousands of steps instead of a handful, the step model refit to them
(`refit`), and the machine's speed over the point (`speed_trace`, from `bench_start`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from superinfer_sgl.rotasched.costs import SPREAD_CLIP
from superinfer_sgl.sim.profile import StepModel

MIN_STEPS = 20  # fewer steps of a kind in a window: no factor for that kind (the profile's own)


@dataclass(frozen=True)
class Step:
    """One scheduler iteration. `period_s`: from its start to the next one's (what the simulator's
    step time stands for: forward plus the scheduler's own work), None when the server idled
    before the next step or the log ended."""

    t: float
    dur_s: float
    mode: str
    prefill_tokens: int
    prefill_reqs: int
    prefill_pairs: float
    decode_rows: int
    decode_context: int
    period_s: float | None = None

    @property
    def kind(self) -> str:
        if self.prefill_tokens and self.decode_rows:
            return "mixed"
        return "prefill" if self.prefill_tokens else "decode" if self.decode_rows else "other"


def read_steps(path: Path) -> list[Step]:
    """The log's steps in time order, each with its period. Lines the patch could not shape
    (mode 'unknown') and a torn last line (a server killed mid-write) are skipped."""
    raw = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if rec.get("mode") != "unknown":
            raw.append(rec)
    raw.sort(key=lambda r: r["t"])
    steps = []
    for rec, nxt in zip(raw, raw[1:] + [None]):
        period = None if nxt is None or nxt["idle"] else nxt["t"] - rec["t"]
        steps.append(Step(t=rec["t"], dur_s=rec["dur"], mode=rec["mode"], prefill_tokens=rec["pt"],
                          prefill_reqs=rec["pr"], prefill_pairs=rec["pq"], decode_rows=rec["dr"],
                          decode_context=rec["dc"], period_s=period))
    return steps


def in_window(steps: Sequence[Step], window: Sequence[float]) -> list[Step]:
    t0, t1 = window
    return [s for s in steps if t0 <= s.t <= t1]


def predicted_s(model: StepModel, s: Step) -> float:
    return model.seconds(prefill_tokens=s.prefill_tokens, prefill_pairs=s.prefill_pairs,
                         prefill_reqs=s.prefill_reqs, decode_reqs=s.decode_rows, decode_context=s.decode_context)


def _ratio(pairs: Iterable[tuple[float, float]]) -> float | None:
    """sum(measured) / sum(predicted), or None over fewer than MIN_STEPS steps."""
    pairs = list(pairs)
    if len(pairs) < MIN_STEPS:
        return None
    return sum(m for m, _ in pairs) / sum(p for _, p in pairs)


def decode_side_s(model: StepModel, s: Step) -> float:
    """The part of a step's predicted time that sim.validate.scaled scales as decode: the base
    and the decode rows (a prefill-only step still pays the base)."""
    return model.seconds(decode_reqs=s.decode_rows, decode_context=s.decode_context) if s.decode_rows else model.base_s


def speed_scales(model: StepModel, steps: Sequence[Step]) -> dict | None:
    """Decode factor: the decode-only steps' measured time over what the profile predicts for
    them (a ratio of sums, so the replay keeps the server's busy time: single steps spread, and
    a median would drop the slow tail). Prefill factor: the same over the steps with prefill
    tokens (prefill-only and mixed), for what is left of each step after its decode side at the
    decode factor. None when the window holds fewer than MIN_STEPS decode steps; the prefill
    factor is the decode one when it holds fewer prefill steps (prefill_measured: False)."""
    timed = [s for s in steps if s.period_s is not None]
    dec = [(s.period_s, predicted_s(model, s)) for s in timed if s.kind == "decode"]
    decode = _ratio(dec)
    if decode is None:
        return None
    prefill = _ratio((s.period_s - decode * decode_side_s(model, s), predicted_s(model, s) - decode_side_s(model, s))
                     for s in timed if s.prefill_tokens and predicted_s(model, s) > decode_side_s(model, s))
    ratios = sorted(m / p for m, p in dec)
    kinds = [s.kind for s in steps]
    return {"decode": decode, "prefill": decode if prefill is None else prefill,
            "prefill_measured": prefill is not None,
            # single decode steps around the factor (the replay's steps do not spread)
            "decode_p10_p90": [ratios[len(ratios) // 10] / decode, ratios[(9 * len(ratios)) // 10] / decode],
            "steps": {k: kinds.count(k) for k in ("decode", "prefill", "mixed", "other")}}


MIN_SPREAD = 3  # a slope needs its regressor to span at least this many rows / this ratio of tokens


def refit(model: StepModel, steps: Sequence[Step]) -> tuple[StepModel, dict] | None:
    """The profile's step model refit to the window's own steps, where they pin it down.

    Two factors keep the profile's shape: on this VM the cost of one more decode row moves with
    the machine's state differently from the base (in one point, 9-row steps ran 20% over the
    scaled profile while 1-row steps matched). So, after speed_scales: decode base and per-row cost
    by least squares over the decode-only steps (context cost: the profile's at the decode factor,
    the contexts here being too alike to fit it); prefill intercept and per-token cost over the
    steps with prefill tokens, after their decode side (pair cost: the profile's at the prefill
    factor). Where the window's batch sizes or prompt lengths barely vary, or the profile is a
    roofline (floor_s > 0), that part stays scaled.
    Returns the model and what was fitted; None as speed_scales."""
    scales = speed_scales(model, steps)
    if scales is None:
        return None
    d, f = scales["decode"], scales["prefill"]
    base, per_row, per_ctx = model.base_s * d, model.per_decode_token_s * d, model.per_context_token_s * d
    timed = [s for s in steps if s.period_s is not None]
    dec = [s for s in timed if s.kind == "decode"]
    fitted: list[str] = []
    rows = [s.decode_rows for s in dec]
    # a roofline profile (floor_s > 0: step = max(floor, linear)) is not linear in the rows: scaled only
    linear = model.floor_s == 0.0
    if linear and max(rows) - min(rows) >= MIN_SPREAD:
        A = np.array([[1.0, s.decode_rows] for s in dec])
        y = np.array([s.period_s - per_ctx * s.decode_context for s in dec])
        (b0, b1), *_ = np.linalg.lstsq(A, y, rcond=None)
        if b0 > 0 and b1 > 0:
            base, per_row = float(b0), float(b1)
            fitted.append("decode base and per-row cost")
    pre_base, per_tok, per_pair = model.prefill_base_s * f, model.per_prefill_token_s * f, model.per_prefill_pair_s * f
    partial = StepModel(base_s=base, per_decode_token_s=per_row, per_context_token_s=per_ctx)
    pre = [s for s in timed if s.prefill_tokens]
    toks = [s.prefill_tokens for s in pre]
    if linear and len(pre) >= MIN_STEPS and max(toks) >= MIN_SPREAD * min(toks):
        # what the prefill part of each step took: its period less its decode side and pair cost
        side = [partial.seconds(decode_reqs=s.decode_rows, decode_context=s.decode_context) if s.decode_rows
                else base for s in pre]
        A = np.array([[1.0, s.prefill_tokens] for s in pre])
        y = np.array([s.period_s - x - per_pair * s.prefill_pairs for s, x in zip(pre, side)])
        (a0, a1), *_ = np.linalg.lstsq(A, y, rcond=None)
        if a1 > 0:
            pre_base, per_tok = float(max(a0, 0.0)), float(a1)
            fitted.append("prefill intercept and per-token cost")
    step = StepModel(base_s=base, prefill_base_s=pre_base, floor_s=model.floor_s * d, per_prefill_token_s=per_tok,
                     per_decode_token_s=per_row, per_context_token_s=per_ctx, per_prefill_pair_s=per_pair,
                     per_prefill_req_s=model.per_prefill_req_s * f, per_resume_s=model.per_resume_s * d)
    return step, {**scales, "refit": fitted}


TRACE_BUCKET_S = 3.0  # speed-trace resolution: this VM's speed moves by 15-20% between 3 s buckets
TRACE_MIN_STEPS = 8


def bench_start(steps: Sequence[Step], first_arrival_s: float, overhead_s: float) -> float | None:
    """Unix time of the replay's t = 0 in a point's window: sglang.bench_serving sends one warm-up
    request and waits for it before the first scheduled one, so the first prefill after an idle
    scheduler turn is the warm-up's and the second is the first scheduled request's (sent at
    first_arrival_s, at the scheduler overhead_s later). None without two such prefills."""
    starts = [s.t for prev, s in zip(steps, steps[1:]) if s.prefill_tokens and prev.period_s is None]
    if steps and steps[0].prefill_tokens:
        starts.insert(0, steps[0].t)
    return starts[1] - first_arrival_s - overhead_s if len(starts) >= 2 else None


def speed_trace(model: StepModel, steps: Sequence[Step], t0: float,
                bucket_s: float = TRACE_BUCKET_S) -> tuple[tuple[float, float], ...]:
    """The machine's speed over a point relative to `model` (for SimConfig.speed_trace): per
    bucket_s of wall time from t0, measured over predicted time of its steps (ratio of sums);
    1 before t0 and for buckets with fewer than TRACE_MIN_STEPS steps."""
    buckets: dict[int, list[float]] = {}
    for s in steps:
        if s.period_s is not None and s.t >= t0:
            acc = buckets.setdefault(int((s.t - t0) // bucket_s), [0.0, 0.0, 0])
            acc[0] += s.period_s
            acc[1] += predicted_s(model, s)
            acc[2] += 1
    return tuple((k * bucket_s, m / p if n >= TRACE_MIN_STEPS and p > 0 else 1.0)
                 for k, (m, p, n) in sorted(buckets.items()))


def step_spread(model: StepModel, steps: Sequence[Step], bucket_s: float | None = TRACE_BUCKET_S) -> float | None:
    """How much single steps spread around `model` (for SimConfig.step_jitter): the RMS of each
    timed step's period over its prediction, less 1, clipped as the server's CostMeter clips it.
    With `bucket_s`, each prediction is first scaled by its bucket's speed (what speed_trace
    replays), leaving the spread within buckets; None: drift over the log counts as spread too.
    None over fewer than MIN_STEPS timed steps."""
    timed = [(s, predicted_s(model, s)) for s in steps if s.period_s is not None]
    timed = [(s, p) for s, p in timed if p > 0]
    if len(timed) < MIN_STEPS:
        return None
    factor: dict[int, float] = {}
    if bucket_s is not None:
        t0 = timed[0][0].t
        sums: dict[int, list[float]] = {}
        for s, p in timed:
            acc = sums.setdefault(int((s.t - t0) // bucket_s), [0.0, 0.0])
            acc[0] += s.period_s or 0.0
            acc[1] += p
        factor = {k: m / q for k, (m, q) in sums.items()}
        rel = [(s.period_s or 0.0) / (p * factor[int((s.t - t0) // bucket_s)]) - 1.0 for s, p in timed]
    else:
        rel = [(s.period_s or 0.0) / p - 1.0 for s, p in timed]
    clipped = np.minimum(np.abs(np.array(rel)), SPREAD_CLIP)
    return float(np.sqrt(np.mean(clipped ** 2)))
