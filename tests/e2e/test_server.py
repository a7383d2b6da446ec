"""The server on the real default model: clients, SLO validation, and greedy equality with stock."""

from __future__ import annotations

import concurrent.futures as cf

import openai
import pytest
import requests

from serverutil import Server, generate

pytestmark = pytest.mark.e2e

SYSTEM = "You are a helpful assistant that answers briefly and precisely. "
PROMPTS = [
    SYSTEM + "Name three colours of the rainbow.",
    SYSTEM + "What is two plus two?",
    SYSTEM + "Describe a cat in one sentence.",
    "The quick brown fox jumps over the lazy dog. " * 12 + "Summarise this text.",  # > 1 chunk
    SYSTEM + "Write a haiku about the sea.",
    "List the planets of the solar system in order from the sun:",
    SYSTEM + "Describe a cat in one sentence, then a dog.",  # shares a long prefix with #3
    "Once upon a time, in a small village by the mountains,",
]


def _ids(resp: dict) -> list[int]:
    return list(resp["output_ids"])


@pytest.fixture(scope="module")
def stock_alone(stock_sched_server: Server) -> dict[str, list[int]]:
    """SGLang's own scheduling, each request served alone: the reference token ids."""
    return {p: _ids(generate(stock_sched_server, p, max_new_tokens=32)) for p in PROMPTS}


def test_chat_completion_answers_paris(rota_server: Server) -> None:
    client = openai.OpenAI(base_url=rota_server.url + "/v1", api_key="none")
    out = client.chat.completions.create(
        model="default", temperature=0, max_tokens=32,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert "Paris" in out.choices[0].message.content


def test_openai_completions_with_slo_extra_body(rota_server: Server) -> None:
    client = openai.OpenAI(base_url=rota_server.url + "/v1", api_key="none")
    out = client.completions.create(
        model="default", prompt="The capital of France is", temperature=0, max_tokens=8,
        extra_body={"custom_params": {"slo_class": "interactive", "tbt_slo_ms": 80}},
    )
    assert out.choices[0].text.strip()
    with pytest.raises(openai.BadRequestError, match="ttft_slo_ms"):
        client.completions.create(model="default", prompt="x", max_tokens=2,
                                  extra_body={"custom_params": {"ttft_slo_ms": -1}})


@pytest.mark.parametrize("params, field", [
    ({"ttft_slo_ms": -5}, "ttft_slo_ms"),
    ({"tbt_slo_ms": 0}, "tbt_slo_ms"),
    ({"ttft_slo_ms": "soon"}, "ttft_slo_ms"),
    ({"slo_class": "platinum"}, "slo_class"),
])
def test_generate_rejects_bad_slo_with_400(rota_server: Server, params: dict, field: str) -> None:
    r = requests.post(rota_server.url + "/generate", timeout=60, json={
        "text": "hi", "sampling_params": {"max_new_tokens": 2, "custom_params": params}})
    assert r.status_code == 400, r.text
    assert field in r.text
    ok = generate(rota_server, "Still serving?", max_new_tokens=2)  # everyone else keeps being served
    assert len(ok["output_ids"]) == 2


def test_generate_meta_info_reports_slo_and_rotations(rota_server: Server) -> None:
    resp = generate(rota_server, "Count to ten:", max_new_tokens=12,
                    sampling_params={"custom_params": {"slo_class": "batch", "foreign_key": 1}})
    meta = resp["meta_info"]["superinfer"]
    assert meta["superinfer_slo_class"] == "batch"
    assert meta["superinfer_ttft_slo_ms"] == 30000.0 and meta["superinfer_tbt_slo_ms"] == 500.0
    assert isinstance(meta["superinfer_rotations"], int)
    assert meta["superinfer_ttft_slo_met"] in (True, False)


def test_frontend_program(rota_server: Server) -> None:
    import sglang as sgl

    @sgl.function
    def capital(s, country):  # type: ignore[no-untyped-def]
        s += f"The capital of {country} is"
        s += sgl.gen("answer", max_tokens=6, temperature=0)

    backend = sgl.RuntimeEndpoint(rota_server.url)
    state = capital.run(country="France", backend=backend)
    assert "Paris" in state["answer"]


def _concurrent(server: Server) -> dict[str, dict]:
    with cf.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(lambda p: generate(server, p, max_new_tokens=32), PROMPTS))
    return dict(zip(PROMPTS, results))


def test_stock_scheduling_concurrent_equals_alone(stock_sched_server: Server,
                                                   stock_alone: dict[str, list[int]]) -> None:
    got = _concurrent(stock_sched_server)
    assert {p: _ids(r) for p, r in got.items()} == stock_alone


