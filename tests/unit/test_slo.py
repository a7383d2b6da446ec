"""SLO classes and per-request SLO resolution."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from superinfer_sgl.rotasched import (
    DEFAULT_CLASSES,
    DEFAULT_SLO,
    Slo,
    SloClasses,
    SloError,
    resolve_slo,
)

DEFAULT = Slo(ttft_ms=5000, tbt_ms=100)
CLASSES = SloClasses.parse(DEFAULT_CLASSES, DEFAULT)


def test_default_classes() -> None:
    assert dict(CLASSES) == {
        "interactive": Slo(1000, 50), "standard": Slo(5000, 100), "batch": Slo(30000, 500),
    }
    assert DEFAULT_SLO == DEFAULT


def test_slo_seconds() -> None:
    assert (Slo(250, 40).ttft_s, Slo(250, 40).tbt_s) == (0.25, 0.04)


def test_parse_from_file(tmp_path: Path) -> None:
    path = tmp_path / "classes.json"
    path.write_text(json.dumps({"chat": {"ttft_ms": 800, "tbt_ms": 40}}))
    assert dict(SloClasses.parse(str(path), DEFAULT)) == {"chat": Slo(800, 40)}


def test_class_may_omit_one_key() -> None:
    classes = SloClasses.parse('{"a": {"ttft_ms": 700}, "b": {"tbt_ms": 30}}', DEFAULT)
    assert classes["a"] == Slo(700, 100) and classes["b"] == Slo(5000, 30)


@pytest.mark.parametrize(
    "text, field",
    [
        ("[1, 2]", "slo_classes"),
        ("{not json", "slo_classes"),
        ("/nonexistent/classes.json", "slo_classes"),
        ('{"a": 5}', "a"),
        ('{"a": {}}', "a"),
        ('{"a": {"ttft_ms": 1, "ttf_ms": 2}}', "a.ttf_ms"),
        ('{"a": {"ttft_ms": -1}}', "a.ttft_ms"),
        ('{"a": {"tbt_ms": 0}}', "a.tbt_ms"),
        ('{"a": {"tbt_ms": true}}', "a.tbt_ms"),
        ('{"a": {"tbt_ms": "fast"}}', "a.tbt_ms"),
        ('{"": {"tbt_ms": 1}}', "slo_classes"),
    ],
)
def test_parse_rejects(text: str, field: str) -> None:
    with pytest.raises(SloError) as e:
        SloClasses.parse(text, DEFAULT)
    assert e.value.field == field and repr(field) in str(e.value)


def test_resolve_default_when_absent() -> None:
    assert resolve_slo(None, DEFAULT, CLASSES) == DEFAULT
    assert resolve_slo({}, DEFAULT, CLASSES) == DEFAULT


def test_resolve_class() -> None:
    assert resolve_slo({"slo_class": "interactive"}, DEFAULT, CLASSES) == Slo(1000, 50)


def test_explicit_keys_override_class() -> None:
    params = {"slo_class": "batch", "tbt_slo_ms": 200}
    assert resolve_slo(params, DEFAULT, CLASSES) == Slo(30000, 200)
    assert resolve_slo({"ttft_slo_ms": 250.5}, DEFAULT, CLASSES) == Slo(250.5, 100)


def test_numeric_strings_accepted() -> None:
    params = {"ttft_slo_ms": "250", "tbt_slo_ms": " 20.5 "}
    assert resolve_slo(params, DEFAULT, CLASSES) == Slo(250, 20.5)


def test_none_counts_as_absent() -> None:
    params = {"slo_class": None, "ttft_slo_ms": None, "tbt_slo_ms": 30}
    assert resolve_slo(params, DEFAULT, CLASSES) == Slo(5000, 30)


def test_other_keys_ignored() -> None:
    # SGLang and other plugins put their own keys in custom_params; bad values there are not ours.
    params = {"__req__": object(), "ttft_ms": -5, "priority": "x", "tbt_slo_ms": 60}
    assert resolve_slo(params, DEFAULT, CLASSES) == Slo(5000, 60)


@pytest.mark.parametrize("key", ["ttft_slo_ms", "tbt_slo_ms"])
@pytest.mark.parametrize(
    "value", [-1, 0, 0.0, -0.5, math.nan, math.inf, -math.inf, True, False, "fast", "", "nan",
              "inf", [100], {"ms": 1}, 10**400,
              # under 0.001 ms (1e-322 ms is 0.0 s, which the scheduler's views refuse by assertion)
              1e-322, 5e-324, 1e-4, "1e-322",
              # what a header refuses: "_" separators, non-ASCII digits
              "1_000", "\u0661\u0660\u0660\u0660"],
)
def test_bad_values_name_their_field(key: str, value: object) -> None:
    with pytest.raises(SloError) as e:
        resolve_slo({key: value}, DEFAULT, CLASSES)
    assert e.value.field == key and repr(key) in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("name", ["gold", "", "Interactive", 3, True, ["batch"]])
def test_bad_class_names_their_field(name: object) -> None:
    with pytest.raises(SloError) as e:
        resolve_slo({"slo_class": name}, DEFAULT, CLASSES)
    assert e.value.field == "slo_class"


def test_unknown_class_message_lists_known() -> None:
    with pytest.raises(SloError, match="interactive"):
        resolve_slo({"slo_class": "gold"}, DEFAULT, CLASSES)


def test_custom_params_must_be_a_mapping() -> None:
    with pytest.raises(SloError) as e:
        resolve_slo(["slo_class"], DEFAULT, CLASSES)  # type: ignore[arg-type]
    assert e.value.field == "custom_params"


@pytest.mark.parametrize("kw, field", [({"ttft_ms": 0, "tbt_ms": 1}, "ttft_ms"),
                                       ({"ttft_ms": 1, "tbt_ms": math.nan}, "tbt_ms"),
                                       ({"ttft_ms": 1e-322, "tbt_ms": 1}, "ttft_ms")])
def test_slo_validates(kw: dict[str, float], field: str) -> None:
    with pytest.raises(SloError) as e:
        Slo(**kw)
    assert e.value.field == field


def test_the_shortest_slo_has_positive_seconds() -> None:
    """The floor's SLO reaches the policy as a positive number of seconds (ReqView asserts > 0)."""
    from superinfer_sgl.rotasched.slo import MIN_SLO_MS

    slo = resolve_slo({"ttft_slo_ms": MIN_SLO_MS, "tbt_slo_ms": str(MIN_SLO_MS)}, DEFAULT, CLASSES)
    assert slo.ttft_s > 0 and slo.tbt_s > 0
