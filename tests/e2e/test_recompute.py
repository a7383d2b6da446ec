"""The recompute tax on a live server: SGLang's test switch forces a decode retraction every few
iterations (SGLANG_TEST_RETRACT), so retracted requests are re-admitted and prefilled again. Our
counters must move, agree with SGLang's own token counters (the figure the A/B reads for stock),
and the released tokens must equal SGLang's retracted prompt + output tokens
(`--decode-shortage retract`: SGLang's retraction alone).

With `--decode-shortage rotate` (the default) the same forced shortages are answered by rotation
(integration/decode_shortage.py): nothing is retracted or recomputed by retraction, the rotated
requests' KV bytes come back identical, and greedy float32 outputs equal each request served alone."""

from __future__ import annotations

import concurrent.futures
import sys
from pathlib import Path

import pytest
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serverutil import start_server  # noqa: E402

from superinfer_sgl.bench import recompute  # noqa: E402

pytestmark = pytest.mark.e2e


def _generate(url: str, i: int) -> dict:
    body = {"text": f"[request {i}] " + "The quick brown fox jumps over the lazy dog. " * 8,
            "sampling_params": {"max_new_tokens": 24, "ignore_eos": True, "temperature": 0}}
    r = requests.post(url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def test_forced_retractions_move_the_recompute_counters(tmp_path, model_dir):
    server = start_server(["--max-total-tokens", "2048", "--chunked-prefill-size", "256", "--enable-metrics",
                           "--decode-shortage", "retract"],
                          tmp_path / "server.log", env={"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "5"})
    try:
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda i: _generate(server.url, i), range(4)))
        assert all(o["meta_info"]["completion_tokens"] == 24 for o in outs)
        text = requests.get(server.url + "/metrics", timeout=30).text
    finally:
        assert not server.stop()
    sg = recompute.labelled(text)
    ours = server_metrics(text)
    retracted = ours.get('superinfer_released_tokens_total{cause="retraction"}', 0.0)
    assert retracted > 0, "SGLANG_TEST_RETRACT retracted nothing"
    assert retracted == sg["recompute:retracted_input_tokens"] + sg["recompute:retracted_output_tokens"]
    recomputed = sum(v for k, v in ours.items() if k.startswith("superinfer_recomputed_tokens_total"))
    assert ours['superinfer_recomputed_tokens_total{cause="retraction"}'] > 0
    # the same rule as SGLang's own counters (what the A/B reads for stock SGLang)
    assert ours["superinfer_prefill_tokens_total"] == sg["recompute:prefill_tokens"]
    assert recomputed == sg["recompute:prefill_tokens"] - sg["recompute:first_pass_tokens"]
    assert 0 < ours['superinfer_recompute_ratio{dp_rank="0"}'] < 1


def test_forced_decode_shortages_are_rotations_and_outputs_stay_exact(tmp_path, model_dir):
    server = start_server(["--dtype", "float32", "--max-total-tokens", "2048", "--chunked-prefill-size", "256",
                           "--enable-metrics"], tmp_path / "server.log",
                          env={"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "5",
                               "SUPERINFER_VERIFY_ROTATION": "1"})
    try:
        alone = [_generate(server.url, i) for i in range(4)]  # a batch of one: nothing to take
        before = server.metrics()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda i: _generate(server.url, i), range(4)))
        after = server.metrics()
    finally:
        assert not server.stop()

    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("superinfer_decode_shortage_rotations_total") > 0, "SGLANG_TEST_RETRACT rotated nothing"
    assert delta('superinfer_decode_shortages_total{answer="rotation"}') > 0
    assert delta("superinfer_sglang_retractions_total") == 0
    assert delta('superinfer_recomputed_tokens_total{cause="retraction"}') == 0
    assert delta('superinfer_kv_verify_total{outcome="identical"}') > 0
    assert delta('superinfer_kv_verify_total{outcome="changed"}') == 0
    assert sum(o["meta_info"]["superinfer"]["superinfer_rotations"] for o in together) > 0
    assert [o["output_ids"] for o in together] == [o["output_ids"] for o in alone]


def server_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("superinfer_"):
            key, value = line.rsplit(" ", 1)
            out[key] = out.get(key, 0.0) + float(value)
    return out
