"""ReqView's hand-written __init__ and vlts (both speed work) behave as before."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from superinfer_sgl.rotasched import ReqState, ReqView, VltParams, vlt
from superinfer_sgl.rotasched.vlt import vlts
from superinfer_sgl.rotasched.request_view import NO_LIMIT


def _running(**kw: object) -> ReqView:
    fields: dict[str, object] = dict(rid="a", state=ReqState.RUNNING, arrival=1.0, last_token=2.0,
                                     run_start=1.5, ttft_slo=5.0, tbt_slo=0.1, blocks_needed=0,
                                     blocks_held=3)
    fields.update(kw)
    return ReqView(**fields)  # type: ignore[arg-type]


def test_init_signature_is_the_dataclass_one() -> None:
    @dataclasses.dataclass(frozen=True, slots=True)
    class Generated:
        rid: str
        state: ReqState
        arrival: float
        last_token: float | None
        run_start: float | None
        ttft_slo: float
        tbt_slo: float
        blocks_needed: int
        blocks_held: int
        rotatable: bool = True
        prefill_tokens: int = 0
        misses_left: int = NO_LIMIT
        ttft_met: bool | None = None
        weight: float = 1.0
        outputs_left: int = 0
        outputs_known: bool = False

    ours = inspect.signature(ReqView.__init__).parameters
    theirs = inspect.signature(Generated.__init__).parameters
    assert [(p.name, p.default, p.kind) for p in ours.values()] == [
        (p.name, p.default, p.kind) for p in theirs.values()]
    assert [f.name for f in dataclasses.fields(ReqView)] == [f.name for f in dataclasses.fields(Generated)]


def test_fields_positional_keyword_default_and_frozen() -> None:
    v = _running()
    w = ReqView("a", ReqState.RUNNING, 1.0, 2.0, 1.5, 5.0, 0.1, 0, 3)
    assert v == w and hash(v) == hash(w) and v.rotatable is True
    assert (v.rid, v.state, v.arrival, v.last_token, v.run_start, v.ttft_slo, v.tbt_slo,
            v.blocks_needed, v.blocks_held) == ("a", ReqState.RUNNING, 1.0, 2.0, 1.5, 5.0, 0.1, 0, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        v.blocks_held = 4  # type: ignore[misc]
    assert dataclasses.replace(v, rotatable=False).rotatable is False
    assert pickle.loads(pickle.dumps(v)) == v
    assert "rid='a'" in repr(v)


@pytest.mark.parametrize("bad", [
    dict(rid=""), dict(arrival=float("nan")), dict(run_start=None), dict(blocks_needed=1),
    dict(ttft_slo=0.0), dict(tbt_slo=float("inf")), dict(blocks_held=-1),
    dict(state=ReqState.ROTARY, run_start=None, last_token=None, blocks_held=0, blocks_needed=1),
])
def test_validation_still_runs(bad: dict) -> None:
    with pytest.raises(AssertionError):
        _running(**bad)


def test_vlts_is_vlt_per_view_in_order() -> None:
    views = [
        _running(rid="run"),
        ReqView("wait", ReqState.WAITING, 90.0, None, None, 5.0, 0.1, 4, 0),
        ReqView("young", ReqState.WAITING, 99.9, None, None, 5.0, 0.1, 4, 0),
        ReqView("rot", ReqState.ROTARY, 80.0, 99.0, None, 5.0, 0.1, 4, 0),
        ReqView("again", ReqState.WAITING, 80.0, 99.95, None, 5.0, 0.1, 4, 0),
    ]
    for p in (VltParams(), VltParams(alpha=2.0, beta_ttft=0.0, beta_tbt=1.0)):
        got = vlts(views, 100.0, p)
        assert got == [vlt(v, 100.0, p) for v in views]
        assert got[0] == 1.5 - 100.0
        assert got[1] == max(0.0, 100.0 - 90.0 - p.beta_ttft * 5.0)
        assert got[2] == max(0.0, 100.0 - 99.9 - p.beta_ttft * 5.0)
        assert got[4] == (0.0 if p.beta_tbt else p.alpha * (100.0 - 99.95))
        assert got[3] == p.alpha * max(0.0, 100.0 - 99.0 - p.beta_tbt * 0.1)
    assert vlts([], 1.0, VltParams()) == []
