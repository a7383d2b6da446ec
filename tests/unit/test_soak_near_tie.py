"""scripts/soak.py's exactness verdict: a differing greedy sample passes only as a near-tie flip."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _soak():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("soak", ROOT / "scripts" / "soak.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module
    spec.loader.exec_module(module)
    return module


REF = [5, 6, 7, 8]
# per position: the reference's best two (logprob, token)
TOP2 = [[(-0.1, 5), (-3.0, 9)], [(-0.7, 6), (-0.705, 11)], [(-0.2, 7), (-2.0, 12)], [(-0.1, 8), (-4.0, 1)]]


def test_flip_to_the_runner_up_at_a_near_tie_is_a_tie() -> None:
    v = _soak().near_tie([5, 11, 2, 3], REF, TOP2)
    assert v["first_difference"] == 1 and v["near_tie"] is True
    assert abs(v["reference_top2_gap"] - 0.005) < 1e-9


def test_a_clear_choice_that_differs_is_not_a_tie() -> None:
    v = _soak().near_tie([5, 6, 12, 8], REF, TOP2)  # the runner-up, but 1.8 nats behind
    assert v["first_difference"] == 2 and v["near_tie"] is False


def test_a_token_other_than_the_runner_up_is_not_a_tie() -> None:
    assert _soak().near_tie([5, 4, 7, 8], REF, TOP2)["near_tie"] is False


def test_without_logprobs_or_past_the_end_it_is_not_a_tie() -> None:
    soak = _soak()
    assert soak.near_tie([5, 11, 7, 8], REF, [])["near_tie"] is False
    assert soak.near_tie([5, 6, 7], REF, TOP2)["near_tie"] is False  # shorter: differs at the end
