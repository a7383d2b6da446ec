"""The prefix host tier in a live server (--prefix-cache predictive --prefix-host-tokens): a shared
prompt is pushed out of a small KV pool by one-off prompts, demoted to host instead of dropped, and
a later request with it gets it back: SGLang reports it as cached, and greedy decoding gives the
same tokens as the first time (its KV came back byte-identical).

Then the product as shipped: our default scheduler (RotaSched) with the same cache, rotations
forced every 2 iterations with rotation's KV byte check on (SUPERINFER_TEST_ROTATE_INTERVAL,
SUPERINFER_VERIFY_ROTATION), float32: a concurrent load around a demoted shared prompt gives each
request the tokens it got alone, every rotation's KV comes back identical, the prompt comes back
from host (the superinfer_prefix_* series count it), and nothing is left rotary or running."""

from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grafana_dashboard as gd  # noqa: E402
from serverutil import Server, start_server  # noqa: E402

pytestmark = pytest.mark.e2e

SYSTEM = [1000 + (7 * i) % 4000 for i in range(160)]  # a 160-token shared prompt (token ids)


def _generate(url: str, ids: list[int], n: int = 4) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0}}
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def test_a_demoted_prompt_comes_back_cached_and_decodes_the_same(tmp_path: Path, model_dir: Path) -> None:
    server = start_server(["--scheduler", "sglang", "--prefix-cache", "predictive", "--prefix-host-tokens", "512",
                           "--max-total-tokens", "512", "--chunked-prefill-size", "256"], tmp_path / "server.log")
    try:
        tail = [4500, 4501, 4502, 4503]
        first = _generate(server.url, SYSTEM + tail)
        again = _generate(server.url, SYSTEM + [4600, 4601])  # a hit: the prompt's history says "shared"
        assert again["meta_info"]["cached_tokens"] >= len(SYSTEM)
        for j in range(4):  # one-off prompts that need the whole pool between them
            _generate(server.url, [5000 + 300 * j + k for k in range(200)])
        back = _generate(server.url, SYSTEM + tail)
        log = server.log()
    finally:
        assert not server.stop()
    assert "prefix host tier" in log and "Traceback" not in log
    assert back["meta_info"]["cached_tokens"] >= len(SYSTEM), back["meta_info"]  # restored from host
    assert back["text"] == first["text"] and back.get("output_ids") == first.get("output_ids")


ROTATION_ENV = {"SUPERINFER_TEST_ROTATE_INTERVAL": "2", "SUPERINFER_VERIFY_ROTATION": "1"}
RESTORED = 'superinfer_prefix_host_copied_tokens_total{direction="restored"}'
DEMOTED = 'superinfer_prefix_host_copied_tokens_total{direction="demoted"}'


def _idle(server: Server, timeout: float = 60) -> dict[str, float]:
    deadline = time.time() + timeout
    while True:
        m = server.metrics()
        busy = server.sglang_gauge("num_running_reqs") + server.sglang_gauge("num_queue_reqs")
        if (m.get("superinfer_rotary_requests", 1) == 0 and m.get("superinfer_host_pool_blocks_used", 1) == 0
                and busy == 0) or time.time() > deadline:
            return m
        time.sleep(1)


def test_rotations_beside_the_host_tier_stay_exact(tmp_path: Path, model_dir: Path) -> None:
    server = start_server(["--dtype", "float32", "--prefix-cache", "predictive", "--prefix-host-tokens", "512",
                           "--max-total-tokens", "512", "--chunked-prefill-size", "64", "--enable-metrics",
                           "--rotary-pool-gb", "0.05"], tmp_path / "server.log", env=ROTATION_ENV)
    # two requests share the prompt: it is hit once, which marks it for demotion while the predictor
    # has seen no gap between hits (its cold start: a never-hit one-off is not demoted, so the
    # one-offs cannot push the prompt off the host; a third would show a gap and end the cold start)
    shared = [SYSTEM + [4500 + 10 * i + k for k in range(4)] for i in range(2)]
    one_off = [[5000 + 300 * j + k for k in range(200)] for j in range(4)]
    try:
        start = server.metrics()
        alone = [_generate(server.url, ids, n=12) for ids in shared]  # the shared prompt is hit
        alone += [_generate(server.url, ids, n=12) for ids in one_off]  # and pushed out
        before = server.metrics()
        load = shared + one_off[:2]
        with ThreadPoolExecutor(len(load)) as pool:
            got = list(pool.map(lambda ids: _generate(server.url, ids, n=12), load))
        after = _idle(server)
        running = server.sglang_gauge("num_running_reqs") + server.sglang_gauge("num_queue_reqs")
        exported = gd.exported_names(requests.get(server.url + "/metrics", timeout=30).text)
        log = server.log()
    finally:
        assert not server.stop()
    assert "prefix host tier" in log and "Traceback" not in log

    def delta(key: str, since: dict[str, float]) -> float:
        return after.get(key, 0) - since.get(key, 0)

    assert delta(DEMOTED, start) >= len(SYSTEM), "the shared prompt was not demoted"
    assert delta(RESTORED, before) >= len(SYSTEM), "the shared prompt did not come back from host"
    rotated = sum(r["meta_info"]["superinfer"]["superinfer_rotations"] for r in got)
    assert rotated > 0 and delta("superinfer_resumes_total", before) > 0, "no rotation was forced"
    assert delta('superinfer_kv_verify_total{outcome="identical"}', before) > 0
    assert delta('superinfer_kv_verify_total{outcome="changed"}', before) == 0
    changed = [i for i, r in enumerate(got) if (r["text"], r.get("output_ids")) != (alone[i]["text"],
                                                                                   alone[i].get("output_ids"))]
    assert not changed, f"requests {changed} of {len(load)} decoded differently beside rotations and restores"
    assert after.get("superinfer_rotary_requests") == 0 and after.get("superinfer_host_pool_blocks_used") == 0
    assert running == 0
    assert 0 <= after["superinfer_prefix_host_tokens_used"] <= after["superinfer_prefix_host_tokens_total"]
    missing = {n for n in gd.metric_names(gd.load()) if n.startswith(gd.PREFIX_CACHE)} - exported
    assert not missing, f"the dashboard's prefix-cache series not in /metrics: {sorted(missing)}"
