"""superinfer_prefix_* Prometheus series: the predictive prefix cache's own time and its host
tier's traffic (--prefix-cache predictive, docs/prefix_cache.md, docs/deploy.md). They live on
SGLang's tree core, not the RotaSched runtime, so they work with either scheduler. Like
integration/metrics.py's series, prometheus_client is imported only when the first tree core
publishes (in a server: inside the scheduler, after SGLang set up its multiprocess directory)."""

from __future__ import annotations

from typing import Any

from .metrics import bind_registry

# Advanced from the plain counts the cache's state keeps; a match is far too frequent to publish on
# (every waiting request is re-matched every step), so they are published when the host tier
# copies (milliseconds each) and otherwise at most every PREFIX_PUBLISH_S while the hooks run.
PREFIX_PUBLISH_S = 0.5
PREFIX_HOST_EVENTS = ("demoted", "restored", "rejected_score", "rejected_room", "host_evicted", "dropped",
                      "restore_failures")


class PrefixCacheMetrics:
    """superinfer_prefix_* series: the predictor's own time and the host tier's traffic. One per
    process (prometheus_client refuses a series registered twice); each tree core's counts are
    advanced apart (`source`), the gauges hold the last core's (a server has one)."""

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        Counter = bind_registry(Counter, registry)  # noqa: N806
        Gauge = bind_registry(Gauge, registry)  # noqa: N806
        self.hook_seconds = Counter("superinfer_prefix_predictor_seconds",
                                    "Time the predictive prefix cache's hooks spent: hits on matched paths and each "
                                    "eviction round's scoring (the predictor's cost)")
        self.hook_calls = Counter("superinfer_prefix_predictor_calls", "Calls of those hooks")
        self.host_tokens = Counter("superinfer_prefix_host_copied_tokens",
                                   "Prefix tokens copied by the host tier: demoted (device to host, instead of "
                                   "dropped) and restored (host to device, on a request's match)", ["direction"])
        self.host_events = Counter("superinfer_prefix_host_entries",
                                   "Host-tier entries by event: demoted, restored, rejected_score (evicted leaf "
                                   "predicted below the threshold: dropped), rejected_room (no room for it), "
                                   "host_evicted (pushed off the host by better entries), dropped (their tree node "
                                   "left), restore_failures (no device memory: kept on host)", ["event"])
        self.host_seconds = Counter("superinfer_prefix_host_seconds",
                                    "Wall time of the host tier's copies and bookkeeping", ["direction"])
        self.host_used = Gauge("superinfer_prefix_host_tokens_used", "Host-tier tokens held (whole blocks)",
                               multiprocess_mode="livesum")
        self.host_budget = Gauge("superinfer_prefix_host_tokens_total", "Host-tier tokens (--prefix-host-tokens)",
                                 multiprocess_mode="livesum")
        self._seen: dict[tuple[int, str], float] = {}
        for direction in ("demoted", "restored"):
            self.host_tokens.labels(direction)
            self.host_seconds.labels(direction)
        for event in PREFIX_HOST_EVENTS:
            self.host_events.labels(event)

    def publish(self, source: int, hook_s: float, hook_calls: int, host: dict[str, float] | None) -> None:
        """Advance to one tree core's counts (`host`: the host tier's PrefixHost.counters(), or None)."""
        self._to(self.hook_seconds, source, "hook_s", hook_s)
        self._to(self.hook_calls, source, "hook_calls", hook_calls)
        if host is None:
            return
        self._to(self.host_tokens.labels("demoted"), source, "demoted_tokens", host["demoted_tokens"])
        self._to(self.host_tokens.labels("restored"), source, "restored_tokens", host["restored_tokens"])
        self._to(self.host_seconds.labels("demoted"), source, "demote_s", host["demote_s"])
        self._to(self.host_seconds.labels("restored"), source, "restore_s", host["restore_s"])
        for event in PREFIX_HOST_EVENTS:
            self._to(self.host_events.labels(event), source, event, host[event])
        self.host_used.set(host["host_tokens_used"])
        self.host_budget.set(host["host_tokens_budget"])

    def _to(self, counter: Any, source: int, key: str, value: float) -> None:
        delta = value - self._seen.get((source, key), 0)
        if delta > 0:
            counter.inc(delta)
        self._seen[(source, key)] = value


_PREFIX_METRICS: list[PrefixCacheMetrics] = []


def prefix_cache_metrics() -> PrefixCacheMetrics:
    """This process's prefix-cache series (created on first use: in a server that is inside the
    scheduler, after SGLang has set up prometheus_client's multiprocess directory)."""
    if not _PREFIX_METRICS:
        _PREFIX_METRICS.append(PrefixCacheMetrics())
    return _PREFIX_METRICS[0]
