"""Measurement only: one JSON line per scheduler iteration (what ran, when, for how long).

The simulator's validation replays an A/B against a cost profile taken at another time; on a
shared machine whose speed drifts by tens of percent within minutes, that alone can fail it. With
SUPERINFER_STEP_LOG=<path> set, each SGLang scheduler appends a line per `run_batch` call:

    t      unix time at the call (the A/B records each point's window in the same clock)
    dur    seconds inside run_batch (the forward; on CPU it is synchronous)
    idle   the scheduler idled just before (so the gap from the previous line is not a step)
    mode   SGLang's forward mode (DECODE, EXTEND, MIXED, ...)
    pt, pr, pq   prefill tokens, prefill requests, prefill attention pairs (sum e * (prefix + e/2))
    dr, dc       decode rows and their context tokens (a mixed batch has both)

`superinfer_sgl.sim.steplog` reads it back. It changes nothing the scheduler does, so it can be on
for stock SGLang and for our runtime alike. Enabled in plugin.load() for any SGLang process.
"""

from __future__ import annotations

import json
import os
import time
from typing import IO, Any, Callable

from . import check_target

TARGET = "sglang.srt.managers.scheduler.Scheduler.run_batch"
STEP_LOG_ENV = "SUPERINFER_STEP_LOG"

_sink: IO[str] | None = None


def step_log_path(environ: dict[str, str] | None = None) -> str | None:
    return (environ if environ is not None else os.environ).get(STEP_LOG_ENV) or None


def batch_shape(batch: Any) -> dict[str, Any]:
    """The batch's cost-relevant shape in the simulator's terms (sim.profile.StepModel)."""
    mode = getattr(batch.forward_mode, "name", str(batch.forward_mode))
    if batch.forward_mode.is_decode():
        return {"mode": mode, "pt": 0, "pr": 0, "pq": 0.0, "dr": batch.batch_size(),
                "dc": int(batch.seq_lens_sum or 0)}
    prefix = list(batch.prefix_lens or [])
    extend = list(batch.extend_lens or [])
    # A mixed batch appends its decode rows (extend 1, prefix = context - 1) after the prefill rows.
    decode_rows = len(batch.decoding_reqs or []) if batch.forward_mode.is_mixed() else 0
    cut = len(extend) - decode_rows
    pairs = sum(e * (p + e / 2.0) for p, e in zip(prefix[:cut], extend[:cut]))
    return {"mode": mode, "pt": int(sum(extend[:cut])), "pr": cut, "pq": pairs, "dr": decode_rows,
            "dc": int(sum(p + 1 for p in prefix[cut:]))}


def _run_batch(original: Callable[..., Any], sched: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    global _sink
    idle = bool(getattr(sched, "_sched_idled", False))
    t, start = time.time(), time.perf_counter()
    result = original(sched, batch, *args, **kwargs)
    dur = time.perf_counter() - start
    try:
        rec = {"t": round(t, 6), "dur": round(dur, 6), "idle": idle, **batch_shape(batch)}
    except (AttributeError, TypeError) as exc:  # an unforeseen batch kind: log it, never fail a step
        rec = {"t": round(t, 6), "dur": round(dur, 6), "idle": idle, "mode": "unknown", "error": repr(exc)}
    if _sink is None:
        _sink = open(step_log_path() or os.devnull, "a", buffering=1)  # noqa: SIM115 (lives with the process)
    _sink.write(json.dumps(rec, separators=(",", ":")) + "\n")
    return result


def register() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    check_target(TARGET)
    HookRegistry.register(TARGET, _run_batch, HookType.AROUND)
