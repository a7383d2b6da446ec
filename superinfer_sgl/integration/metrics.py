"""superinfer_-prefixed Prometheus series, exported through SGLang's /metrics (--enable-metrics).

SGLang runs prometheus_client in multiprocess mode; series created here in the scheduler process
land in its PROMETHEUS_MULTIPROC_DIR and the HTTP process aggregates them. prometheus_client must
therefore be imported only after SGLang has set that directory, i.e. lazily, in the scheduler.

The headroom gauges (queue VLT, requests at risk, recent attainment: rotasched/headroom.py) are
what a router or autoscaler reads; each carries a `dp_rank` label, so data-parallel ranks (one
scheduler process each) stay apart. Their multiprocess mode is livemax: one process writes each
label set (TP ranks of one DP rank would write the same value).

Which processes export: `metrics_rank.is_metrics_rank` (SGLang's own rule).

The recompute tax (`RecomputeTally`): prefill tokens computed, and of them the tokens computed
again because the request's KV had been dropped while it ran (SGLang's decode-OOM retraction, our
recompute fallback, the partial page a rotation resume re-extends), net of radix-cache hits on
re-admission. Totals follow SGLang's own rule (PrefillAdder's `log_input_tokens` and
`reprocessed_log_input_tokens`, the requests it marks `retracted_stain`), which stock SGLang
exports too (`sglang:realtime_tokens_total` / `sglang:prefill_effective_tokens_total`,
bench/recompute.py), so both sides of an A/B are counted alike; ours adds the cause.

The SLO outcome series count client requests only: SGLang's health probes and its startup
warm-up are requests too, and a probe every 10 s would add ~8,600 "met" requests a day
(`metered`: the rid SGLang gives a probe, or the mark integration.http_slo puts on both).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Iterator

from ..rotasched.headroom import AttainmentWindow, headroom

if TYPE_CHECKING:  # (its views import torch; the HTTP process reads _dp_rank from here)
    from .step_figures import KvBytes, StepFigures

# The headroom gauges rebuild a view of every queued request, for gauges scraped seconds apart: per
# step that is a measurable share of a CPU server's scheduler time (docs/perf.md), under a backlog
# and even at a handful of requests (~0.07 ms of a ~35 ms decode step). So they are refreshed at most
# every HEADROOM_INTERVAL_S, and at once when the queue or the batch changes size while at most
# HEADROOM_EVERY_STEP requests queue (where bursts come and go between scrapes, and an idle server
# must read 0 at once).
HEADROOM_INTERVAL_S = 0.25
HEADROOM_EVERY_STEP = 32

logger = logging.getLogger(__name__)


def _dp_rank() -> str:
    """This scheduler's data-parallel rank ("0" without DP, or outside a server)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        rank = getattr(get_parallel(), "dp_rank", None)
    except Exception:  # an older/newer SGLang without the context: one rank
        rank = None
    return str(rank or 0)


HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants (health_generate's rids)
UNMETERED_KEY = "superinfer_unmetered"  # integration.http_slo.UNMETERED_KEY


def metered(req: Any) -> bool:
    """Whether a finished request counts in the SLO series: not a health probe (its rid), not
    marked by the HTTP layer as one or as the startup warm-up (its custom_params), and not a
    prefill-only request (`max_new_tokens` 0: no token asked for, so no TTFT or TBT to keep; it
    is what SGLang sends itself ahead of an `n > 1` request to cache its prompt, carrying the
    samples' own custom_params)."""
    rid = getattr(req, "rid", None)
    if isinstance(rid, str) and rid.startswith(HEALTH_CHECK_RID_PREFIX):
        return False
    params = getattr(req, "sampling_params", None)
    if getattr(params, "max_new_tokens", None) == 0:
        return False
    custom = getattr(params, "custom_params", None)
    return not (isinstance(custom, dict) and custom.get(UNMETERED_KEY))


RECOMPUTE_CAUSES = ("retraction", "recompute_fallback", "rotation")
# How decode memory shortages were answered (integration/decode_shortage.py; RotationStats.shortages):
# rotation alone, rotation then SGLang's retraction, SGLang's retraction alone; and the key of the
# requests rotated out for them.
SHORTAGE_ANSWERS = ("rotation", "rotation_and_retraction", "retraction")
SHORTAGE_ROTATED = "rotated_requests"
_CAUSES_KEPT = 65536  # rids whose last KV release we remember (oldest forgotten first)


class RecomputeTally:
    """Prefill tokens computed and recomputed, by cause (plain ints; the hooks feed it, the metrics
    export it). `requeued`: a running request went back to the waiting queue with its KV dropped,
    by SGLang's decode retraction (`in_retraction`: inside `Scheduler.update_running_batch`) or by
    our rotation's recompute fallback; `prefill_batch`: a prefill batch SGLang built, with its
    PrefillAdder's token counts."""

    def __init__(self) -> None:
        self.prefill_tokens = 0
        self.recomputed = dict.fromkeys(RECOMPUTE_CAUSES, 0)
        self.released_tokens = dict.fromkeys(RECOMPUTE_CAUSES[:2], 0)
        self.in_retraction = False
        self._cause: dict[str, str] = {}

    @property
    def recomputed_tokens(self) -> int:
        return sum(self.recomputed.values())

    @property
    def ratio(self) -> float:
        """Recomputed over computed prefill tokens so far (0 before any prefill)."""
        return self.recomputed_tokens / self.prefill_tokens if self.prefill_tokens else 0.0

    @contextlib.contextmanager
    def retraction(self) -> Iterator[None]:
        """Requests requeued inside this block were retracted by SGLang (decode out of memory)."""
        self.in_retraction = True
        try:
            yield
        finally:
            self.in_retraction = False

    def requeued(self, req: Any) -> None:
        cause = "retraction" if self.in_retraction else "recompute_fallback"
        self.released_tokens[cause] += len(req.origin_input_ids) + len(req.output_ids)
        self._cause.pop(req.rid, None)
        self._cause[req.rid] = cause
        while len(self._cause) > _CAUSES_KEPT:
            self._cause.pop(next(iter(self._cause)))

    def prefill_batch(self, batch: Any, chunked: Any = None) -> int:
        """Count one prefill batch; returns its recomputed tokens. Totals are SGLang's
        (`batch.prefill_stats`); each marked request's extend goes to the cause of its last KV
        release, and what no recorded release explains (a rotated-out request's resume) to
        "rotation". A request's cause is forgotten once its re-extend is complete (`chunked`: the
        scheduler's request still mid-prefill)."""
        st = getattr(batch, "prefill_stats", None)
        if st is None:
            return 0
        self.prefill_tokens += int(st.log_input_tokens) + int(getattr(st, "log_replay_tokens", 0) or 0)
        total = int(getattr(st, "reprocessed_log_input_tokens", 0) or 0)
        left = total
        lens = list(getattr(batch, "extend_lens", None) or [])
        for req, n in zip(batch.reqs, lens):
            cause = self._cause.get(req.rid)
            if cause is None or not getattr(req, "retracted_stain", False):
                continue
            n = min(int(n), left)
            self.recomputed[cause] += n
            left -= n
            if req is not chunked:
                self._cause.pop(req.rid, None)
        self.recomputed["rotation"] += left
        return total


_TALLY: list[RecomputeTally] = []


def recompute_tally() -> RecomputeTally:
    """This scheduler process's tally (one per process, like its Scheduler)."""
    if not _TALLY:
        _TALLY.append(RecomputeTally())
    return _TALLY[0]


def recompute_hooks(runtime: Any) -> dict[str, Any]:
    """The hook bodies that feed the tally (integration/hooks.py installs them): around
    `Scheduler.update_running_batch` (where SGLang retracts), before `Scheduler._add_request_to_queue`,
    after `Scheduler._get_new_batch_prefill_raw` (the batch with its PrefillAdder counts). `runtime()`
    gives the scheduler's runtime (None before it attaches), whose metrics export the tally.
    Counting must never take the scheduler down: a failure is logged once and counting stops."""
    tally = recompute_tally()
    failed: list[bool] = []

    def guarded(fn: Any) -> Any:
        def hook(*args: Any, **kwargs: Any) -> None:
            if failed:
                return None
            try:
                fn(*args, **kwargs)
            except Exception:
                failed.append(True)
                logger.exception("superinfer: recompute counting stopped")
            return None

        return hook

    def decode_update(original: Any, sched: Any, *args: Any, **kwargs: Any) -> Any:
        with tally.retraction():
            return original(sched, *args, **kwargs)

    def requeued(sched: Any, req: Any, is_retracted: bool = False, *args: Any, **kwargs: Any) -> None:
        if is_retracted:
            tally.requeued(req)

    def prefill(result: Any, sched: Any, *args: Any, **kwargs: Any) -> None:
        batch = result[0] if isinstance(result, tuple) else result  # _get_new_batch_prefill_raw: (batch, running)
        if batch is None:
            return
        tally.prefill_batch(batch, getattr(sched, "chunked_req", None))
        rt = runtime()
        if rt is not None and rt.metrics is not None:
            rt.metrics.publish_recompute(tally)

    return {"decode_update": decode_update, "requeued": guarded(requeued), "prefill": guarded(prefill)}


class RotaSchedMetrics:
    def __init__(self, registry: Any = None, window: int | None = None) -> None:
        from prometheus_client import REGISTRY, Counter, Gauge

        registry = REGISTRY if registry is None else registry
        Counter = bind_registry(Counter, registry)  # noqa: N806 - tests pass their own registry
        Gauge = bind_registry(Gauge, registry)  # noqa: N806

        self.rotations_out = Counter("superinfer_rotations_out", "Requests rotated out to host memory")
        self.resumes = Counter("superinfer_resumes", "Rotary requests resumed on the device")
        self.recompute_fallbacks = Counter(
            "superinfer_recompute_fallbacks", "Rotations that fell back to retract-and-recompute")
        self.sglang_retractions = Counter(
            "superinfer_sglang_retractions", "SGLang decode-OOM retractions (recomputed)")
        self.shortage_rotations = Counter(
            "superinfer_decode_shortage_rotations",
            "Running requests rotated out to host to answer a decode memory shortage (instead of SGLang's "
            "retraction; --decode-shortage rotate)")
        self.decode_shortages = Counter(
            "superinfer_decode_shortages",
            "Decode memory shortages of the running batch (SGLang's retract_decode), by answer: rotation "
            "(rotation alone), rotation_and_retraction (rotation, then SGLang retracted the rest), retraction "
            "(SGLang's retraction alone: nothing rotatable, host pool full, or --decode-shortage retract)",
            ["answer"])
        self.bytes_moved = Counter("superinfer_rotation_bytes", "KV bytes moved by rotation", ["direction"])
        self.rotary_requests = Gauge("superinfer_rotary_requests", "Requests parked in host memory",
                                     multiprocess_mode="livesum")
        self.host_blocks_used = Gauge("superinfer_host_pool_blocks_used", "Host rotary blocks in use",
                                      multiprocess_mode="livesum")
        self.host_bytes = Gauge("superinfer_host_kv_bytes",
                                "Host bytes rotary KV holds, by SLO class and host format (auto, fp8_e4m3, int4; "
                                "slo_class 'all' when every class rotates at one precision)",
                                ["slo_class", "dtype"], multiprocess_mode="livesum")
        self.host_blocks_total = Gauge("superinfer_host_pool_blocks_total", "Host rotary blocks",
                                       multiprocess_mode="livesum")
        self.slo_requests = Counter("superinfer_slo_requests",
                                    "Finished requests by SLO class and outcome (slo: ttft, tbt, joint = both; "
                                    "attainment = met / (met + missed))", ["slo_class", "slo", "outcome"])
        self.aborted_rotary = Counter("superinfer_aborted_rotary", "Requests aborted while rotary")
        self.kv_checks = Counter("superinfer_kv_verify", "Rotation KV byte checks (debug)", ["outcome"])
        self.duplex_steps = Counter("superinfer_duplex_steps",
                                    "Scheduling steps whose one rotation call moved KV both ways")
        self.prefills_alone = Counter("superinfer_prefills_alone",
                                      "Prefill batches run without the running requests' decode rows while "
                                      "mixed chunk is on (--mix-prefill needed)")
        self.chunk_room_rotations = Counter("superinfer_chunk_room_rotations",
                                            "Running requests rotated out so that a split prompt's next chunk "
                                            "fits the device KV pool (integration/chunk_room.py)")
        self.prefetches = Counter("superinfer_prefetches", "Rotary requests whose KV was prefetched",
                                  ["outcome"])
        self.prefetch_bytes = Counter("superinfer_prefetch_bytes",
                                      "KV bytes brought back by prefetch (a subset of rotation_bytes{in})")
        self.budget = Gauge("superinfer_rotation_budget_blocks",
                            "Rotation blocks per iteration and direction (B_xfer; auto follows the step time)",
                            multiprocess_mode="livemax")
        self.eos_share = Gauge("superinfer_eos_output_share",
                               "Share of max_new_tokens that recently finished requests which may stop at EOS "
                               "decoded (what TTFT shedding counts for a waiting one; 0 until 10 have finished)",
                               multiprocess_mode="livemax")
        self.link = Gauge("superinfer_kv_link_bytes_per_second",
                          "KV copy speed measured at startup, slower direction (0: not measured)",
                          multiprocess_mode="livemax")
        self.prefill_tokens = Counter("superinfer_prefill_tokens",
                                      "Tokens computed by prefill (extend) batches (SGLang's PrefillAdder count)")
        self.recomputed_tokens = Counter(
            "superinfer_recomputed_tokens",
            "Prefill tokens computed again: their KV had been computed and was dropped while the request ran "
            "(net of radix-cache hits), by cause: retraction (SGLang decode OOM), recompute_fallback "
            "(rotation with a full host pool), rotation (a resume's re-extended partial page)", ["cause"])
        self.released_tokens = Counter(
            "superinfer_released_tokens",
            "Prompt+output tokens of running requests whose KV was dropped (before radix-cache hits)", ["cause"])
        self.recompute_ratio = Gauge("superinfer_recompute_ratio",
                                     "Recomputed over computed prefill tokens since start (the recompute tax)",
                                     ["dp_rank"], multiprocess_mode="livemax")
        self._seen: dict[str, int] = {}
        # Headroom for routers and autoscalers (docs/deploy.md).
        self.rank = _dp_rank()
        rank = ["dp_rank"]
        self.vlt_max = Gauge("superinfer_queue_vlt_max_seconds",
                             "Largest time past its slack of any waiting or rotary request (VLT unweighted by "
                             "--vlt-alpha; 0: all within slack)",
                             rank, multiprocess_mode="livemax")
        self.waiting = Gauge("superinfer_waiting_requests", "Requests waiting for admission (RotaSched's view)",
                             rank, multiprocess_mode="livemax")
        self.at_risk = Gauge("superinfer_requests_at_risk",
                             "Waiting or rotary requests that can no longer meet their TTFT/TBT SLOs even if "
                             "served next (goodput's best-effort tier)", rank + ["state"],
                             multiprocess_mode="livemax")
        self.lost_running = Gauge("superinfer_running_requests_slo_lost",
                                  "Running requests that can no longer meet both SLOs", rank,
                                  multiprocess_mode="livemax")
        self.recent_attainment = Gauge(
            "superinfer_slo_attainment_recent",
            "SLO attainment over the last finished requests of each class (see superinfer_slo_recent_requests)",
            rank + ["slo_class", "slo"], multiprocess_mode="livemax")
        self.recent_judged = Gauge(
            "superinfer_slo_recent_requests",
            "Finished requests the recent attainment is computed over, per class and SLO",
            rank + ["slo_class", "slo"], multiprocess_mode="livemax")
        self.window = AttainmentWindow() if window is None else AttainmentWindow(window)
        self._headroom_failed = False
        self._paused = False  # inside unmetered(): finished() counts nothing
        self._refreshed_at = float("-inf")  # when the headroom gauges last refreshed
        self._refreshed_counts = (-1, -1)  # (queued, running) they were refreshed at
        for g in (self.vlt_max, self.waiting, self.lost_running):
            g.labels(self.rank).set(0)  # present from startup: "no load" is a value, not a gap
        for state in ("waiting", "rotary"):
            self.at_risk.labels(self.rank, state).set(0)
        for cause in RECOMPUTE_CAUSES:  # a zero is a value: the tax is 0 until a recompute happens
            self.recomputed_tokens.labels(cause)
        for cause in RECOMPUTE_CAUSES[:2]:
            self.released_tokens.labels(cause)
        for answer in SHORTAGE_ANSWERS:
            self.decode_shortages.labels(answer)
        self.recompute_ratio.labels(self.rank).set(0)
        # What `update` advances every step, each series' labelled child bound once (`labels` takes
        # a lock and a lookup per call): (series, stats key, the figures' count).
        self._per_step: tuple[tuple[Any, str, Callable[[StepFigures], int]], ...] = (
            *((getattr(self, name), name, attrgetter(f"stats.{name}")) for name in (
                "rotations_out", "resumes", "recompute_fallbacks", "sglang_retractions", "aborted_rotary",
                "duplex_steps", "prefills_alone", "chunk_room_rotations")),
            (self.shortage_rotations, "shortage_rotations", lambda f: f.stats.shortages.get(SHORTAGE_ROTATED, 0)),
            *((self.decode_shortages.labels(answer), f"shortages_{answer}",
               lambda f, a=answer: f.stats.shortages.get(a, 0)) for answer in SHORTAGE_ANSWERS),
            (self.prefetches.labels("started"), "prefetch_started", attrgetter("stats.prefetches")),
            (self.prefetches.labels("hit"), "prefetch_hit", attrgetter("stats.prefetch_hits")),
            (self.prefetches.labels("cancelled"), "prefetch_cancelled", attrgetter("stats.prefetch_cancelled")),
            (self.kv_checks.labels("identical"), "kv_ok", attrgetter("stats.kv_verified")),
            (self.kv_checks.labels("changed"), "kv_bad", attrgetter("stats.kv_mismatches")),
            (self.kv_checks.labels("unverified"), "kv_skip", attrgetter("stats.kv_unverified")))
        self._per_step_bytes: tuple[tuple[Any, str, Callable[[KvBytes], int]], ...] = ()  # with rotation on
        self._gauge_values: dict[Any, float] = {}  # a gauge's last value: set again only when it moves

    def update(self, fig: StepFigures) -> None:
        """Advance counters by what changed since the last call (stats are plain ints)."""
        for counter, key, count in self._per_step:
            self._advance(counter, key, count(fig))
        kv = fig.kv_bytes
        if kv is not None:
            if not self._per_step_bytes:  # (without rotation these series stay absent)
                self._per_step_bytes = (
                    (self.bytes_moved.labels("out"), "bytes_out", attrgetter("out")),
                    (self.bytes_moved.labels("eager_out"), "bytes_eager_out", attrgetter("eager_out")),
                    (self.bytes_moved.labels("in"), "bytes_in", attrgetter("into")),
                    (self.prefetch_bytes, "bytes_prefetched", attrgetter("prefetched")))
            for counter, key, count in self._per_step_bytes:
                self._advance(counter, key, count(kv))
        self._set(self.budget, fig.budget)
        self._set(self.link, fig.link_bytes_per_s or 0.0)
        self._set(self.eos_share, fig.goodput.eos_output_share)
        self._set(self.rotary_requests, fig.rotary)
        self._set(self.host_blocks_used, fig.host_blocks_used)
        self._set(self.host_blocks_total, fig.host_blocks_total)
        for cls, fmt, nbytes in fig.host_bytes:
            self._set(self.host_bytes.labels(cls, fmt), nbytes)
        try:
            self._update_headroom(fig)
        except Exception:  # observability must never take the scheduler down; say so once
            if not self._headroom_failed:
                logger.exception("superinfer: headroom gauges not updated")
            self._headroom_failed = True

    def _update_headroom(self, fig: StepFigures) -> None:
        now = time.monotonic()
        counts = (fig.queued, fig.running)
        if now - self._refreshed_at < HEADROOM_INTERVAL_S and (
                counts == self._refreshed_counts or  # nothing came or went: the interval
                min(fig.queued, self._refreshed_counts[0]) > HEADROOM_EVERY_STEP):  # a backlog stays
            return
        self._refreshed_at, self._refreshed_counts = now, counts
        h = headroom(fig.queue_views(), now, fig.vlt, fig.goodput)
        self.vlt_max.labels(self.rank).set(h.vlt_max_s)
        self.waiting.labels(self.rank).set(h.waiting)
        self.at_risk.labels(self.rank, "waiting").set(h.at_risk_waiting)
        self.at_risk.labels(self.rank, "rotary").set(h.at_risk_rotary)
        self.lost_running.labels(self.rank).set(h.lost_running)

    def publish_recompute(self, tally: RecomputeTally) -> None:
        """Advance the recompute series to the tally's counts."""
        self._advance(self.prefill_tokens, "prefill_tokens", tally.prefill_tokens)
        for cause, n in tally.recomputed.items():
            self._advance(self.recomputed_tokens.labels(cause), f"recomputed_{cause}", n)
        for cause, n in tally.released_tokens.items():
            self._advance(self.released_tokens.labels(cause), f"released_{cause}", n)
        self.recompute_ratio.labels(self.rank).set(tally.ratio)

    @contextlib.contextmanager
    def unmetered(self) -> Iterator[None]:
        """Requests finished inside this block count in no SLO series (see `metered`)."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def finished(self, slo_class: str | None, ttft_met: bool | None, tbt_met: bool | None) -> None:
        if self._paused:
            return
        cls = slo_class or "default"
        joint = None if ttft_met is None or tbt_met is None else ttft_met and tbt_met
        for slo, met in (("ttft", ttft_met), ("tbt", tbt_met), ("joint", joint)):
            if met is not None:
                self.slo_requests.labels(cls, slo, "met" if met else "missed").inc()
        self.window.add(slo_class, ttft_met, tbt_met)
        for (c, slo), (met_n, judged) in self.window.attainment().items():
            self.recent_attainment.labels(self.rank, c, slo).set(met_n / judged)
            self.recent_judged.labels(self.rank, c, slo).set(judged)

    def _set(self, gauge: Any, value: float) -> None:
        if self._gauge_values.get(gauge) != value:
            gauge.set(value)
            self._gauge_values[gauge] = value

    def _advance(self, counter: Any, key: str, value: int) -> None:
        delta = value - self._seen.get(key, 0)
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = value


def bind_registry(metric_cls: Any, registry: Any) -> Any:
    def make(*args: Any, **kw: Any) -> Any:
        return metric_cls(*args, registry=registry, **kw)

    return make
