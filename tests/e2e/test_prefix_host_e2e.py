"""The prefix host tier in a live server (--prefix-cache predictive --prefix-host-tokens): a shared
prompt is pushed out of a small KV pool by one-off prompts, demoted to host instead of dropped, and
a later request with it gets it back: SGLang reports it as cached, and greedy decoding gives the
same tokens as the first time (its KV came back byte-identical)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serverutil import start_server  # noqa: E402

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
