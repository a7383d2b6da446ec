"""Hostile input on every endpoint we change (issue 17): malformed and extreme requests to
`/generate`, `/v1/chat/completions` and `/v1/completions`, in the SLO fields, the SLO headers and
the request itself. Each gets a 4xx whose body names the problem, and after every one the server
still answers a normal request. A hypothesis property test throws generated SLO values at the
server: the answer is a 200 with the SLO the library resolves, or a 400 naming a field the
request sent, never a 5xx or a hang."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
        "--slo-priority-classes", json.dumps(PRIORITY_CLASSES)]
TIMEOUT = 60  # seconds: a request that takes longer is a hang here (2-token answers)

G, CHAT, COMP = "/generate", "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(ARGS, tmp_path_factory.mktemp("logs") / "hostile.log")
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
