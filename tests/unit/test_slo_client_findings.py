"""What real clients found (issue 38, item 4), below the HTTP layer: an unloadable custom logit
processor, health probes and the warm-up in the SLO counters, misspelt SLO keys, OpenAI's
logprobs caps. The same cases against a live server are rows of tests/e2e/test_hostile_input.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import dill
import pytest
from prometheus_client import CollectorRegistry

from superinfer_sgl.integration import http_guard
from superinfer_sgl.integration.http_slo import (HEALTH_CHECK, UNMETERED_KEY, WARMUP, stamp_received,
                                                 unmetered_reason)
from superinfer_sgl.integration.input_guard import load_logit_processor
from superinfer_sgl.integration.metrics import RotaSchedMetrics, metered
from superinfer_sgl.rotasched.slo import (DEFAULT_CLASSES, DEFAULT_SLO, SLO_KEYS, SloClasses, SloError,
                                          check_slo_keys, looks_like_slo_key)
from superinfer_sgl.rotasched.slo_conventions import SloConventions, resolve_request_slo

# ---- (a) custom logit processors -----------------------------------------------------------


class _Processor:
    def __call__(self, logits: object, custom_param_list: object = None) -> object:
        return logits


def _serialized(obj: object) -> str:
    return json.dumps({"callable": dill.dumps(obj).hex()})


def _unimportable() -> str:
    """A pickle of a class from a module this process cannot import (what a client's own
    module looks like to the server: ModuleNotFoundError when loaded)."""
    payload = dill.dumps(_Processor, byref=True).replace(
        _Processor.__module__.encode(), b"no_such_module_" + b"x" * (len(_Processor.__module__) - 15))
    return json.dumps({"callable": payload.hex()})


def test_a_loadable_processor_passes() -> None:
    load_logit_processor(_serialized(_Processor))
    from sglang.srt.sampling.custom_logit_processor import DisallowedTokensLogitsProcessor

    load_logit_processor(DisallowedTokensLogitsProcessor.to_str())


@pytest.mark.parametrize("value, message", [
    (_unimportable(), "ModuleNotFoundError"),
    ("not json", "not JSON"),
    ("", "not JSON"),
    ("[1, 2]", '"callable" string'),
    ('{"callable": 5}', '"callable" string'),
    ('{"callable": "zz"}', "not hex"),
    ('{"callable": "00ff"}', "cannot be loaded"),
    (json.dumps({"callable": dill.dumps(5).hex()}), "cannot be loaded"),  # 5() is a TypeError
    (json.dumps({"callable": dill.dumps(dict).hex()}), "not callable"),  # dict() is not callable
    (5, "expected a string"),
])
def test_an_unloadable_processor_is_a_value_error_naming_the_field(value: object, message: str) -> None:
    with pytest.raises(ValueError, match="custom_logit_processor") as info:
        load_logit_processor(value)
    assert message in str(info.value)


# ---- (b) health probes and the warm-up are not counted ---------------------------------------


def _req(rid: str, custom: object = None) -> SimpleNamespace:
    return SimpleNamespace(rid=rid, sampling_params=SimpleNamespace(custom_params=custom))


def test_probes_and_warmup_are_unmetered() -> None:
    assert metered(_req("abc123"))
    assert metered(_req("abc", {"slo_class": "batch"}))
    assert not metered(_req("HEALTH_CHECK_0f3e"))
    assert not metered(_req("abc", {UNMETERED_KEY: WARMUP}))
    assert not metered(_req("abc", {UNMETERED_KEY: HEALTH_CHECK}))


def test_prefill_only_requests_are_unmetered() -> None:
    """SGLang caches an `n > 1` request's prompt with a request of its own first (max_new_tokens
    0, a new rid, the samples' custom_params): no client waits on its token."""
    req = _req("abc", {"slo_class": "batch"})
    req.sampling_params.max_new_tokens = 0
    assert not metered(req)
    req.sampling_params.max_new_tokens = 1
    assert metered(req)


def test_unmetered_block_counts_nothing() -> None:
    reg = CollectorRegistry()
    m = RotaSchedMetrics(registry=reg)
    with m.unmetered():
        m.finished(None, True, True)
    m.finished(None, True, False)
    value = reg.get_sample_value("superinfer_slo_requests_total", {"slo_class": "default", "slo": "ttft",
                                                                   "outcome": "met"})
    assert value == 1.0
    assert m.window.attainment()[("default", "ttft")] == (1, 1)


class _Status:
    def __init__(self, value: str) -> None:
        self.value = value


