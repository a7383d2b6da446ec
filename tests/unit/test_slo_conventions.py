"""The ecosystem's SLO conventions: mappings, precedence, validation (docs/slo.md)."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer_sgl.config import ConfigError, SuperInferConfig, slo_conventions
from superinfer_sgl.rotasched import DEFAULT_CLASSES, Slo, SloClasses, SloError
from superinfer_sgl.rotasched.slo import MAX_SLO_MS, MIN_SLO_MS
from superinfer_sgl.rotasched.slo_conventions import (
    DEFAULT_GATEWAY_CLASSES,
    DEFAULT_SERVICE_TIERS,
    GATEWAY_CLASS_HEADER,
    TPOT_HEADER,
    TTFT_HEADER,
    SloConventionError,
    SloConventions,
    fold_conventions,
    header_ms,
    resolve_request_slo,
)

DEFAULT = Slo(5000, 100)
CLASSES = SloClasses.parse(DEFAULT_CLASSES, DEFAULT)
INTERACTIVE, STANDARD, BATCH = CLASSES["interactive"], CLASSES["standard"], CLASSES["batch"]
# The server of the e2e test: priority mapped, `scale` added to the tiers.
CONV = SloConventions.parse(CLASSES, priority_classes='{"0": "standard", "10": "interactive"}',
                            service_tiers='{"scale": "interactive"}')


def resolve(custom: object = None, **conventions: Any) -> tuple[Slo, str | None]:
    return resolve_request_slo(CONV, DEFAULT, CLASSES, custom, **conventions)


# ---- one convention at a time -----------------------------------------------------------------

@pytest.mark.parametrize("conventions, slo, name", [
    ({}, DEFAULT, None),
    ({"service_tier": "priority"}, INTERACTIVE, "interactive"),
    ({"service_tier": "flex"}, BATCH, "batch"),
    ({"service_tier": "default"}, DEFAULT, None),
    ({"service_tier": "auto"}, DEFAULT, None),
    ({"service_tier": "scale"}, INTERACTIVE, "interactive"),  # the operator's own entry
    ({"headers": {GATEWAY_CLASS_HEADER: "bulk"}}, BATCH, "batch"),
    ({"headers": {GATEWAY_CLASS_HEADER: " Interactive "}}, INTERACTIVE, "interactive"),
    ({"headers": {GATEWAY_CLASS_HEADER: "SYSTEM"}}, INTERACTIVE, "interactive"),
    ({"headers": {GATEWAY_CLASS_HEADER: "default"}}, DEFAULT, None),
    ({"headers": {GATEWAY_CLASS_HEADER: ""}}, DEFAULT, None),  # empty header: absent
    ({"priority": 10}, INTERACTIVE, "interactive"),
    ({"priority": 2**62}, INTERACTIVE, "interactive"),
    ({"priority": 9}, STANDARD, "standard"),
    ({"priority": 0}, STANDARD, "standard"),
    ({"priority": -1}, DEFAULT, None),  # below every threshold: the server default
    ({"headers": {TTFT_HEADER: "1234"}}, Slo(1234, 100), None),
    ({"headers": {TPOT_HEADER: "7.5"}}, Slo(5000, 7.5), None),
    ({"headers": {TTFT_HEADER: " 2e3 ", TPOT_HEADER: "40"}}, Slo(2000, 40), None),
    ({"headers": {TTFT_HEADER: "", TPOT_HEADER: "  "}}, DEFAULT, None),
])
def test_each_convention_alone(conventions: dict, slo: Slo, name: str | None) -> None:
    assert resolve(**conventions) == (slo, name)


# ---- precedence -------------------------------------------------------------------------------

ALL_CLASS_SOURCES = {"headers": {GATEWAY_CLASS_HEADER: "bulk"}, "service_tier": "priority", "priority": 0}


@pytest.mark.parametrize("custom, conventions, slo, name", [
    # class: custom_params.slo_class > x-smg-priority > service_tier > priority > server default
    ({"slo_class": "standard"}, ALL_CLASS_SOURCES, STANDARD, "standard"),
    (None, ALL_CLASS_SOURCES, BATCH, "batch"),
    (None, {"service_tier": "priority", "priority": 0}, INTERACTIVE, "interactive"),
    (None, {"headers": {GATEWAY_CLASS_HEADER: "interactive"}, "service_tier": "flex"},
     INTERACTIVE, "interactive"),
    # a value that maps to no class defers to the next convention
    (None, {"headers": {GATEWAY_CLASS_HEADER: "default"}, "service_tier": "flex"}, BATCH, "batch"),
    (None, {"service_tier": "auto", "priority": 10}, INTERACTIVE, "interactive"),
    (None, {"service_tier": "default", "priority": -3}, DEFAULT, None),
    ({"slo_class": None}, {"service_tier": "flex"}, BATCH, "batch"),  # JSON null: absent
    # TTFT/TBT: custom_params keys > SLO headers > the class > the server default
    (None, {"headers": {TTFT_HEADER: "2222"}, "service_tier": "flex"}, Slo(2222, 500, 1.0), "batch"),
    ({"slo_class": "interactive"}, {"headers": {TPOT_HEADER: "80"}}, Slo(1000, 80), "interactive"),
    ({"ttft_slo_ms": 999}, {"headers": {TTFT_HEADER: "2222", TPOT_HEADER: "33"}}, Slo(999, 33), None),
    ({"ttft_slo_ms": 999, "tbt_slo_ms": 9}, {"headers": {TTFT_HEADER: "1", TPOT_HEADER: "2"}},
     Slo(999, 9), None),
    ({"slo_class": "batch", "tbt_slo_ms": 70}, {**ALL_CLASS_SOURCES, "headers": {
        GATEWAY_CLASS_HEADER: "interactive", TTFT_HEADER: "2222", TPOT_HEADER: "33"}},
     Slo(2222, 70), "batch"),
])
def test_precedence(custom: object, conventions: dict, slo: Slo, name: str | None) -> None:
    assert resolve(custom, **conventions) == (slo, name)


def test_class_weight_travels_with_a_mapped_class() -> None:
    classes = SloClasses.parse('{"gold": {"ttft_ms": 500, "tbt_ms": 40, "weight": 4}}', DEFAULT)
    conv = SloConventions.parse(classes, service_tiers='{"priority": "gold"}')
    slo, name = resolve_request_slo(conv, DEFAULT, classes, None, service_tier="priority")
    assert (slo, name) == (Slo(500, 40, 4.0), "gold")


def test_fold_keeps_foreign_keys_and_returns_the_input_when_nothing_folds() -> None:
    custom = {"foreign": 1}
    assert fold_conventions(CONV, custom) is custom
    assert fold_conventions(CONV, custom, service_tier="default") is custom
    assert fold_conventions(CONV, None, headers={"x-other": "1"}) is None
    folded = fold_conventions(CONV, custom, service_tier="flex")
    assert folded == {"foreign": 1, "slo_class": "batch"} and custom == {"foreign": 1}
    # explicit keys already there: nothing to fold, the same object
    full = {"slo_class": "standard", "ttft_slo_ms": 1, "tbt_slo_ms": 2}
    assert fold_conventions(CONV, full, service_tier="flex", headers={TTFT_HEADER: "5"}) is full


def test_priority_is_no_slo_input_unless_mapped() -> None:
    conv = SloConventions.parse(CLASSES)
    assert not conv.maps_priority
    assert fold_conventions(conv, None, priority=100) is None
    assert fold_conventions(conv, None, priority="not even an int") is None  # SGLang's to judge


def test_non_object_custom_params_is_left_for_resolve_slo_to_reject() -> None:
    assert fold_conventions(CONV, "gold", service_tier="flex") == "gold"
    with pytest.raises(SloError, match="custom_params"):
        resolve("gold", service_tier="flex")


# ---- bad values: an error naming the field or header, whether or not the value would win -------

@pytest.mark.parametrize("custom, conventions, field", [
    (None, {"service_tier": "ultra"}, "service_tier"),
    (None, {"service_tier": "Priority"}, "service_tier"),  # OpenAI's values are lower case
    (None, {"service_tier": 3}, "service_tier"),
    ({"slo_class": "batch"}, {"service_tier": "ultra"}, "service_tier"),
    (None, {"headers": {GATEWAY_CLASS_HEADER: "urgent"}}, GATEWAY_CLASS_HEADER),
    ({"slo_class": "batch"}, {"headers": {GATEWAY_CLASS_HEADER: "batch"}}, GATEWAY_CLASS_HEADER),
    (None, {"priority": "high"}, "priority"),
    (None, {"priority": True}, "priority"),
    (None, {"priority": 1.5}, "priority"),
    (None, {"headers": {TTFT_HEADER: "-5"}}, TTFT_HEADER),
    (None, {"headers": {TTFT_HEADER: "0"}}, TTFT_HEADER),
    (None, {"headers": {TTFT_HEADER: "nan"}}, TTFT_HEADER),
    (None, {"headers": {TTFT_HEADER: "inf"}}, TTFT_HEADER),
    (None, {"headers": {TTFT_HEADER: "1e999"}}, TTFT_HEADER),
    (None, {"headers": {TTFT_HEADER: "soon"}}, TTFT_HEADER),
    (None, {"headers": {TTFT_HEADER: "100ms"}}, TTFT_HEADER),
    (None, {"headers": {TTFT_HEADER: "1_000"}}, TTFT_HEADER),
    (None, {"headers": {TPOT_HEADER: "1e-322"}}, TPOT_HEADER),  # 0.0 s in the scheduler's views
    (None, {"headers": {TTFT_HEADER: "\u0661\u0660\u0660"}}, TTFT_HEADER),  # non-ASCII digits
    (None, {"headers": {TTFT_HEADER: "100, 200"}}, TTFT_HEADER),  # the header sent twice
    ({"ttft_slo_ms": 50}, {"headers": {TTFT_HEADER: "-5"}}, TTFT_HEADER),
    (None, {"headers": {TPOT_HEADER: "-0.0"}}, TPOT_HEADER),
    (None, {"headers": {TPOT_HEADER: "0x10"}}, TPOT_HEADER),
])
def test_bad_values_name_their_source(custom: object, conventions: dict, field: str) -> None:
    with pytest.raises(SloConventionError) as info:
        resolve(custom, **conventions)
    assert info.value.field == field
    assert repr(field) in str(info.value)
    assert ("header" in str(info.value)) == (field.startswith("x-"))


def test_unknown_tier_lists_the_known_ones() -> None:
    with pytest.raises(SloConventionError, match=r"known: \['auto', 'default', 'flex', 'priority', 'scale'\]"):
        CONV.tier_class("ultra")


# ---- numeric headers --------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.floats(min_value=MIN_SLO_MS, max_value=MAX_SLO_MS))  # above: test_slo_hostile.py
def test_any_number_within_the_bounds_is_read_exactly(ms: float) -> None:
    for text in (repr(ms), f"{ms:.17g}", f" {ms!r}\t"):
        assert header_ms(TTFT_HEADER, text) == ms
    slo, _ = resolve(headers={TTFT_HEADER: repr(ms), TPOT_HEADER: repr(ms)})
    assert (slo.ttft_ms, slo.tbt_ms) == (ms, ms)


@settings(max_examples=200, deadline=None)
@given(st.floats(max_value=MIN_SLO_MS, exclude_max=True) | st.sampled_from([math.inf, -math.inf, math.nan]))
def test_under_the_floor_and_non_finite_numbers_are_rejected(ms: float) -> None:
    with pytest.raises(SloConventionError, match=TPOT_HEADER):
        header_ms(TPOT_HEADER, repr(ms))


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_any_text_is_a_number_or_a_clear_error(text: str) -> None:
    try:
        ms = header_ms(TTFT_HEADER, text)
    except SloConventionError as exc:
        assert exc.field == TTFT_HEADER and exc.header
    else:
        assert MIN_SLO_MS <= ms <= MAX_SLO_MS and ms == float(text.strip())


# ---- the options ------------------------------------------------------------------------------

def test_builtin_mappings() -> None:
    conv = SloConventions.parse(CLASSES)
    assert dict(conv.service_tiers) == dict(DEFAULT_SERVICE_TIERS) == {
        "default": None, "priority": "interactive", "flex": "batch"}
    assert dict(conv.gateway_classes) == dict(DEFAULT_GATEWAY_CLASSES)
    assert conv.tier_class("auto") is None and conv.priority_bands == ()


def test_builtin_entries_naming_missing_classes_mean_the_server_default() -> None:
    classes = SloClasses.parse('{"chat": {"ttft_ms": 800}}', DEFAULT)
    conv = SloConventions.parse(classes)
    assert conv.tier_class("priority") is None and conv.gateway_class("bulk") is None
    conv = SloConventions.parse(classes, service_tiers='{"priority": "chat"}')
    assert conv.tier_class("priority") == "chat" and conv.tier_class("flex") is None


def test_operator_overrides_merge_over_the_builtin_ones(tmp_path: Path) -> None:
    path = tmp_path / "tiers.json"
    path.write_text(json.dumps({"default": "standard", "flex": None}))
    conv = SloConventions.parse(CLASSES, service_tiers=str(path),
                                gateway_classes='{"Default": "standard", "gold": "interactive"}')
    assert conv.tier_class("default") == "standard" and conv.tier_class("auto") == "standard"
    assert conv.tier_class("flex") is None and conv.tier_class("priority") == "interactive"
    assert conv.gateway_class("GOLD") == "interactive" and conv.gateway_class("default") == "standard"
    auto = SloConventions.parse(CLASSES, service_tiers='{"auto": "batch"}')
    assert auto.tier_class("auto") == "batch" and auto.tier_class("default") is None


def test_priority_bands_are_sorted_thresholds() -> None:
    conv = SloConventions.parse(CLASSES, priority_classes='{"10": "interactive", "-5": "batch", "0": null}')
    assert conv.priority_bands == ((-5, "batch"), (0, None), (10, "interactive"))
    assert [conv.priority_class(p) for p in (-6, -5, -1, 0, 9, 10)] == [
        None, "batch", "batch", None, None, "interactive"]


@pytest.mark.parametrize("kwargs, option, message", [
    ({"service_tiers": '{"priority": "gold"}'}, "slo_service_tiers", "unknown class 'gold'"),
    ({"service_tiers": '{"priority": 3}'}, "slo_service_tiers", "expected a class name or null"),
    ({"service_tiers": "[1]"}, "slo_service_tiers", "expected a JSON object"),
    ({"service_tiers": "{bad"}, "slo_service_tiers", "bad JSON"),
    ({"service_tiers": '{"": "batch"}'}, "slo_service_tiers", "non-empty"),
    ({"service_tiers": "/nonexistent/tiers.json"}, "slo_service_tiers", "not a readable file"),
    ({"gateway_classes": '{"bulk": "batch", "BULK": "standard"}'}, "slo_gateway_classes", "twice"),
    ({"priority_classes": "{}"}, "slo_priority_classes", "at least one threshold"),
    ({"priority_classes": '{"high": "batch"}'}, "slo_priority_classes", "not an integer"),
    ({"priority_classes": '{"1.5": "batch"}'}, "slo_priority_classes", "not an integer"),
    ({"priority_classes": '{"1": "batch", "01": "standard"}'}, "slo_priority_classes", "equal"),
    ({"priority_classes": '{"1": "platinum"}'}, "slo_priority_classes", "unknown class"),
])
def test_bad_options_name_the_option(kwargs: dict, option: str, message: str) -> None:
    with pytest.raises(SloError, match=message) as info:
        SloConventions.parse(CLASSES, **kwargs)
    assert info.value.field == option


@pytest.mark.parametrize("field, flag", [
    ("slo_service_tiers", "--slo-service-tiers"),
    ("slo_gateway_classes", "--slo-gateway-classes"),
    ("slo_priority_classes", "--slo-priority-classes"),
])
def test_config_rejects_a_bad_mapping_naming_the_flag(field: str, flag: str) -> None:
    with pytest.raises(ConfigError, match=f"^{flag}: .*unknown class 'platinum'"):
        SuperInferConfig(**{field: '{"7": "platinum"}'})


def test_config_mappings_see_the_servers_own_classes() -> None:
    cfg = SuperInferConfig(slo_classes='{"gold": {"ttft_ms": 300}}', slo_priority_classes='{"5": "gold"}',
                           slo_service_tiers='{"priority": "gold"}')
    conv = slo_conventions(cfg)
    assert conv.priority_class(5) == "gold" and conv.tier_class("priority") == "gold"
    assert conv.tier_class("flex") is None  # no `batch` class on this server
    with pytest.raises(ConfigError, match="--slo-priority-classes"):
        SuperInferConfig(slo_priority_classes='{"5": "interactive"}', slo_classes='{"gold": {"ttft_ms": 300}}')


def test_cli_parses_the_convention_flags() -> None:
    import argparse

    from superinfer_sgl.config import add_cli_args, from_namespace

    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    cfg = from_namespace(parser.parse_args([
        "--slo-service-tiers", '{"scale": "interactive"}', "--slo-gateway-classes", '{"bulk": "standard"}',
        "--slo-priority-classes", '{"0": "batch", "10": "interactive"}']))
    assert cfg.slo_service_tiers == '{"scale": "interactive"}'
    assert cfg.slo_gateway_classes == '{"bulk": "standard"}'
    assert slo_conventions(cfg).priority_bands == ((0, "batch"), (10, "interactive"))


# ---- the HTTP layer's gathering (integration.http_slo), with a real Starlette request ----------

def _request(body: dict | None, headers: dict[str, str], method: str = "POST", path: str = "/generate") -> Any:
    from starlette.requests import Request

    raw = json.dumps(body).encode() if body is not None else b""
    sent = False

    async def receive() -> dict:
        nonlocal sent
        if sent:
            return {"type": "http.disconnect"}
        sent = True
        return {"type": "http.request", "body": raw, "more_body": False}

    hdrs = [(k.lower().encode(), v.encode()) for k, v in {"content-type": "application/json", **headers}.items()]
    return Request({"type": "http", "method": method, "path": path, "headers": hdrs}, receive)


class _Obj:
    def __init__(self, sampling_params: Any = None, priority: int | None = None) -> None:
        self.sampling_params = sampling_params
        self.priority = priority


def _fold(obj: _Obj, request: Any) -> _Obj:
    from superinfer_sgl.integration.http_slo import fold_request

    asyncio.run(fold_request(CONV, obj, request))
    return obj


def test_http_layer_reads_body_headers_and_priority() -> None:
    obj = _fold(_Obj({"max_new_tokens": 2}, priority=10),
                _request({"text": "hi", "service_tier": "flex"}, {"X-SLO-TTFT-MS": "1500"}))
    assert obj.sampling_params == {"max_new_tokens": 2, "custom_params": {"slo_class": "batch", "ttft_slo_ms": 1500.0}}
    obj = _fold(_Obj(None, priority=10), _request({"text": "hi"}, {}))
    assert obj.sampling_params == {"custom_params": {"slo_class": "interactive"}}
    batch = [{"custom_params": {"slo_class": "standard"}}, {}]
    obj = _fold(_Obj(batch), _request({"text": ["a", "b"]}, {GATEWAY_CLASS_HEADER: "bulk"}))
    assert obj.sampling_params == [{"custom_params": {"slo_class": "standard"}}, {"custom_params": {"slo_class": "batch"}}]


def test_http_layer_leaves_requests_without_conventions_alone() -> None:
    params = {"max_new_tokens": 2}
    assert _fold(_Obj(params), _request({"text": "hi"}, {})).sampling_params is params
    assert _fold(_Obj(params), None).sampling_params is params  # the Engine API: no HTTP request
    # a GET (SGLang's /health probe) has no body to read
    assert _fold(_Obj(params), _request(None, {}, method="GET")).sampling_params is params


def test_http_layer_turns_a_bad_value_into_a_value_error() -> None:
    with pytest.raises(ValueError, match="invalid SLO field 'service_tier'"):
        _fold(_Obj({}), _request({"text": "hi", "service_tier": "ultra"}, {}))
    with pytest.raises(ValueError, match="invalid SLO header 'x-slo-tpot-ms'"):
        _fold(_Obj({}), _request({"text": "hi"}, {TPOT_HEADER: "nan"}))


def test_service_tier_is_read_where_it_is_openais() -> None:
    """Anthropic's Messages API has its own `service_tier` ("auto", "standard_only"), which SGLang
    ignores: a valid Anthropic request must not get a 400 for it."""
    params = {"max_new_tokens": 2}
    for value in ("standard_only", "auto", "flex"):
        obj = _fold(_Obj(params), _request({"messages": [], "service_tier": value}, {}, path="/v1/messages"))
        assert obj.sampling_params is params
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/generate"):
        obj = _fold(_Obj({}), _request({"service_tier": "flex"}, {}, path=path))
        assert obj.sampling_params == {"custom_params": {"slo_class": "batch"}}


def test_the_stamp_keeps_the_servers_preferred_custom_params() -> None:
    """SGLang merges `--preferred-sampling-params` under a request's own, key by key: a request
    without `custom_params` gets the preferred ones, which the stamp must not replace."""
    from superinfer_sgl.integration.http_slo import RECEIVED_KEY, stamp_received

    preferred = {"temperature": 0.5, "custom_params": {"slo_class": "batch", "thinking_budget": 64}}
    obj = _Obj([{"max_new_tokens": 2}, {"custom_params": {"slo_class": "interactive"}}, {"custom_params": None}])
    stamp_received(obj, 7.0, preferred=preferred)
    assert obj.sampling_params == [
        {"max_new_tokens": 2, "custom_params": {"slo_class": "batch", "thinking_budget": 64, RECEIVED_KEY: 7.0}},
        {"custom_params": {"slo_class": "interactive", RECEIVED_KEY: 7.0}},  # its own win, as in SGLang
        {"custom_params": {RECEIVED_KEY: 7.0}}]
    assert preferred["custom_params"] == {"slo_class": "batch", "thinking_budget": 64}  # not written into


def test_http_layer_stamps_when_it_received_the_request() -> None:
    from superinfer_sgl.integration.http_slo import RECEIVED_KEY, stamp_received

    obj = _Obj({"max_new_tokens": 2, "custom_params": {"slo_class": "batch", RECEIVED_KEY: 1.0}})
    stamp_received(obj, 123.5)  # a client's own value under our key is replaced
    assert obj.sampling_params == {"max_new_tokens": 2, "custom_params": {"slo_class": "batch", RECEIVED_KEY: 123.5}}
    obj = _Obj([None, {"custom_params": None}])
    stamp_received(obj, 7.0)
    assert obj.sampling_params == [{"custom_params": {RECEIVED_KEY: 7.0}}] * 2
    for bad in ("text", {"custom_params": [1]}):  # SGLang's validation / resolve_slo names these
        obj = _Obj(bad)
        stamp_received(obj, 7.0)
        assert obj.sampling_params == bad


def test_received_time_is_sglangs_note_on_the_wall_clock() -> None:
    import time

    from superinfer_sgl.integration.http_slo import received_unix

    before = time.time()
    assert before <= received_unix(None) <= time.time()
    assert received_unix(float("nan")) >= before
    got = received_unix(time.perf_counter() - 2.0)  # SGLang noted it 2 s ago
    assert before - 2.5 < got < time.time() - 1.9
