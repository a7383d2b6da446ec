"""Prometheus series of rotation copy time (duplexkv/copy_timing.py measures it):

  superinfer_kv_copy_out_seconds_total      device -> host copies of rotations out
  superinfer_kv_copy_in_seconds_total       host -> device copies of resumes and prefetches
  superinfer_kv_copy_overlap_seconds_total  time both directions of one step's rotation ran at once
  superinfer_kv_copies_total{direction}     timed copy spans (one per direction per step)

Copy seconds over rotations gives the measured cost of one rotation (the A/B report shows it).
Like integration/metrics.py, prometheus_client is imported lazily in the scheduler process, after
SGLang has set its multiprocess directory; nothing is exported without --enable-metrics.
"""

from __future__ import annotations

import logging
from typing import Any

from ..duplexkv.copy_timing import CopyTimer

logger = logging.getLogger(__name__)


class CopyMetrics:
    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter

        registry = REGISTRY if registry is None else registry
        self.out_s = Counter("superinfer_kv_copy_out_seconds",
                             "Seconds of device-to-host rotation copies (CUDA events; wall clock on CPU)",
                             registry=registry)
        self.in_s = Counter("superinfer_kv_copy_in_seconds",
                            "Seconds of host-to-device rotation copies (CUDA events; wall clock on CPU)",
                            registry=registry)
        self.overlap_s = Counter("superinfer_kv_copy_overlap_seconds",
                                 "Seconds both copy directions of one rotation step ran at once", registry=registry)
        self.copies = Counter("superinfer_kv_copies", "Timed rotation copy spans", ["direction"], registry=registry)
        self._seen: dict[str, float] = {}

    def update(self, timer: CopyTimer) -> None:
        """Advance every series by what the timer read since the last call."""
        t = timer.totals()
        for key, counter in (("out_s", self.out_s), ("in_s", self.in_s), ("overlap_s", self.overlap_s),
                             ("out_calls", self.copies.labels("out")), ("in_calls", self.copies.labels("in"))):
            delta = t[key] - self._seen.get(key, 0.0)
            if delta > 0:
                counter.inc(delta)
            self._seen[key] = t[key]


_STATE: dict[str, Any] = {}


def _metrics() -> CopyMetrics | None:
    """The process's CopyMetrics, or None when the server runs without --enable-metrics."""
    if "metrics" not in _STATE:
        try:
            from sglang.srt.runtime_context import get_observability

            from .metrics_rank import is_metrics_rank

            enabled = bool(get_observability().enable_metrics) and is_metrics_rank()
        except Exception:  # outside a server (unit tests on fakes): nothing to export to
            enabled = False
        _STATE["metrics"] = CopyMetrics() if enabled else None
    return _STATE["metrics"]


def publish(timer: CopyTimer) -> None:
    """Export what the timer has read so far; never raises into the scheduler."""
    try:
        metrics = _metrics()
        if metrics is not None:
            metrics.update(timer)
    except Exception:
        if not _STATE.get("failed"):
            logger.exception("superinfer: copy-time metrics not updated")
        _STATE["failed"] = True
