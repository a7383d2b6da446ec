"""`integration.views.rotatable` against SGLang's last batch: a request in an extend (prefill or
mixed) batch that may still be in flight is not rotatable; the batch's rows are read as an id set
built once per batch list, which follows SGLang's filtering (a new list) and merging (the list
extended) of that batch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fakes import FakeReq
from superinfer_sgl.integration.views import rotatable


def _req(rid: str) -> FakeReq:
    req = FakeReq(rid)
    req.kv.kv_allocated_len = 1 << 10
    return req


def _mode(name: str):  # noqa: ANN202
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return getattr(ForwardMode, name)


@pytest.mark.parametrize("mode", ["EXTEND", "MIXED"])
def test_rows_of_an_extend_batch_in_flight_are_not_rotatable(mode: str) -> None:
    a, b, c, d = (_req(r) for r in "abcd")
    last = SimpleNamespace(forward_mode=_mode(mode), reqs=[a, b])
    sched = SimpleNamespace(chunked_req=None, last_batch=last)
    assert [rotatable(sched, r) for r in (a, b, c)] == [False, False, True]
    last.reqs = [b]  # SGLang's filter_batch: a new list
    assert [rotatable(sched, r) for r in (a, b, c)] == [True, False, True]
    last.reqs.extend([c, d])  # merge_batch: the same list, extended
    assert [rotatable(sched, r) for r in (a, b, c, d)] == [True, False, False, False]
    sched.last_batch = SimpleNamespace(forward_mode=_mode(mode), reqs=[a, c, d])  # the next batch
    assert [rotatable(sched, r) for r in (a, b, c, d)] == [False, True, False, False]
    sched.last_batch = SimpleNamespace(forward_mode=_mode("DECODE"), reqs=[a, b, c, d])
    assert all(rotatable(sched, r) for r in (a, b, c, d))  # a decode batch writes only the last token
    sched.last_batch = None
    assert all(rotatable(sched, r) for r in (a, b, c, d))


def test_a_request_with_a_fields_equal_twin_is_told_apart() -> None:
    """Rows are matched by identity, as SGLang's requests compare (fakes compare by fields)."""
    a, twin = _req("a"), _req("a")
    assert a == twin
    sched = SimpleNamespace(chunked_req=None, last_batch=SimpleNamespace(forward_mode=_mode("EXTEND"), reqs=[a]))
    assert not rotatable(sched, a) and rotatable(sched, twin)
    assert not rotatable(SimpleNamespace(chunked_req=twin, last_batch=None), twin)  # mid-prefill