def test_the_http_layer_marks_what_sglang_sends_itself() -> None:
    up, starting = SimpleNamespace(server_status=_Status("Up")), SimpleNamespace(server_status=_Status("Starting"))
    http = object()  # any FastAPI request
    assert unmetered_reason(up, SimpleNamespace(rid="HEALTH_CHECK_1"), http) == HEALTH_CHECK
    assert unmetered_reason(starting, SimpleNamespace(rid=None), http) == WARMUP
    assert unmetered_reason(up, SimpleNamespace(rid=None), http) is None
    assert unmetered_reason(up, SimpleNamespace(rid=["a", "b"]), http) is None
    # The Engine API has no HTTP request and its manager stays Starting: never marked.
    assert unmetered_reason(starting, SimpleNamespace(rid=None), None) is None


def test_a_client_cannot_hide_its_request_from_the_counters() -> None:
    obj = SimpleNamespace(sampling_params={"custom_params": {UNMETERED_KEY: "warmup", "x": 1}})
    stamp_received(obj, 5.0)
    assert UNMETERED_KEY not in obj.sampling_params["custom_params"]
    assert obj.sampling_params["custom_params"]["x"] == 1
    stamp_received(obj, 5.0, unmetered=HEALTH_CHECK)
    assert obj.sampling_params["custom_params"][UNMETERED_KEY] == HEALTH_CHECK


# ---- (c) unknown SLO keys ---------------------------------------------------------------------


@pytest.mark.parametrize("key", ["slo_clas", "SLO_CLASS", "sloClass", "slo", "slo-class", "x-slo-ttft-ms",
                                 "tpot_slo_ms", "ttft_slo", "ttft_ms", "tbt_ms", "tpot_ms", "TTFT", "my_slo"])
def test_keys_that_look_like_ours_are_refused_naming_the_key_and_ours(key: str) -> None:
    assert looks_like_slo_key(key)
    with pytest.raises(SloError) as info:
        check_slo_keys({key: 5, "slo_class": "batch"})
    assert info.value.field == key
    assert all(k in str(info.value) for k in SLO_KEYS)


@pytest.mark.parametrize("key", ["thinking_budget", "__req__", "__sglang_reasoning_end_token_ids", "token_ids",
                                 "slot_id", "isolation", "slow", "superinfer_received_unix", "superinfer_unmetered",
                                 "max_ttft", "", "1"])
def test_other_tools_keys_pass(key: str) -> None:
    assert not looks_like_slo_key(key)
    check_slo_keys({key: 1, **{k: None for k in SLO_KEYS}})


def test_the_request_oracle_refuses_a_misspelt_key() -> None:
    classes = SloClasses.parse(DEFAULT_CLASSES)
    with pytest.raises(SloError, match="slo_clas"):
        resolve_request_slo(SloConventions.parse(classes), DEFAULT_SLO, classes, {"slo_clas": "batch"})
    check_slo_keys(None)
    check_slo_keys([1, 2])  # not an object: resolve_slo names custom_params itself


# ---- (d) OpenAI's logprobs caps ----------------------------------------------------------------


@pytest.mark.parametrize("fields, message", [
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 10**12}, "top_logprobs"),
])
def test_chat_top_logprobs_above_openais_cap_is_refused(fields: dict, message: str) -> None:
    req = SimpleNamespace(**{"top_logprobs": None, "logprobs": False, **fields})
    error = http_guard.chat_logprobs_error(req)
    assert error is not None and message in error and str(http_guard.MAX_CHAT_TOP_LOGPROBS) in error


@pytest.mark.parametrize("value", [None, 0, 5, 20])
def test_chat_top_logprobs_within_the_cap_passes(value: object) -> None:
    assert http_guard.chat_logprobs_error(SimpleNamespace(top_logprobs=value, logprobs=True)) is None


@pytest.mark.parametrize("value, ok", [(None, True), (0, True), (5, True), (6, False), (-1, False), (10**9, False)])
def test_completion_logprobs_cap(value: object, ok: bool) -> None:
    error = http_guard.completion_logprobs_error(SimpleNamespace(logprobs=value))
    assert (error is None) == ok
    if not ok:
        assert "logprobs" in error and str(http_guard.MAX_COMPLETION_LOGPROBS) in error


@pytest.mark.parametrize("body, kind", [([1, 2], "an array"), ([], "an array"), ("x", "a string"), (5, "a number"),
                                        (1.5, "a number"), (True, "a boolean"), (None, "null")])
def test_an_openai_body_that_is_not_an_object_is_refused(body: object, kind: str) -> None:
    assert http_guard.body_shape_error("/v1/chat/completions", body) == f"the request body must be a JSON object, got {kind}"
    assert http_guard.body_shape_error("/generate", body) is None  # SGLang's own 400 there


def test_an_object_body_passes() -> None:
    assert http_guard.body_shape_error("/v1/completions", {"prompt": "hi"}) is None


