"""superinfer_-prefixed Prometheus series, exported through SGLang's /metrics (--enable-metrics).

SGLang runs prometheus_client in multiprocess mode; series created here in the scheduler process
land in its PROMETHEUS_MULTIPROC_DIR and the HTTP process aggregates them. prometheus_client must
therefore be imported only after SGLang has set that directory, i.e. lazily, in the scheduler.
"""

from __future__ import annotations

from typing import Any


class RotaSchedMetrics:
    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge

        self.rotations_out = Counter("superinfer_rotations_out", "Requests rotated out to host memory")
        self.resumes = Counter("superinfer_resumes", "Rotary requests resumed on the device")
        self.recompute_fallbacks = Counter(
            "superinfer_recompute_fallbacks", "Rotations that fell back to retract-and-recompute")
        self.sglang_retractions = Counter(
            "superinfer_sglang_retractions", "SGLang decode-OOM retractions (recomputed)")
        self.bytes_moved = Counter("superinfer_rotation_bytes", "KV bytes moved by rotation", ["direction"])
        self.rotary_requests = Gauge("superinfer_rotary_requests", "Requests parked in host memory",
                                     multiprocess_mode="livesum")
        self.host_blocks_used = Gauge("superinfer_host_pool_blocks_used", "Host rotary blocks in use",
                                      multiprocess_mode="livesum")
        self.host_blocks_total = Gauge("superinfer_host_pool_blocks_total", "Host rotary blocks",
                                       multiprocess_mode="livesum")
        self.slo_requests = Counter("superinfer_slo_requests",
                                    "Finished requests by SLO class and outcome (slo: ttft, tbt, joint = both; "
                                    "attainment = met / (met + missed))", ["slo_class", "slo", "outcome"])
        self.aborted_rotary = Counter("superinfer_aborted_rotary", "Requests aborted while rotary")
        self.kv_checks = Counter("superinfer_kv_verify", "Rotation KV byte checks (debug)", ["outcome"])
        self.duplex_steps = Counter("superinfer_duplex_steps",
                                    "Scheduling steps whose one rotation call moved KV both ways")
        self.prefetches = Counter("superinfer_prefetches", "Rotary requests whose KV was prefetched",
                                  ["outcome"])
        self.prefetch_bytes = Counter("superinfer_prefetch_bytes",
                                      "KV bytes brought back by prefetch (a subset of rotation_bytes{in})")
        self.budget = Gauge("superinfer_rotation_budget_blocks",
                            "Rotation blocks per iteration and direction (B_xfer; auto follows the step time)",
                            multiprocess_mode="livemax")
        self.link = Gauge("superinfer_kv_link_bytes_per_second",
                          "KV copy speed measured at startup, slower direction (0: not measured)",
                          multiprocess_mode="livemax")
        self._seen: dict[str, int] = {}

    def update(self, rt: Any) -> None:
        """Advance counters by what changed since the last call (stats are plain ints)."""
        s = rt.stats
        for name in ("rotations_out", "resumes", "recompute_fallbacks", "sglang_retractions", "aborted_rotary",
                     "duplex_steps"):
            self._advance(getattr(self, name), name, getattr(s, name))
        self._advance(self.prefetches.labels("started"), "prefetch_started", s.prefetches)
        self._advance(self.prefetches.labels("hit"), "prefetch_hit", s.prefetch_hits)
        self._advance(self.prefetches.labels("cancelled"), "prefetch_cancelled", s.prefetch_cancelled)
        self._advance(self.kv_checks.labels("identical"), "kv_ok", s.kv_verified)
        self._advance(self.kv_checks.labels("changed"), "kv_bad", s.kv_mismatches)
        if rt.engine is not None:
            self._advance(self.bytes_moved.labels("out"), "bytes_out", rt.engine.bytes_out)
            self._advance(self.bytes_moved.labels("eager_out"), "bytes_eager_out", rt.engine.bytes_eager_out)
            self._advance(self.bytes_moved.labels("in"), "bytes_in", rt.engine.bytes_in)
            self._advance(self.prefetch_bytes, "bytes_prefetched", rt.engine.bytes_prefetched)
        self.budget.set(rt.budget)
        self.link.set(rt.link_bytes_per_s or 0.0)
        usage = rt.pool_usage()
        self.rotary_requests.set(len(rt.rotary))
        self.host_blocks_used.set(usage["host_blocks_used"])
        self.host_blocks_total.set(usage["host_blocks_total"])

    def finished(self, slo_class: str | None, ttft_met: bool | None, tbt_met: bool | None) -> None:
        cls = slo_class or "default"
        joint = None if ttft_met is None or tbt_met is None else ttft_met and tbt_met
        for slo, met in (("ttft", ttft_met), ("tbt", tbt_met), ("joint", joint)):
            if met is not None:
                self.slo_requests.labels(cls, slo, "met" if met else "missed").inc()

    def _advance(self, counter: Any, key: str, value: int) -> None:
        delta = value - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = value
