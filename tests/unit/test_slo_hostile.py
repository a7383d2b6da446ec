"""Hostile SLO settings below the HTTP layer (issue 17): bad `--slo-classes` and mapping files,
SLOs past the bound, prompt token ids that would crash the scheduler. Each is a clear error naming
the option, field or header; none escapes as another exception (a traceback at startup, or a
crashed scheduler). The inline-JSON cases of the same loaders are in test_slo.py and
test_slo_conventions.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from superinfer_sgl.config import ConfigError, SuperInferConfig
from superinfer_sgl.integration.input_guard import check_prompt_ids
from superinfer_sgl.rotasched.slo import (DEFAULT_CLASSES, DEFAULT_SLO, MAX_SLO_MS, SloClasses, SloError,
                                          resolve_slo)
from superinfer_sgl.rotasched.slo_conventions import (TPOT_HEADER, TTFT_HEADER, SloConventionError,
                                                      SloConventions, header_ms)

CLASSES = SloClasses.parse(DEFAULT_CLASSES)

# (file bytes, field named, substring of the message); the file is given as a path.
BAD_FILES = [
    (b'{"a": {"ttft_ms": 5}} \xff', "slo_classes", "not UTF-8"),
    (b"\xff\xfe{\x00}\x00", "slo_classes", "not UTF-8"),  # UTF-16 with its BOM
    (b"", "slo_classes", "bad JSON"),
    (b"   \n", "slo_classes", "bad JSON"),
    (b"{not json", "slo_classes", "bad JSON"),
    (b'{"a": {"ttft_ms": 5},}', "slo_classes", "bad JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "slo_classes", "nested too deeply"),
    (b'{"a": {"ttft_ms": 5}, "a": {"ttft_ms": 6}}', "slo_classes", "'a' is given twice"),
    (b'{"a": {"ttft_ms": 5, "ttft_ms": 6}}', "slo_classes", "'ttft_ms' is given twice"),
    (b"[1, 2]", "slo_classes", "expected a JSON object"),
    (b'"interactive"', "slo_classes", "expected a JSON object"),
    (b'{"a": {"ttft_ms": NaN}}', "a.ttft_ms", "finite"),
    (b'{"a": {"ttft_ms": Infinity}}', "a.ttft_ms", "finite"),
    (b'{"a": {"tbt_ms": -Infinity}}', "a.tbt_ms", "finite"),
    (b'{"a": {"ttft_ms": 1e999}}', "a.ttft_ms", "finite"),
    (b'{"a": {"ttft_ms": 1e300}}', "a.ttft_ms", "at most"),
    (b'{"a": {"ttft_ms": ' + b"9" * 400 + b"}}", "a.ttft_ms", "too large"),
    (b'{"a": {"ttft_ms": 5, "weight": ' + b"9" * 400 + b"}}", "a.weight", "too large"),
    (b'{"a": {"ttft_ms": 5, "weight": NaN}}', "a.weight", "finite"),
    (b'{"a": {"ttft_ms": 5, "weight": "2"}}', "a.weight", "expected a number"),
    (b'{"a": {"ttft_ms": 5, "weight": -1}}', "a.weight", "finite and > 0"),
    (b'{"a": {"ttft_ms": null}}', "a.ttft_ms", "expected a number"),
    (b'{"a": {"ttft_ms": [5]}}', "a.ttft_ms", "expected a number"),
    (b'{"a": {"ttft_ms": "5ms"}}', "a.ttft_ms", "expected a number"),
    (b'{"a": null}', "a", "expected an object"),
    (b'{"a": {"TTFT_ms": 5}}', "a.TTFT_ms", "unknown key"),
]


@pytest.mark.parametrize("data, field, message", BAD_FILES,
                         ids=[f"{i}:{d[:24]!r}" for i, (d, _, _) in enumerate(BAD_FILES)])
def test_bad_slo_classes_file_names_the_problem(tmp_path: Path, data: bytes, field: str, message: str) -> None:
    path = tmp_path / "classes.json"
    path.write_bytes(data)
    with pytest.raises(SloError, match=message) as info:
        SloClasses.parse(str(path), DEFAULT_SLO)
    assert info.value.field == field
    # The launcher's validation turns it into one line naming the flag, not a traceback.
    with pytest.raises(ConfigError, match="^--slo-classes: .*" + message):
        SuperInferConfig(slo_classes=str(path))


@pytest.mark.parametrize("path, message", [
    ("bad\x00path.json", "not a readable file"),
    ("/nonexistent/dir/classes.json", "not a readable file"),
    ("x" * 5000, "not a readable file"),
    ("   ", "not a readable file"),  # blank: the current directory, not a file
])
def test_unreadable_slo_classes_path_names_the_option(path: str, message: str) -> None:
    with pytest.raises(ConfigError, match="^--slo-classes: .*" + message):
        SuperInferConfig(slo_classes=path)


def test_a_directory_is_not_a_classes_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a readable file"):
        SuperInferConfig(slo_classes=str(tmp_path))


def test_a_utf8_bom_file_is_read(tmp_path: Path) -> None:
    path = tmp_path / "classes.json"
    path.write_bytes(b'\xef\xbb\xbf{"chat": {"ttft_ms": 700, "tbt_ms": 30}}')
    assert SloClasses.parse(str(path), DEFAULT_SLO)["chat"].ttft_ms == 700


def test_the_bound_is_inclusive_and_a_class_may_omit_one_slo(tmp_path: Path) -> None:
    classes = SloClasses.parse(f'{{"slow": {{"ttft_ms": {MAX_SLO_MS!r}}}}}', DEFAULT_SLO)
    assert classes["slow"].ttft_ms == MAX_SLO_MS and classes["slow"].tbt_ms == DEFAULT_SLO.tbt_ms


@pytest.mark.parametrize("kwargs, option, message", [
    ({"service_tiers": '{"flex": "batch", "flex": "interactive"}'}, "slo_service_tiers", "given twice"),
    ({"gateway_classes": '{"bulk": "batch", "bulk": null}'}, "slo_gateway_classes", "given twice"),
    ({"priority_classes": '{"1": "batch", "1": "standard"}'}, "slo_priority_classes", "given twice"),
])
def test_mapping_options_refuse_a_key_given_twice(kwargs: dict, option: str, message: str) -> None:
    with pytest.raises(SloError, match=message) as info:
        SloConventions.parse(CLASSES, **kwargs)
    assert info.value.field == option


@pytest.mark.parametrize("data, option", [
    (b'{"flex": "batch"} \xff', "slo_service_tiers"),
    (b"[" * 100_000, "slo_priority_classes"),
])
def test_mapping_files_with_bad_bytes_name_the_option(tmp_path: Path, data: bytes, option: str) -> None:
    path = tmp_path / "map.json"
    path.write_bytes(data)
    key = {"slo_service_tiers": "service_tiers", "slo_priority_classes": "priority_classes"}[option]
    with pytest.raises(SloError) as info:
        SloConventions.parse(CLASSES, **{key: str(path)})
    assert info.value.field == option


# ---- per-request SLOs past the bound -----------------------------------------------------------

@pytest.mark.parametrize("value", [MAX_SLO_MS * 1.000001, 1e12, 1e308, "1e300", 10**400])
@pytest.mark.parametrize("key", ["ttft_slo_ms", "tbt_slo_ms"])
def test_request_slo_past_the_bound_names_its_field(key: str, value: object) -> None:
    with pytest.raises(SloError) as info:
        resolve_slo({key: value}, DEFAULT_SLO, CLASSES)
    assert info.value.field == key


def test_request_slo_at_the_bound_is_accepted() -> None:
    assert resolve_slo({"ttft_slo_ms": MAX_SLO_MS}, DEFAULT_SLO, CLASSES).ttft_ms == MAX_SLO_MS


@pytest.mark.parametrize("header", [TTFT_HEADER, TPOT_HEADER])
@pytest.mark.parametrize("text", ["1e10", "1e308", "9" * 400])
def test_header_slo_past_the_bound_names_the_header(header: str, text: str) -> None:
    with pytest.raises(SloConventionError, match="must be") as info:  # "at most" or "finite"
        header_ms(header, text)
    assert info.value.field == header and info.value.header


# ---- prompt token ids ---------------------------------------------------------------------------

@pytest.mark.parametrize("ids, message", [
    ([], "the prompt is empty"),
    ([100], "token id 100 is out of the vocabulary"),
    ([1, 2, 10**9], "token id 1000000000"),
    ([-1, 5], "token id -1"),
    ([3, -(2**40)], "token id -1099511627776"),
])
def test_prompt_ids_that_would_crash_the_scheduler_are_refused(ids: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        check_prompt_ids(ids, vocab_size=100)


@pytest.mark.parametrize("ids", [None, [0], [99], list(range(100))])
def test_valid_prompt_ids_pass(ids: list[int] | None) -> None:
    check_prompt_ids(ids, vocab_size=100)