@pytest.mark.parametrize("fixture", ["rota_server", "rota_server_no_overlap"])
def test_rotated_requests_equal_stock_alone(request: pytest.FixtureRequest, fixture: str,
                                            stock_alone: dict[str, list[int]]) -> None:
    server: Server = request.getfixturevalue(fixture)
    before = server.metrics()
    got = _concurrent(server)
    after = server.metrics()
    rotated = sum(r["meta_info"]["superinfer"]["superinfer_rotations"] for r in got.values())
    assert rotated > 0, "the test knob should have forced rotations"
    assert after["superinfer_rotations_out_total"] > before.get("superinfer_rotations_out_total", 0)
    assert after["superinfer_resumes_total"] > before.get("superinfer_resumes_total", 0)
    mismatched = [p for p, r in got.items() if _ids(r) != stock_alone[p]]
    assert not mismatched, f"{len(mismatched)} of {len(PROMPTS)} outputs changed by rotation"
    def delta(key: str) -> float:
        return after.get(key, 0) - before.get(key, 0)
    if fixture == "rota_server":  # --eager-sync: filled blocks went to host ahead of time, rotations moved tails
        assert delta('superinfer_rotation_bytes_total{direction="eager_out"}') > 0
        assert delta('superinfer_rotation_bytes_total{direction="out"}') < delta('superinfer_rotation_bytes_total{direction="in"}')
    else:  # the CPU default: no eager copies, rotations move whole requests
        assert delta('superinfer_rotation_bytes_total{direction="eager_out"}') == 0
    # Prefetch: every prefetch ends as a hit (resumed into its slots) or a cancel (slots freed).
    started = delta('superinfer_prefetches_total{outcome="started"}')
    assert started == delta('superinfer_prefetches_total{outcome="hit"}') + \
        delta('superinfer_prefetches_total{outcome="cancelled"}')
    if fixture == "rota_server_no_overlap":  # held rotary requests are prefetched a step early
        assert delta('superinfer_prefetches_total{outcome="hit"}') > 0
        # --mix-prefill needed: some prefills ran alone beside running requests, outputs unchanged
        assert delta("superinfer_prefills_alone_total") > 0
    else:
        assert delta("superinfer_prefills_alone_total") == 0  # the default mixes every prefill
    # KV bytes hashed at rotate-out equal the bytes the request reads after resuming.
    assert delta('superinfer_kv_verify_total{outcome="identical"}') > 0
    # Lossless: every re-admitted request reads exactly the bytes it saved (a tree prefix recomputed
    # by another request with other bits is not substituted: rotation.insert_restored).
    assert delta('superinfer_kv_verify_total{outcome="changed"}') == 0



# Sampling state that SGLang keeps per batch row, not per request: penalty counts over the outputs
# so far and the min_new_tokens count (integration/penalty_rows.py). A resumed request joins a new
# batch: its row must carry what it had produced before it was paused, or its next tokens differ
# from the request served alone. Each group runs on its own, so that the forced rotations (the
# first rotatable request in batch order) fall on its requests.
PENALTIES = [
    {"frequency_penalty": 1.5},
    {"presence_penalty": 1.5},
    {"repetition_penalty": 1.8},
    {"min_new_tokens": 24, "ignore_eos": False},
]


LOOPS = [("rota_server", "stock_sched_server"), ("rota_server_no_overlap", "stock_sched_server_no_overlap")]


@pytest.mark.parametrize("fixture,reference", LOOPS)
@pytest.mark.parametrize("params", PENALTIES, ids=lambda p: next(iter(p)))
def test_rotated_requests_keep_their_penalty_state(request: pytest.FixtureRequest, fixture: str,
                                                   reference: str, params: dict) -> None:
    server: Server = request.getfixturevalue(fixture)
    stock: Server = request.getfixturevalue(reference)  # the same scheduler loop, SGLang's scheduling

    def run(srv: Server, prompt: str) -> dict:
        return generate(srv, prompt, max_new_tokens=32, sampling_params=dict(params))

    prompts = PROMPTS[:4]
    alone = [_ids(run(stock, p)) for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: run(server, p), prompts))
    assert sum(r["meta_info"]["superinfer"]["superinfer_rotations"] for r in got) > 0
    mismatched = [p[:30] for p, r, a in zip(prompts, got, alone) if _ids(r) != a]
    assert not mismatched, f"{len(mismatched)} of {len(prompts)} outputs changed by rotation: {mismatched}"


def test_rotated_requests_return_their_logprobs(rota_server: Server, stock_sched_server: Server) -> None:
    """Logprobs live on the request, not the batch: a rotated request returns as many input and
    output logprobs as served alone, for the same tokens, equal up to batch numerics."""
    extra = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}
    prompts = PROMPTS[:4]
    alone = [generate(stock_sched_server, p, max_new_tokens=32, **extra)["meta_info"] for p in prompts]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda p: generate(rota_server, p, max_new_tokens=32, **extra), prompts))
    assert sum(r["meta_info"]["superinfer"]["superinfer_rotations"] for r in got) > 0
    for a, g in zip(alone, (r["meta_info"] for r in got)):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert [t[1] for t in g[key]] == [t[1] for t in a[key]], key  # (logprob, token id, text)
            assert all(abs((x[0] or 0.0) - (y[0] or 0.0)) < 1e-3 for x, y in zip(g[key], a[key])), key
        assert len(g["output_top_logprobs"]) == len(a["output_top_logprobs"])
