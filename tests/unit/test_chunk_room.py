"""integration/chunk_room.py with fake SGLang objects: the next chunk of a split prompt is given
room (victims rotated out, then the chunk cut to what is free) instead of an allocation that fails
and kills the scheduler, as it did with --running-reserve 0.15 under overload (2026-11-29)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from superinfer_sgl.integration import chunk_room


def _req(rid: str, prompt: int, outputs: int = 0, computed: int = 0) -> Any:
    return SimpleNamespace(rid=rid, origin_input_ids=[1] * prompt, output_ids=[2] * outputs,
                           prefix_len=computed)


def _sched(free: int, evictable: int = 0, chunked: Any = None, page: int = 1) -> Any:
    cache = SimpleNamespace(supports_mamba=lambda: False, evictable_size=lambda: evictable)
    return SimpleNamespace(tree_cache=cache, chunked_req=chunked,
                           token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: free, page_size=page))


def test_the_next_chunk_is_what_is_left_of_the_prompt_up_to_the_chunk_size() -> None:
    long = _req("c", 1000, computed=900)
    assert chunk_room.next_chunk(_sched(0, chunked=long), 256) == 100
    assert chunk_room.next_chunk(_sched(0, chunked=_req("c", 1000, computed=100)), 256) == 256
    assert chunk_room.next_chunk(_sched(0), 256) == 0  # nothing chunked
    # a chunk of 100 beside 4 decode rows, a page of rounding each: 105 tokens; free + evictable 60
    assert chunk_room.shortfall(_sched(40, 20, long), 256, rows=4) == 45
    assert chunk_room.shortfall(_sched(400, 0, long), 256, rows=4) == 0
    assert chunk_room.shortfall(_sched(0), 256, rows=4) == 0


def test_the_step_s_chunk_is_cut_to_what_is_free() -> None:
    chunked = _req("c", 1000, computed=100)
    # mixed with 4 rows: SGLang's adder takes the rows off the size, so room + rows is handed over
    assert chunk_room.step_chunk(_sched(50, 0, chunked), 256, rows=4) == 45 + 4
    assert chunk_room.step_chunk(_sched(50, 0, chunked), 256, rows=0) == 49
    assert chunk_room.step_chunk(_sched(5000, 0, chunked), 256, rows=4) == 256  # it fits: as given
    assert chunk_room.step_chunk(_sched(50, 0, None), 256, rows=4) == 256  # nothing chunked
    assert chunk_room.step_chunk(_sched(50, 0, chunked), None, rows=4) is None  # chunking off
    # not one token free: SGLang's own path (the victims should have made room before this)
    assert chunk_room.step_chunk(_sched(3, 0, chunked), 256, rows=4) == 256


class _Rt:
    def __init__(self, sched: Any, order: list[str]) -> None:
        self.sched = sched
        self.sync = SimpleNamespace(rank=0)
        self.order = order
        self.broadcast = lambda obj: obj
        self.store = SimpleNamespace(prefetched={})


@pytest.fixture()
def ordered(monkeypatch: pytest.MonkeyPatch) -> None:
    # decode_shortage.victim_order lists only the requests it may rotate: not "pinned"
    monkeypatch.setattr(chunk_room, "victim_order", lambda rt, batch: [r for r in rt.order if r != "pinned"])


def test_victims_free_the_chunk_s_shortfall_in_the_shortage_order(ordered: None) -> None:
    running = [_req("a", 30, 10), _req("b", 60, 20), _req("pinned", 500), _req("d", 40)]
    batch = SimpleNamespace(reqs=running)
    chunked = _req("c", 1000, computed=100)
    # the next chunk 256 + 5 pages (4 rows and rounding) = 261 tokens against 100 free: 161 short
    rt = _Rt(_sched(100, 0, chunked), ["pinned", "b", "a", "d"])
    out = chunk_room.victims(rt, batch, [], [], 256, mixed=True)
    # "pinned" may not rotate; b frees 80 + its row, a 40 + its row: 122 < 161, then d 41
    assert [r.rid for r in out] == ["b", "a", "d"]
    rt = _Rt(_sched(150, 0, chunked), ["b", "a", "d"])  # unmixed: 257 - 150 = 107 short
    assert [r.rid for r in chunk_room.victims(rt, batch, [], [], 256, mixed=False)] == ["b", "a"]
    # this step's other rotations count; a resume's returning KV counts against
    assert chunk_room.victims(rt, batch, [running[1], running[0]], [], 256, mixed=False) == []
    assert [r.rid for r in chunk_room.victims(rt, batch, [running[1], running[0]], [_req("r", 20)], 256,
                                               mixed=False)] == ["d"]
    # nothing chunked, or it fits: nobody
    assert chunk_room.victims(_Rt(_sched(100), ["b"]), batch, [], [], 256, mixed=True) == []
    assert chunk_room.victims(_Rt(_sched(5000, 0, chunked), ["b"]), batch, [], [], 256, mixed=True) == []


def test_a_prefetched_resume_is_not_counted_twice(ordered: None) -> None:
    """A resume whose KV was prefetched already holds its slots (the free count has them out): it
    takes nothing more from the chunk's room, and nobody is rotated out for it."""
    running = [_req("a", 30, 10)]
    batch = SimpleNamespace(reqs=running)
    rt = _Rt(_sched(300, 0, _req("c", 1000, computed=100)), ["a"])  # 257 of 300 free: 43 to spare
    resumed = _req("r", 40, 10)
    assert [r.rid for r in chunk_room.victims(rt, batch, [], [resumed], 256, mixed=False)] == ["a"]
    rt.store.prefetched["r"] = object()
    assert chunk_room.victims(rt, batch, [], [resumed], 256, mixed=False) == []
