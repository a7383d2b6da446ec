"""Live /metrics of the rota_server: the headroom gauges move under load and settle when idle, and
every series the Grafana dashboard (deploy/grafana/superinfer.json) reads is exported."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import requests

import grafana_dashboard as gd
from serverutil import Server, generate

pytestmark = pytest.mark.e2e
RANK = '{dp_rank="0"}'


def _gauge(m: dict[str, float], name: str, **labels: str) -> float:
    """Sum of a gauge over the series whose labels include `labels`."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in m.items() if k.split("{")[0] == name and all(w in k for w in want))


def test_headroom_gauges_under_load_and_idle(rota_server: Server) -> None:
    # 12 concurrent requests whose 1 ms TTFT SLO no one can meet: while they queue, the largest
    # VLT is positive and the waiting ones are at risk; once done, the recent TTFT attainment of
    # their class has their misses in it.
    params = {"custom_params": {"slo_class": "batch", "ttft_slo_ms": 1}}
    seen_vlt, seen_risk, seen_waiting = 0.0, 0.0, 0.0
    with cf.ThreadPoolExecutor(12) as pool:
        # ~90-token prompts through 64-token chunks: requests stay queued for tens of steps, so the
        # polls below see the queue (with 10-token prompts it drained between two polls).
        story = "once upon a time, in a land far away, there lived a curious fox; " * 6
        futs = [pool.submit(generate, rota_server, f"Story number {i}: {story}", 48,
                            sampling_params=params) for i in range(12)]
        while not all(f.done() for f in futs):
            m = rota_server.metrics()
            seen_vlt = max(seen_vlt, _gauge(m, "superinfer_queue_vlt_max_seconds"))
            seen_risk = max(seen_risk, _gauge(m, "superinfer_requests_at_risk"))
            seen_waiting = max(seen_waiting, _gauge(m, "superinfer_waiting_requests"))
            time.sleep(0.1)
        results = [f.result() for f in futs]
    assert all(r["meta_info"]["superinfer"]["superinfer_ttft_slo_met"] is False for r in results)
    assert seen_waiting > 0 and seen_vlt > 0 and seen_risk > 0, (seen_waiting, seen_vlt, seen_risk)
    generate(rota_server, "Idle check:", max_new_tokens=2)  # one more scheduler turn, alone
    deadline = time.time() + 30
    while True:
        m = rota_server.metrics()
        idle = [_gauge(m, n) for n in ("superinfer_waiting_requests", "superinfer_requests_at_risk",
                                       "superinfer_queue_vlt_max_seconds")]
        if idle == [0, 0, 0] or time.time() > deadline:
            break
        time.sleep(0.5)
    assert idle == [0, 0, 0], f"headroom gauges did not settle when idle: {idle}"
    att = _gauge(m, "superinfer_slo_attainment_recent", slo_class="batch", slo="ttft")
    judged = _gauge(m, "superinfer_slo_recent_requests", slo_class="batch", slo="ttft")
    assert judged >= 12 and att <= 1 - 12 / judged + 1e-9, (att, judged)


def test_every_dashboard_series_is_exported(rota_server: Server) -> None:
    generate(rota_server, "Fill the per-class series:", max_new_tokens=4,
             sampling_params={"custom_params": {"slo_class": "interactive"}})
    text = requests.get(rota_server.url + "/metrics", timeout=30).text
    # the prefix cache's series exist with --prefix-cache predictive only (test_prefix_host_e2e checks those)
    missing = {n for n in gd.metric_names(gd.load()) if not n.startswith(gd.PREFIX_CACHE)} - gd.exported_names(text)
    assert not missing, f"dashboard series not in /metrics: {sorted(missing)}"


def test_requests_that_stop_at_eos_teach_the_output_share(rota_server: Server) -> None:
    """Requests that may stop at EOS (ignore_eos off) feed the share TTFT shedding counts for
    waiting ones of unknown length (rotasched.output_share), through SGLang's real finished
    requests; it is published as superinfer_eos_output_share."""
    from superinfer_sgl.rotasched.output_share import MIN_FINISHED

    outs = []
    for i in range(MIN_FINISHED):
        r = generate(rota_server, f"Answer in one word. What colour is the sky? ({i})", max_new_tokens=96,
                     sampling_params={"ignore_eos": False})
        outs.append(r["meta_info"]["completion_tokens"])
    generate(rota_server, "One more scheduler turn:", max_new_tokens=2)  # the gauges update at a step
    share = _gauge(rota_server.metrics(), "superinfer_eos_output_share")
    assert 0 < share <= 1, (share, outs)
    if all(n < 96 for n in outs):  # every one stopped at EOS: the share is below 1
        assert share < 1, (share, outs)
