"""Which scheduler processes export the superinfer_ series: SGLang's own rule for its series, the
first scheduler of each attention TP / CP group, or every one with
--enable-metrics-for-all-schedulers. TP ranks take the same decisions, so counters and livesum
gauges written by all of them would read N times the truth. (Its own module: the metrics modules
of the runtime, the copy engine and the prefix cache all ask it.)"""

from __future__ import annotations


def is_metrics_rank() -> bool:
    """Does this scheduler process export? (Outside a server: yes, e.g. the unit tests' registry.)
    With --enable-metrics-for-all-schedulers every rank does, and sums over TP ranks are N-fold,
    as SGLang's own series are then."""
    try:
        from sglang.srt.runtime_context import get_observability, get_parallel

        if get_observability().enable_metrics_for_all_schedulers:
            return True
        par = get_parallel()
        return int(par.attn_tp_rank) == 0 and int(getattr(par, "attn_cp_rank", 0) or 0) == 0
    except Exception:  # no runtime context: not inside a server
        return True