@pytest.mark.parametrize("fields", [
    {"input_embeds": []},
    {"input_embeds": [[]]},
    {"text": "hi", "sampling_params": []},
    {"input_ids": 5},
])
def test_malformed_generate_inputs_are_value_errors(fields: dict) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(**fields)
    with pytest.raises(ValueError, match="malformed request"):
        http_guard.around_normalize(GenerateReqInput.normalize_batch_and_arguments, obj)


@pytest.mark.parametrize("prompts, params, n", [(2, 1, 1), (2, 3, 1), (3, 2, 2), (1, 2, 1)])
def test_a_batch_needs_one_sampling_params_object_per_prompt(prompts: int, params: int, n: int) -> None:
    """SGLang repeats a batch's list for `n` unchecked: short, an index failed later (HTTP 500,
    the first prompts already sent); long, the extra entries (their SLOs) were dropped."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    text = [f"p{i}" for i in range(prompts)] if prompts > 1 else ["p0"]
    obj = GenerateReqInput(text=text, sampling_params=[{"n": n}] * params)
    with pytest.raises(ValueError, match=f"sampling_params: a batch of {prompts} prompts"):
        http_guard.around_normalize(GenerateReqInput.normalize_batch_and_arguments, obj)


@pytest.mark.parametrize("params", [[{"n": 2}, {"n": 2}], {"max_new_tokens": 2}, None, [{}, {}]])
def test_a_batch_with_matching_sampling_params_normalizes(params: object) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(text=["a", "b"], sampling_params=params)
    http_guard.around_normalize(GenerateReqInput.normalize_batch_and_arguments, obj)
    assert not obj.is_single and len(obj.sampling_params) == 2 * obj.parallel_sample_num


def test_a_wellformed_generate_input_normalizes() -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(text="hi", sampling_params={"max_new_tokens": 2})
    http_guard.around_normalize(GenerateReqInput.normalize_batch_and_arguments, obj)
    assert obj.is_single


@pytest.mark.parametrize("fields, error", [
    ({"max_completion_tokens": 0, "max_tokens": None}, "max_completion_tokens"),
    ({"max_completion_tokens": None, "max_tokens": 0}, "max_tokens"),
    ({"max_completion_tokens": 0, "max_tokens": 5}, "max_completion_tokens"),
    ({"max_completion_tokens": 3, "max_tokens": 0}, None),  # SGLang uses max_completion_tokens
    ({"max_completion_tokens": None, "max_tokens": None}, None),
    ({"max_completion_tokens": 1, "max_tokens": None}, None),
])
def test_a_zero_chat_budget_is_refused(fields: dict, error: str | None) -> None:
    message = http_guard.chat_budget_error(SimpleNamespace(**fields))
    assert (message is None) == (error is None)
    if error:
        assert message.startswith(error)


@pytest.mark.parametrize("n, ok", [(0, False), (-1, False), (-(2**40), False), (1, True), (2, True), (None, True),
                                   (True, True)])  # a boolean is pydantic's business, not a count here
def test_fewer_than_one_choice_is_refused(n: object, ok: bool) -> None:
    # found by schemathesis: /v1/completions {"prompt": ["a", "b"], "max_tokens": 1, "n": 0} was a 500
    message = http_guard.choices_error(SimpleNamespace(n=n))
    assert (message is None) == ok
    if not ok:
        assert message == f"n must be at least 1, got {n}"


@pytest.mark.parametrize("fields, ok", [
    ({"text": "hi", "rid": ["a"]}, False),
    ({"text": "hi", "rid": "a"}, True),
    ({"text": "hi"}, True),
    ({"text": ["a", "b"], "rid": ["x", "y"]}, True),
    ({"text": ["a", "b"]}, True),
])
def test_request_ids_must_fit_the_prompt(fields: dict, ok: bool) -> None:
    from sglang.srt.managers.io_struct import GenerateReqInput

    obj = GenerateReqInput(sampling_params={"max_new_tokens": 2}, **fields)
    if ok:
        http_guard.around_normalize(GenerateReqInput.normalize_batch_and_arguments, obj)
    else:
        with pytest.raises(ValueError, match="rid"):
            http_guard.around_normalize(GenerateReqInput.normalize_batch_and_arguments, obj)


@pytest.mark.parametrize("top_k, ok", [(-1, True), (1, True), (1 << 30, True), ((1 << 30) + 1, False), (2**31, False),
                                       (3 * 10**9, False)])
def test_a_top_k_the_scheduler_cannot_pack_is_refused(top_k: int, ok: bool) -> None:
    from superinfer_sgl.integration.input_guard import check_sampling_params

    if ok:
        check_sampling_params(SimpleNamespace(top_k=top_k))
    else:
        with pytest.raises(ValueError, match="top_k must be"):
            check_sampling_params(SimpleNamespace(top_k=top_k))
