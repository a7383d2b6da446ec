"""Aborts in every state release device pages and host blocks; pools return to zero."""

from __future__ import annotations

import threading
import time

import pytest
import requests

from serverutil import Server

pytestmark = pytest.mark.e2e


def _stream(server: Server, i: int, stop: threading.Event) -> None:
    body = {"text": f"Tell me a long story number {i}.", "stream": True,
            "sampling_params": {"temperature": 0, "max_new_tokens": 600, "ignore_eos": True}}
    try:
        with requests.post(server.url + "/generate", json=body, stream=True, timeout=300) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return  # closing the connection: SGLang aborts the request
    except requests.RequestException:
        pass


def _wait_idle(server: Server, timeout: float = 60) -> dict[str, float]:
    deadline = time.time() + timeout
    m: dict[str, float] = {}
    while time.time() < deadline:
        m = server.metrics()
        if m.get("superinfer_rotary_requests", 1) == 0 and m.get("superinfer_host_pool_blocks_used", 1) == 0:
            if server.sglang_gauge("num_running_reqs") == 0 and server.sglang_gauge("num_queue_reqs") == 0:
                return m
        time.sleep(1)
    return m


def test_abort_rotary_requests_releases_everything(rota_server_no_overlap: Server) -> None:
    server = rota_server_no_overlap
    start = server.metrics().get("superinfer_aborted_rotary_total", 0)
    for attempt in range(6):
        stop = threading.Event()
        threads = [threading.Thread(target=_stream, args=(server, 10 * attempt + i, stop)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(4 + attempt)  # rotated requests stay rotary >= 6 iterations (test knob)
        if attempt % 2:
            requests.post(server.url + "/abort_request", json={"rid": "", "abort_all": True}, timeout=30)
        stop.set()  # even attempts: client disconnect
        for t in threads:
            t.join(120)
        m = _wait_idle(server)
        assert m.get("superinfer_rotary_requests") == 0, m
        assert m.get("superinfer_host_pool_blocks_used") == 0, m
        if m.get("superinfer_aborted_rotary_total", 0) > start:
            break
    assert server.metrics().get("superinfer_aborted_rotary_total", 0) > start, \
        "no abort hit a rotary request in 6 attempts"
    # SGLang's own idle leak check runs on an idle scheduler and would have crashed the server on
    # any leaked device page; the server still answers.
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
