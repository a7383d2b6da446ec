"""The host pool's size on each scheduler (integration/startup.py): a lone scheduler keeps its
share of free RAM; with several schedulers on a node the share is split among them, and every TP
rank takes rank 0's figure (pools measured apart would differ, and a rank with fewer blocks would
refuse a rotation the others take)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.integration import startup

GIB = 2**30


@pytest.fixture
def free_ram(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(startup, "available_ram_bytes", lambda: 64 * GIB)


def _never(_: object) -> object:
    raise AssertionError("a lone scheduler broadcasts nothing")


def test_the_flag_wins(monkeypatch: pytest.MonkeyPatch, free_ram: None) -> None:
    monkeypatch.setattr(startup, "local_schedulers", lambda sched: (8, 8))
    assert startup.host_pool_gib(SimpleNamespace(), SuperInferConfig(rotary_pool_gb=3.0), _never) == 3.0


def test_a_lone_scheduler_keeps_its_share_of_free_ram(monkeypatch: pytest.MonkeyPatch, free_ram: None) -> None:
    monkeypatch.setattr(startup, "local_schedulers", lambda sched: (1, 1))
    assert startup.host_pool_gib(SimpleNamespace(), SuperInferConfig(), _never) is None  # HostKVPool's default


def test_tp_ranks_split_the_share_and_take_rank_0s_figure(monkeypatch: pytest.MonkeyPatch, free_ram: None) -> None:
    monkeypatch.setattr(startup, "local_schedulers", lambda sched: (4, 4))
    sent: list[object] = []

    def rank0(obj: object) -> object:
        sent.append(obj)
        return obj

    assert startup.host_pool_gib(SimpleNamespace(), SuperInferConfig(), rank0) == 0.25 * 64 / 4
    assert sent == [4.0]
    # another rank measured less free RAM (rank 0's pool was allocated first): rank 0's figure wins
    monkeypatch.setattr(startup, "available_ram_bytes", lambda: 40 * GIB)
    assert startup.host_pool_gib(SimpleNamespace(), SuperInferConfig(), lambda _: 4.0) == 4.0


def test_data_parallel_schedulers_split_the_share_without_a_broadcast(monkeypatch: pytest.MonkeyPatch,
                                                                      free_ram: None) -> None:
    monkeypatch.setattr(startup, "local_schedulers", lambda sched: (2, 1))  # --dp-size 2, no TP
    assert startup.host_pool_gib(SimpleNamespace(), SuperInferConfig(), _never) == 0.25 * 64 / 2


def test_local_schedulers_reads_sglangs_parallel_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    import sglang.srt.runtime_context as rc

    def par(**kw: object) -> SimpleNamespace:
        base = dict(tp_size=8, pp_size=1, dp_size=1, nnodes=1, enable_dp_attention=False)
        return SimpleNamespace(**{**base, **kw})

    for kw, want in [({}, (8, 8)), ({"nnodes": 2}, (4, 8)), ({"dp_size": 2, "tp_size": 2}, (4, 2)),
                     ({"dp_size": 4, "enable_dp_attention": True}, (8, 8)), ({"pp_size": 2, "nnodes": 2}, (8, 8))]:
        monkeypatch.setattr(rc, "get_parallel", lambda kw=kw: par(**kw))
        assert startup.local_schedulers(SimpleNamespace(tp_size=1)) == want, kw

    def unpublished() -> SimpleNamespace:
        raise ValueError("config namespace 'parallel' not published")

    monkeypatch.setattr(rc, "get_parallel", unpublished)
    assert startup.local_schedulers(SimpleNamespace(tp_size=2)) == (2, 2)
    assert startup.local_schedulers(SimpleNamespace()) == (1, 1)
