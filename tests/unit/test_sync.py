"""Tensor-parallel ranks agree on one LVF decision per iteration."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

import pytest

from superinfer_sgl.rotasched import (
    Decision,
    DecisionSync,
    ReqState,
    ReqView,
    VltParams,
    lvf_decide,
)


def _pair() -> tuple[DecisionSync, DecisionSync]:
    """Two ranks over a queue: rank 0 puts, rank 1 blocks until it gets."""
    channel: queue.Queue[object] = queue.Queue()

    def send(obj: object) -> object:
        channel.put(obj)
        return obj

    def receive(_: object) -> object:
        return channel.get(timeout=5)

    return DecisionSync(0, send), DecisionSync(1, receive)


def _decide_at(now: float) -> Decision:
    views = [
        ReqView("w", ReqState.WAITING, 0.0, None, None, 5.0, 0.1, 4, 0),
        ReqView("r", ReqState.RUNNING, 0.0, 0.5, 0.5, 5.0, 0.1, 0, 4),
    ]
    return lvf_decide(views, 0, 100, now, VltParams())


def test_ranks_agree_despite_different_clocks() -> None:
    rank0, rank1 = _pair()
    # At t=4 the waiting request has VLT 1.5 and displaces r; at t=2 it would not.
    assert not _decide_at(2.0).admit and _decide_at(4.0).admit
    calls: list[int] = []

    def fn1() -> Decision:
        calls.append(1)
        return _decide_at(2.0)

    got: dict[int, tuple[Decision, int]] = {}
    # each rank measured its own step times: rank 1's budget is a block under rank 0's
    t = threading.Thread(target=lambda: got.__setitem__(1, rank1.decide(fn1, 63)))
    t.start()
    got[0] = rank0.decide(lambda: _decide_at(4.0), 64)
    t.join(timeout=5)
    assert got[0] == got[1] == (_decide_at(4.0), 64)  # rank 0's decision and budget on both
    assert got[0][0].admit == ("w",) and got[0][0].rotate_out == ("r",)
    assert calls == []  # rank 1 never ran the policy


def _returning(d: Decision) -> Callable[[], Decision]:
    return lambda: d


def test_several_iterations_stay_in_step() -> None:
    rank0, rank1 = _pair()
    sent = [Decision(admit=(f"a{i}",), contention=True) for i in range(5)]
    for i, d in enumerate(sent):
        assert rank0.decide(_returning(d), i) == (d, i)
    assert [rank1.decide(lambda: pytest.fail("rank 1 called fn"), 99) for _ in sent] == list(zip(sent, range(5)))


def test_non_decision_payload_rejected() -> None:
    for garbage in ("garbage", Decision(), (Decision(), "64"), (Decision(), 1, 2)):
        rank1 = DecisionSync(1, lambda _, g=garbage: g)
        with pytest.raises(TypeError):
            rank1.decide(lambda: Decision())


def test_negative_rank_rejected() -> None:
    with pytest.raises(AssertionError):
        DecisionSync(-1, lambda obj: obj)
