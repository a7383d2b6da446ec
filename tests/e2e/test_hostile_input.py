"""Hostile input on every endpoint we change (issue 17): malformed and extreme requests to
`/generate`, `/v1/chat/completions` and `/v1/completions`, in the SLO fields, the SLO headers and
the request itself. Each gets a 4xx whose body names the problem, and after every one the server
still answers a normal request. A hypothesis property test throws generated SLO values at the
server: the answer is a 200 with the SLO the library resolves, or a 400 naming a field the
request sent, never a 5xx or a hang."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fuzzutil
from serverutil import Server, start_server
from superinfer_sgl.rotasched.slo import MAX_SLO_MS, Slo, SloClasses, SloError
from superinfer_sgl.rotasched.slo_conventions import SloConventions, resolve_request_slo

pytestmark = pytest.mark.e2e

CLASSES = {"gold": {"ttft_ms": 800, "tbt_ms": 40, "weight": 2}, "bulk": {"ttft_ms": 60000, "tbt_ms": 1000}}
PRIORITY_CLASSES = {"0": "bulk", "10": "gold"}
DEFAULT = Slo(5000, 100)
# A small KV pool (1018 input tokens at most) under the model's 8192-token context, so an oversized
# prompt can be too long for the pool alone or for the context too.
ARGS = ["--max-total-tokens", "1024", "--log-level", "info", "--slo-classes", json.dumps(CLASSES),
        "--slo-priority-classes", json.dumps(PRIORITY_CLASSES), "--enable-metrics",
        "--enable-custom-logit-processor"]
TIMEOUT = 60  # seconds: a request that takes longer is a hang here (2-token answers)

G, CHAT, COMP = "/generate", "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(ARGS, tmp_path_factory.mktemp("logs") / "hostile.log")
    # Before any test's request: only the warm-up and start_server's /health have run.
    srv.startup_slo_series = srv.metrics("superinfer_slo_")  # type: ignore[attr-defined]
    try:
        yield srv
    finally:
        left = srv.stop()
        assert not left, f"processes left after shutdown: {left}"


def _gen(custom: object = None, **top: object) -> bytes:
    sampling: dict[str, object] = {"max_new_tokens": 2, "temperature": 0}
    if custom is not None:
        sampling["custom_params"] = custom
    return json.dumps({"text": "hi", "sampling_params": sampling, **top}).encode()


def _chat(**top: object) -> bytes:
    return json.dumps({"model": "default", "max_tokens": 2, "temperature": 0,
                       "messages": [{"role": "user", "content": "hi"}], **top}).encode()


def _comp(**top: object) -> bytes:
    return json.dumps({"model": "default", "max_tokens": 2, "temperature": 0, "prompt": "hi", **top}).encode()


def _raw(body: dict) -> bytes:
    return json.dumps(body).encode()


LONG = "hello " * 3000  # ~3000 tokens: over the 1018-token pool limit, under the context
HUGE = "hello " * 9000  # over the 8192-token context
NINES = "9" * 400  # an integer literal past the float range


def _unimportable_processor() -> str:
    """A custom logit processor as a client whose own module defines it would send one: the
    server cannot import that module (ModuleNotFoundError where it is unpickled)."""
    import dill

    module = type(sys)("client_side_processors")
    exec("class Ban:\n    def __call__(self, logits, params=None):\n        return logits\n", module.__dict__)
    module.Ban.__module__ = module.__name__
    sys.modules[module.__name__] = module  # importable while pickled (by reference), then gone
    try:
        return json.dumps({"callable": dill.dumps(module.Ban, byref=True).hex()})
    finally:
        del sys.modules[module.__name__]


PROCESSOR = _unimportable_processor()
SLO_KEYS_NAMED = "the SLO keys are slo_class, ttft_slo_ms, tbt_slo_ms"

# (id, path, headers, body bytes, substring the 4xx body must contain)
CASES: list[tuple[str, str, dict[str, str], bytes, str]] = [
    # custom_params SLO keys: wrong types, non-finite, <= 0, past the bound, unknown class
    ("gen-ttft-str", G, {}, _gen({"ttft_slo_ms": "soon"}), "ttft_slo_ms"),
    ("gen-ttft-nan-str", G, {}, _gen({"ttft_slo_ms": "NaN"}), "ttft_slo_ms"),
    ("gen-tbt-inf-str", G, {}, _gen({"tbt_slo_ms": "inf"}), "tbt_slo_ms"),
    ("gen-tbt-1e999-str", G, {}, _gen({"tbt_slo_ms": "1e999"}), "tbt_slo_ms"),
    ("gen-ttft-zero", G, {}, _gen({"ttft_slo_ms": 0}), "ttft_slo_ms"),
    ("gen-tbt-negative", G, {}, _gen({"tbt_slo_ms": -5}), "tbt_slo_ms"),
    ("gen-ttft-huge", G, {}, _gen({"ttft_slo_ms": 1e308}), "ttft_slo_ms"),
    ("gen-tbt-past-bound", G, {}, _gen({"tbt_slo_ms": MAX_SLO_MS * 10}), "at most"),
    # 1e-322 ms is 0.0 s in the scheduler: its views' assertion stopped the server
    ("gen-ttft-tiny", G, {}, _gen({"ttft_slo_ms": 1e-322}), "at least"),
    ("gen-tbt-separators", G, {}, _gen({"tbt_slo_ms": "1_000"}), "tbt_slo_ms"),
    ("gen-ttft-list", G, {}, _gen({"ttft_slo_ms": [100]}), "ttft_slo_ms"),
    ("gen-ttft-object", G, {}, _gen({"ttft_slo_ms": {"ms": 100}}), "ttft_slo_ms"),
    ("gen-tbt-bool", G, {}, _gen({"tbt_slo_ms": True}), "tbt_slo_ms"),
    ("gen-class-int", G, {}, _gen({"slo_class": 3}), "slo_class"),
    ("gen-class-unknown", G, {}, _gen({"slo_class": "interactive"}), "unknown class 'interactive'"),
    ("gen-class-empty", G, {}, _gen({"slo_class": ""}), "slo_class"),
    ("gen-custom-list", G, {}, _gen([1, 2]), "custom_params"),
    ("gen-custom-string", G, {}, _gen("gold"), "custom_params"),
    # JSON has no NaN / Infinity and no numbers past the float range: the body is refused as JSON
    ("gen-ttft-nan-literal", G, {}, b'{"text": "hi", "sampling_params": {"custom_params": {"ttft_slo_ms": NaN}}}',
     "JSON decode error"),
    ("gen-tbt-infinity-literal", G, {}, b'{"text": "hi", "sampling_params": {"custom_params": {"tbt_slo_ms": -Infinity}}}',
     "JSON decode error"),
    ("gen-ttft-bigint-literal", G, {}, b'{"text": "hi", "sampling_params": {"custom_params": {"ttft_slo_ms": '
     + NINES.encode() + b"}}}", "JSON decode error"),
    # service_tier and priority (mapped by --slo-priority-classes)
    ("gen-tier-int", G, {}, _gen(service_tier=5), "service_tier"),
    ("gen-tier-unknown", G, {}, _gen(service_tier="ultra"), "unknown service tier 'ultra'"),
    ("gen-tier-list", G, {}, _gen(service_tier=["flex"]), "service_tier"),
    ("gen-priority-string", G, {}, _gen(priority="high"), "priority"),
    ("gen-priority-float", G, {}, _gen(priority=1.5), "priority"),
    ("gen-priority-2^64", G, {}, _gen(priority=2**64), "priority"),
    # stock SGLang's /generate contract gate refuses a boolean priority without naming the field
    ("gen-priority-bool", G, {}, _gen(priority=True), "boolean `true`, expected i64"),
    # SLO headers
    ("gen-hdr-ttft-nan", G, {"x-slo-ttft-ms": "nan"}, _gen(), "x-slo-ttft-ms"),
    ("gen-hdr-ttft-zero", G, {"x-slo-ttft-ms": "0"}, _gen(), "x-slo-ttft-ms"),
    ("gen-hdr-ttft-inf", G, {"x-slo-ttft-ms": "1e999"}, _gen(), "x-slo-ttft-ms"),
    ("gen-hdr-ttft-huge", G, {"x-slo-ttft-ms": "1e12"}, _gen(), "at most"),
    ("gen-hdr-tpot-tiny", G, {"x-slo-tpot-ms": "1e-322"}, _gen(), "at least"),
    ("gen-hdr-tpot-negative", G, {"x-slo-tpot-ms": "-3"}, _gen(), "x-slo-tpot-ms"),
    ("gen-hdr-tpot-unit", G, {"x-slo-tpot-ms": "40ms"}, _gen(), "x-slo-tpot-ms"),
    ("gen-hdr-tpot-long", G, {"x-slo-tpot-ms": "1" * 4000}, _gen(), "x-slo-tpot-ms"),
    ("gen-hdr-smg-unknown", G, {"x-smg-priority": "urgent"}, _gen(), "x-smg-priority"),
    ("gen-hdr-smg-latin1", G, {"x-smg-priority": "caf\xe9"}, _gen(), "x-smg-priority"),
    # the request itself
    ("gen-oversized-pool", G, {}, _raw({"text": LONG, "sampling_params": {"max_new_tokens": 2}}),
     "exceeds the maximum allowed length"),
    ("gen-oversized-context", G, {}, _raw({"text": HUGE, "sampling_params": {"max_new_tokens": 2}}),
     "longer than the model's context length"),
    ("gen-max-new-tokens-huge", G, {}, _raw({"text": "hi", "sampling_params": {"max_new_tokens": 10**6}}),
     "maximum context length"),
    ("gen-max-new-tokens-negative", G, {}, _raw({"text": "hi", "sampling_params": {"max_new_tokens": -1}}),
     "max_new_tokens"),
    # these two crashed the whole server before integration/input_guard.py
    ("gen-empty-text", G, {}, _raw({"text": "", "sampling_params": {"max_new_tokens": 2}}), "prompt is empty"),
    ("gen-ids-out-of-vocab", G, {}, _raw({"input_ids": [1, 10**9], "sampling_params": {"max_new_tokens": 2}}),
     "token id 1000000000 is out of the vocabulary"),
    ("gen-ids-negative", G, {}, _raw({"input_ids": [-5, 3], "sampling_params": {"max_new_tokens": 2}}),
     "token id -5"),
    ("gen-ids-empty", G, {}, _raw({"input_ids": [], "sampling_params": {"max_new_tokens": 2}}), "input_ids"),
    ("gen-batch-one-bad", G, {}, _raw({"text": ["a", "b"], "sampling_params": [
        {"max_new_tokens": 2}, {"max_new_tokens": 2, "custom_params": {"slo_class": "zzz"}}]}), "slo_class"),
    ("gen-batch-one-empty", G, {}, _raw({"text": ["a", ""], "sampling_params": {"max_new_tokens": 2}}),
     "prompt is empty"),
    # SGLang repeats a batch's list unchecked: a short one failed with a 500 after the first prompt went out
    ("gen-batch-short-params", G, {}, _raw({"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}]}),
     "a batch of 2 prompts takes 2 sampling_params"),
    ("gen-n2-bad-class", G, {}, _raw({"text": "a", "sampling_params": {
        "max_new_tokens": 2, "n": 2, "custom_params": {"slo_class": "zzz"}}}), "slo_class"),
    ("gen-regex-bad", G, {}, _raw({"text": "a", "sampling_params": {"max_new_tokens": 2, "regex": "(("}}), "regex"),
    ("gen-json-schema-bad", G, {}, _raw({"text": "a", "sampling_params": {"max_new_tokens": 2,
                                                                           "json_schema": "{not json"}}), "json"),
    ("gen-text-int", G, {}, _raw({"text": 5}), "text"),
    ("gen-no-prompt", G, {}, _raw({"sampling_params": {"max_new_tokens": 2}}), "text, input_ids or input_embeds"),
    ("gen-sampling-string", G, {}, _raw({"text": "hi", "sampling_params": "fast"}), "sampling_params"),
    # bodies that are not a JSON object
    ("gen-invalid-utf8", G, {}, b'{"text": "\xff\xfe hi", "sampling_params": {"max_new_tokens": 2}}', "UTF-8"),
    ("gen-empty-body", G, {}, b"", "Field required"),
    ("gen-not-json", G, {}, b"hello there", "JSON decode error"),
    ("gen-json-null", G, {}, b"null", "GenerateReqInput"),
    ("gen-json-list", G, {}, b"[1, 2]", "GenerateReqInput"),
    ("gen-truncated-json", G, {}, b'{"text": "hi", "sampling_params": {', "JSON decode error"),
    # OpenAI chat
    ("chat-ttft-nan-str", CHAT, {}, _chat(custom_params={"ttft_slo_ms": "nan"}), "ttft_slo_ms"),
    ("chat-tbt-huge", CHAT, {}, _chat(custom_params={"tbt_slo_ms": 1e300}), "tbt_slo_ms"),
    ("chat-class-unknown", CHAT, {}, _chat(custom_params={"slo_class": "nope"}), "slo_class"),
    ("chat-custom-list", CHAT, {}, _chat(custom_params=[1]), "custom_params"),
    ("chat-tier-int", CHAT, {}, _chat(service_tier=5), "service_tier"),
    ("chat-tier-unknown", CHAT, {}, _chat(service_tier="ultra"), "service_tier"),
    ("chat-priority-string", CHAT, {}, _chat(priority="x"), "priority"),
    ("chat-hdr-tpot", CHAT, {"x-slo-tpot-ms": "fast"}, _chat(), "x-slo-tpot-ms"),
    ("chat-hdr-smg-stream", CHAT, {"x-smg-priority": "vip"}, _chat(stream=True), "x-smg-priority"),
    ("chat-oversized", CHAT, {}, _chat(messages=[{"role": "user", "content": LONG}]),
     "exceeds the maximum allowed length"),
    ("chat-invalid-utf8", CHAT, {}, b'{"model": "default", "messages": [{"role": "user", "content": "\xff"}]}',
     "UTF-8"),
    ("chat-empty-body", CHAT, {}, b"", "Field required"),
    ("chat-not-json", CHAT, {}, b"{{{", "JSON decode error"),
    ("chat-no-messages", CHAT, {}, _raw({"model": "default"}), "messages"),
    ("chat-messages-string", CHAT, {}, _raw({"model": "default", "messages": "hi"}), "messages"),
    # OpenAI completions
    ("comp-tbt-nan-str", COMP, {}, _comp(custom_params={"tbt_slo_ms": "nan"}), "tbt_slo_ms"),
    ("comp-tbt-negative", COMP, {}, _comp(custom_params={"tbt_slo_ms": -1}), "tbt_slo_ms"),
    ("comp-ttft-stream", COMP, {}, _comp(stream=True, custom_params={"ttft_slo_ms": 0}), "ttft_slo_ms"),
    ("comp-tier-object", COMP, {}, _comp(service_tier={"a": 1}), "service_tier"),
    ("comp-priority-float", COMP, {}, _comp(priority=2.5), "priority"),
    ("comp-hdr-ttft", COMP, {"x-slo-ttft-ms": "0x10"}, _comp(), "x-slo-ttft-ms"),
    ("comp-oversized", COMP, {}, _comp(prompt=LONG), "exceeds the maximum allowed length"),
    ("comp-empty-prompt", COMP, {}, _comp(prompt=""), "Prompt cannot be empty"),  # SGLang checks this one
    ("comp-ids-out-of-vocab", COMP, {}, _comp(prompt=[10**9]), "out of the vocabulary"),
    ("comp-invalid-utf8", COMP, {}, b'{"model": "default", "prompt": "\xc3\x28"}', "UTF-8"),
    ("comp-empty-body", COMP, {}, b"", "Field required"),
    ("comp-text-plain", COMP, {"content-type": "text/plain"}, b"hello", "application/json"),
    # issue 38: what real clients found. An unloadable pickled logit processor ended the scheduler.
    ("gen-logit-processor-unimportable", G, {}, _raw({"text": "hi", "custom_logit_processor": PROCESSOR,
                                                      "sampling_params": {"max_new_tokens": 2}}),
     "ModuleNotFoundError"),
    ("gen-logit-processor-not-json", G, {}, _raw({"text": "hi", "custom_logit_processor": "ban",
                                                  "sampling_params": {"max_new_tokens": 2}}), "custom_logit_processor"),
    ("gen-logit-processor-empty", G, {}, _raw({"text": "hi", "custom_logit_processor": "",
                                               "sampling_params": {"max_new_tokens": 2}}), "custom_logit_processor"),
    ("gen-batch-one-bad-processor", G, {}, _raw({"text": ["a", "b"], "custom_logit_processor": [None, PROCESSOR],
                                                 "sampling_params": {"max_new_tokens": 2}}), "ModuleNotFoundError"),
    ("chat-logit-processor-unimportable", CHAT, {}, _chat(custom_logit_processor=PROCESSOR), "ModuleNotFoundError"),
    ("comp-logit-processor-hex", COMP, {}, _comp(custom_logit_processor='{"callable": "00ff"}'),
     "custom_logit_processor"),
    # a misspelt SLO key was silently ignored (the request got the default SLO)
    ("gen-slo-key-misspelt", G, {}, _gen({"slo_clas": "gold"}), "'slo_clas': unknown SLO key; " + SLO_KEYS_NAMED),
    ("gen-slo-key-camel", G, {}, _gen({"sloClass": "gold"}), "sloClass"),
    ("chat-slo-key-class-style", CHAT, {}, _chat(custom_params={"ttft_ms": 500}), "'ttft_ms': unknown SLO key"),
    ("comp-slo-key-upper", COMP, {}, _comp(custom_params={"SLO_CLASS": "gold"}), SLO_KEYS_NAMED),
    ("comp-slo-key-header-name", COMP, {}, _comp(custom_params={"x-slo-ttft-ms": 500}), "x-slo-ttft-ms"),
    # JSON bodies that are not objects reached SGLang's OpenAI model validators: 500
    ("chat-json-array", CHAT, {}, b"[1, 2]", "must be a JSON object, got an array"),
    ("chat-json-empty-array", CHAT, {}, b"[]", "must be a JSON object, got an array"),
    ("chat-json-string", CHAT, {}, b'"hi"', "must be a JSON object, got a string"),
    ("comp-json-array", COMP, {}, b'[{"prompt": "hi"}]', "must be a JSON object, got an array"),
    ("comp-json-number", COMP, {}, b"5", "must be a JSON object, got a number"),
    # OpenAI's caps: chat top_logprobs 0..20, completions logprobs 0..5
    ("chat-top-logprobs-21", CHAT, {}, _chat(logprobs=True, top_logprobs=21), "top_logprobs must be between 0 and 20"),
    ("chat-top-logprobs-huge", CHAT, {}, _chat(logprobs=True, top_logprobs=10**6), "top_logprobs"),
    ("chat-top-logprobs-negative", CHAT, {}, _chat(logprobs=True, top_logprobs=-1), "top_logprobs"),
    ("comp-logprobs-6", COMP, {}, _comp(logprobs=6), "logprobs must be between 0 and 5"),
    ("comp-logprobs-negative", COMP, {}, _comp(logprobs=-2), "logprobs"),
    # found by schemathesis (test_schemathesis_...): malformed /generate inputs were 500s
    ("gen-input-embeds-empty", G, {}, _raw({"input_embeds": [], "sampling_params": {"max_new_tokens": 2}}),
     "malformed request"),
    ("gen-input-embeds-empty-row", G, {}, _raw({"input_embeds": [[]], "sampling_params": {"max_new_tokens": 2}}),
     "malformed request"),
    ("gen-sampling-empty-list", G, {}, _raw({"text": "hi", "sampling_params": []}), "malformed request"),
    # SGLang's /generate contract gate refuses this one itself (the guard covers the Engine API)
    ("gen-input-ids-int", G, {}, _raw({"input_ids": 5, "sampling_params": {"max_new_tokens": 2}}),
     "must be list or null; got int"),
    # found by schemathesis: a list of request ids for one prompt was hashed (TypeError, 500)
    ("comp-rid-list-one-prompt", COMP, {}, _comp(rid=["a"]), "rid: one prompt takes one request id"),
    ("gen-rid-list-one-prompt", G, {}, _raw({"text": "hi", "rid": ["a"], "sampling_params": {"max_new_tokens": 2}}),
     "rid"),
    # found by schemathesis: an empty request id stopped the scheduler (it keys requests by rid)
    ("gen-rid-empty", G, {}, _raw({"text": "hi", "rid": "", "sampling_params": {"max_new_tokens": 2}}),
     "rid: a request id must be a non-empty string"),
    ("comp-rid-empty", COMP, {}, _comp(rid=""), "rid: a request id must be a non-empty string"),
    ("chat-rid-empty", CHAT, {}, _chat(rid=""), "rid: a request id must be a non-empty string"),
    ("gen-rid-batch-empty", G, {}, _raw({"text": ["hi", "ho"], "rid": ["a", ""], "sampling_params": {"max_new_tokens": 2}}),
     "non-empty strings"),
    # found by schemathesis: a top_k past int32 ended the scheduler (and the server) while batching
    ("gen-top-k-past-int32", G, {}, _raw({"text": "hi", "sampling_params": {"max_new_tokens": 2, "top_k": 2**31}}),
     "top_k must be -1 (the whole vocabulary) or 1..1073741824"),
    ("comp-top-k-huge", COMP, {}, _comp(top_k=3 * 10**9, temperature=0.7), "top_k must be"),
    ("chat-top-k-huge", CHAT, {}, _chat(top_k=2**40, temperature=0.7), "top_k must be"),  # greedy sets top_k=1
    # found by schemathesis: a zero chat budget read as "no limit" (served to the context length)
    ("chat-max-completion-tokens-zero", CHAT, {}, _chat(max_completion_tokens=0),
     "max_completion_tokens must be at least 1"),
    ("chat-max-tokens-zero", CHAT, {}, _chat(max_tokens=0), "max_tokens must be at least 1"),
    # found by schemathesis (seed 2026, 600 examples): no choices asked for, then the first indexed (500)
    ("comp-n-zero-batch", COMP, {}, json.dumps({"model": "default", "prompt": ["a", "b"], "max_tokens": 1,
                                                 "n": 0}).encode(), "n must be at least 1, got 0"),
    ("comp-n-zero", COMP, {}, _comp(n=0), "n must be at least 1, got 0"),
    ("comp-n-negative", COMP, {}, _comp(n=-3), "n must be at least 1, got -3"),
    ("chat-n-zero", CHAT, {}, _chat(n=0), "n must be at least 1, got 0"),
]


def _post(server: Server, path: str, headers: dict[str, str], body: bytes) -> requests.Response:
    return requests.post(server.url + path, data=body, timeout=TIMEOUT,
                         headers={"content-type": "application/json", **headers})


def _assert_still_serving(server: Server) -> None:
    r = requests.post(server.url + G, timeout=TIMEOUT, json={
        "text": "Still serving?", "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}})
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 2


@pytest.mark.parametrize("path, headers, body, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_request_is_a_clear_4xx_and_the_server_keeps_serving(
        server: Server, path: str, headers: dict[str, str], body: bytes, expected: str) -> None:
    r = _post(server, path, headers, body)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert expected in r.text, r.text[:500]
    _assert_still_serving(server)


def test_streaming_generate_gets_the_400_as_its_error_event(server: Server) -> None:
    # SGLang's /generate has sent its 200 headers before it validates a streaming request; the
    # error arrives as the stream's one event (its OpenAI endpoints answer 400 instead).
    body = json.loads(_gen({"tbt_slo_ms": "nan"}))
    r = _post(server, G, {}, _raw({**body, "stream": True}))
    events = [json.loads(line[len(b"data: "):]) for line in r.content.splitlines()
              if line.startswith(b"data: {")]
    assert len(events) == 1 and events[0]["error"]["code"] == 400, r.text
    assert "tbt_slo_ms" in events[0]["error"]["message"]
    _assert_still_serving(server)


# ---- generated SLO values -----------------------------------------------------------------------

SERVER_CLASSES = SloClasses.parse(json.dumps(CLASSES), DEFAULT)
CONV = SloConventions.parse(SERVER_CLASSES, priority_classes=json.dumps(PRIORITY_CLASSES))

NUMBERS = (st.floats(allow_nan=True, allow_infinity=True) | st.integers(-10**30, 10**30)
           | st.sampled_from([1, 50, 800.5, MAX_SLO_MS, MAX_SLO_MS * 2]))
TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)  # no lone surrogates
VALUES = (st.none() | NUMBERS | st.booleans() | TEXT
          | NUMBERS.map(str) | st.lists(st.integers(0, 9), max_size=2))
CLASS_NAMES = st.none() | st.sampled_from(["gold", "bulk", "interactive", "", "GOLD"]) | VALUES
TIERS = st.none() | st.sampled_from(["auto", "default", "flex", "priority", "scale"]) | VALUES
PRIORITIES = st.none() | st.integers(-100, 100) | st.integers(-2**70, 2**70) | st.booleans() | st.floats(-20, 20)
# Header values: what an HTTP client can send (visible ASCII, no surrounding whitespace).
HEADER_TEXT = (st.sampled_from(["", "100", "0", "-1", "nan", "inf", "1e12", "2.5", "fast"])
               | NUMBERS.map(str) | st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=8))
GATEWAY = st.sampled_from(["", "system", "interactive", "default", "bulk", "BULK ", "vip"])


def _expected(body: dict, custom: dict, headers: dict[str, str], tier: object, priority: object) -> Slo | str:
    """What the server must answer: the SLO the library resolves, or the field it names."""
    try:
        json.dumps(body, allow_nan=False)
    except ValueError:
        return "JSON decode error"  # JSON has no NaN / Infinity: refused before any field is read
    try:
        slo, _ = resolve_request_slo(CONV, DEFAULT, SERVER_CLASSES, custom, headers=headers,
                                     service_tier=tier, priority=priority)
    except SloError as exc:
        return exc.field
    return slo


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ttft=VALUES, tbt=VALUES, cls=CLASS_NAMES, tier=TIERS, priority=PRIORITIES,
       ttft_header=HEADER_TEXT, tpot_header=HEADER_TEXT, gateway=GATEWAY)
def test_generated_slo_values_are_served_or_refused_naming_the_field(
        server: Server, ttft: Any, tbt: Any, cls: Any, tier: Any, priority: Any,
        ttft_header: str, tpot_header: str, gateway: str) -> None:
    custom = {"ttft_slo_ms": ttft, "tbt_slo_ms": tbt, "slo_class": cls}
    headers = {k: v for k, v in (("x-slo-ttft-ms", ttft_header), ("x-slo-tpot-ms", tpot_header),
                                 ("x-smg-priority", gateway)) if v}
    top = {k: v for k, v in (("service_tier", tier), ("priority", priority)) if v is not None}
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True,
                                              "custom_params": custom}, **top}
    # SGLang itself checks `priority` (an int64) before our layer sees the request; the library
    # is the oracle for an integer priority only.
    int_priority = type(priority) is int and -2**63 <= priority < 2**63
    expected = _expected(body, custom, headers, tier, priority if int_priority else None)
    r = _post(server, G, headers, json.dumps(body).encode())
    assert r.status_code in (200, 400), (r.status_code, r.text[:500])
    if r.status_code == 200:
        assert isinstance(expected, Slo), f"served, but the library refuses it naming {expected!r}"
        out = r.json()
        assert len(out["output_ids"]) == 2
        if priority is None or int_priority:
            meta = out["meta_info"]["superinfer"]
            assert (meta["superinfer_ttft_slo_ms"], meta["superinfer_tbt_slo_ms"]) == (expected.ttft_ms, expected.tbt_ms)
        return
    # Refused: the field the library names, or SGLang's own check of a non-integer `priority`
    # (its pydantic model names the field; its /generate contract gate says "expected i64").
    named = [expected] if isinstance(expected, str) else []
    if priority is not None and not int_priority:
        named += ["priority", "expected i64"]
    assert named and any(n in r.text for n in named), (named, r.text[:500])


# ---- issue 38: SLO counters, other tools' custom_params keys -------------------------------------

def _slo_series(server: Server) -> dict[str, float]:
    return {k: v for k, v in server.metrics("superinfer_slo_requests_total").items()}


def test_the_warmup_is_not_in_the_slo_counters(server: Server) -> None:
    # SGLang's startup warm-up (a /generate it posts itself) and start_server's /health ran; the
    # counters of finished requests start empty.
    startup = {k: v for k, v in server.startup_slo_series.items()  # type: ignore[attr-defined]
               if k.startswith("superinfer_slo_requests_total")}
    assert sum(startup.values()) == 0, startup


def test_health_probes_are_not_in_the_slo_counters(server: Server) -> None:
    _assert_still_serving(server)  # at least one counted request, so the series exist
    deadline = time.time() + 10
    before = _slo_series(server)
    while time.time() < deadline and sum(before.values()) == 0:
        time.sleep(0.5)
        before = _slo_series(server)
    assert sum(before.values()) > 0, before
    for path in ("/health", "/health_generate", "/health_generate", "/health"):
        assert requests.get(server.url + path, timeout=TIMEOUT).status_code == 200
    time.sleep(1)  # the scheduler has streamed the probes' finish by now
    assert _slo_series(server) == before
    _assert_still_serving(server)
    after = _slo_series(server)
    joint = 'superinfer_slo_requests_total{outcome="met",slo="ttft",slo_class="default"}'
    missed = joint.replace('"met"', '"missed"')
    assert after.get(joint, 0) + after.get(missed, 0) == before.get(joint, 0) + before.get(missed, 0) + 1


def test_other_tools_custom_params_keys_still_pass(server: Server) -> None:
    r = _post(server, G, {}, _gen({"slot_id": 3, "my_tool": {"x": 1}, "slo_class": "gold"}))
    assert r.status_code == 200, r.text
    assert r.json()["meta_info"]["superinfer"]["superinfer_ttft_slo_ms"] == CLASSES["gold"]["ttft_ms"]


def test_logprobs_at_openais_caps_are_served(server: Server) -> None:
    r = _post(server, CHAT, {}, _chat(logprobs=True, top_logprobs=20))
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20
    r = _post(server, COMP, {}, _comp(logprobs=5))
    assert r.status_code == 200, r.text


# ---- issue 38: schemathesis against the server's own /openapi.json --------------------------------

# CI-sized by default (fixed seed; 25 examples ran 184 cases in 15 s on a 2-core CPU server); a longer run:
# SUPERINFER_FUZZ_EXAMPLES=400 SUPERINFER_FUZZ_SEED=7 pytest tests/e2e/test_hostile_input.py -k schemathesis
FUZZ_EXAMPLES = int(os.environ.get("SUPERINFER_FUZZ_EXAMPLES", "60"))
FUZZ_SEED = int(os.environ.get("SUPERINFER_FUZZ_SEED", "38"))
FUZZ_BUDGET_S = float(os.environ.get("SUPERINFER_FUZZ_BUDGET_S", "150"))


def _wait_idle(server: Server, timeout: float = 60) -> dict[str, float]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.sglang_gauge("num_running_reqs") == 0 and server.sglang_gauge("num_queue_reqs") == 0:
            break
        time.sleep(1)
    return {"running": server.sglang_gauge("num_running_reqs"), "queued": server.sglang_gauge("num_queue_reqs"),
            **{k: v for k, v in server.metrics().items() if k.startswith(("superinfer_rotary_requests",
                                                                          "superinfer_host_pool_blocks_used"))}}


def test_schemathesis_finds_no_server_error(server: Server) -> None:
    pytest.importorskip("schemathesis", reason="schemathesis is in the test extras (pip install -e .[test])")
    from schemathesis.checks import (content_type_conformance, negative_data_rejection, not_a_server_error,
                                     status_code_conformance)

    doc = requests.get(server.url + "/openapi.json", timeout=TIMEOUT).json()
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, negative_data_rejection]
    tally = fuzzutil.fuzz(server.url, doc, examples=FUZZ_EXAMPLES, seed=FUZZ_SEED, modes=("positive", "negative"),
                          checks=checks, timeout=TIMEOUT, budget_s=FUZZ_BUDGET_S)
    print(tally.summary())
    assert sum(tally.cases.values()) >= 50, tally.summary()
    assert {op for op, _ in tally.cases} == {f"{m} {p}" for p, m in fuzzutil.OPERATIONS}, tally.summary()
    assert not tally.server_errors(), tally.summary()
    # negative_data_rejection is reported, not asserted: SGLang's request models are lenient
    # (pydantic coercion, unknown keys and loosely typed fields are accepted) and that is stock
    # behaviour outside our HTTP layer; every other check must pass.
    assert not [f for f in tally.failures if f.check != fuzzutil.LENIENT_CHECK], tally.summary()
    _assert_still_serving(server)
    idle = _wait_idle(server)
    assert not any(idle.values()), idle
