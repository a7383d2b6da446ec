"""Sliding-window pools through the runtime's real rotation path (issue 37, item 3: SWAKVPool).

The runtime (`RotaSchedRuntime`, scripted decisions: test_runtime_duplex.Harness) on SGLang 0.5.23's
own SWAKVPool, SWATokenToKVPoolAllocator and UnifiedRadixCache (FULL + SWA components), on a CPU at
page size 1 and 16: a request rotates out (window rows saved before its release, SGLang's release
of a row whose window was partly freed), its slots get other bytes, it resumes (full slots for every
token, window rows for its window only, the window loaded after the engine's copies, the prefix
inserted with SGLang's SWA evicted length), and every full-attention row and every in-window row is
byte-identical, tokens that left the window have no window row, the tree matches the whole restored
prefix, the KV byte check passes, and evicting the tree gives every slot of both sub-pools back.
Also: the startup opens the engine on the full-attention sub-pool, a prefetch (used and cancelled),
an abort while rotary, and a hole inside the window falling back to recompute.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from superinfer_sgl.config import SuperInferConfig
from superinfer_sgl.duplexkv.host_pool import HostKVPool
from superinfer_sgl.integration import kv_adapter, rotation
from superinfer_sgl.integration.kv_adapter import SWAWindowRotation, window_rotation
from superinfer_sgl.integration.startup import open_engine

pytest.importorskip("sglang.srt.mem_cache.swa_memory_pool")
from test_kv_pools_swa import DIM, FULL_LAYERS, HEADS, SIZE, SIZE_SWA, _admit, _bits, _planes, _pool, _scribble  # noqa: E402

WINDOW = 8  # the tree's swa_retain_window


def _tree(alloc: Any, page: int) -> Any:
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page,
        sliding_window_size=WINDOW, tree_components=(ComponentType.FULL, ComponentType.SWA)))


def _boundary(n: int, page: int) -> int:
    """Where SGLang's own free of a running request's window rows stops (free_swa_out_of_window_slots)."""
    return max(0, n - -(-max(WINDOW, page) // page) * page) // page * page


class SWAHarness:
    """test_runtime_duplex.Harness with SGLang's SWA pool, allocator and tree swapped in, and
    release_req replaced by SGLang's own row free for a request whose window rows of [0, evicted)
    it already freed (free_kv_row_segments, as release_kv_cache -> free_kv_row does)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, page: int, **cfg: Any) -> None:
        import test_runtime_duplex as trd

        self.page = page
        self.pool, self.alloc = _pool(page)
        self.tree = _tree(self.alloc, page)
        self.sched_view = SimpleNamespace(token_to_kv_pool_allocator=self.alloc, tree_cache=self.tree)
        self.rot = window_rotation(self.sched_view)
        assert self.rot is not None and self.rot.retain == WINDOW
        view = self.rot.device_pool_view()
        monkeypatch.setattr(trd, "DevicePoolView", SimpleNamespace(synthetic=lambda *a, **k: view))
        monkeypatch.setattr(trd, "HostKVPool", lambda blocks, *a, pin, store_dtype: HostKVPool(
            blocks, view.layers, view.kv_heads, view.head_dim, trd.BT, view.dtype, pin=False))
        self.h = h = trd.Harness(monkeypatch, pool=SIZE, host_blocks=64, **cfg)
        h.sched.new_token_ratio_tracker = SimpleNamespace(current=1.0)
        h.alloc, h.tree = self.alloc, self.tree
        h.sched.token_to_kv_pool_allocator, h.sched.tree_cache = self.alloc, self.tree
        import sglang.srt.managers.schedule_batch as sb

        monkeypatch.setattr(sb, "release_req", self._release)

    def _release(self, *, req: Any, req_to_token_pool: Any, **_: Any) -> None:
        from sglang.srt.mem_cache.common import free_kv_row_segments

        row = req_to_token_pool.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len].to(torch.int64)
        hole = self.alloc.full_to_swa_index_mapping[row[req.kv.swa_evicted:]] <= 0
        if bool(hole.any()):  # the hole test's row (SGLang never leaves one): free what is there
            self.alloc.free_swa(row[req.kv.swa_evicted:][~hole])
            self.alloc.free_full(row)
        else:
            free_kv_row_segments(self.alloc, [(row, 0)], swa_evicted_seqlen=req.kv.swa_evicted)
        req.kv.holds_kv = False

    def run(self, rid: str, prompt: int, outputs: int, pool_idx: int) -> Any:
        """A running request on whole pages, random bits in both sub-pools, whose window rows below
        SGLang's retention boundary SGLang has already freed."""
        from fakes import FakeReq, sampling

        n = prompt + outputs
        slots = _admit(self.alloc, n)
        _scribble(_planes(self.pool.full_kv_pool), slots)
        _scribble(_planes(self.pool.swa_kv_pool), self.alloc.full_to_swa_index_mapping[slots])
        evicted = _boundary(n - 1, self.page)  # SGLang's decode frees for pre_len = seqlen - 1
        if evicted:
            self.alloc.free_swa_segment(slots[:evicted], start_pos=0)
        self.h.sched.req_to_token_pool.req_to_token[pool_idx, : len(slots)] = slots.to(torch.int32)
        kv = SimpleNamespace(req_pool_idx=pool_idx, holds_kv=True, kv_allocated_len=len(slots), swa_evicted=evicted)
        # SGLang's Req keeps token ids as array('q') (its unified tree asserts it)
        req = FakeReq(rid, array("q", range(100, 100 + prompt)), array("q", range(outputs)), kv,
                      sampling(max_new_tokens=0))
        self.h.batch.reqs.append(req)
        return req

    def slots(self, req: Any, n: int) -> torch.Tensor:
        return self.h.sched.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :n].to(torch.int64)

    def full_rows(self, slots: torch.Tensor) -> list[torch.Tensor]:
        return [_bits(p[slots]).clone() for p in _planes(self.pool.full_kv_pool)]

    def window_rows(self, slots: torch.Tensor) -> list[torch.Tensor]:
        rows = self.alloc.full_to_swa_index_mapping[slots]
        assert torch.all(rows > 0)
        return [_bits(p[rows]).clone() for p in _planes(self.pool.swa_kv_pool)]

    def overwrite_free(self) -> None:
        """Everything free goes to someone else and gets other bytes, then is freed again."""
        filler = _admit(self.alloc, self.alloc.available_size() // self.page * self.page)
        _scribble(_planes(self.pool.full_kv_pool), filler)
        _scribble(_planes(self.pool.swa_kv_pool), self.alloc.full_to_swa_index_mapping[filler])
        from sglang.srt.mem_cache.common import free_kv_row_segments

        free_kv_row_segments(self.alloc, [(filler, 0)], swa_evicted_seqlen=0)

    def sizes(self) -> tuple[int, int]:
        return self.alloc.full_available_size(), self.alloc.swa_available_size()

    def release(self, req: Any) -> None:
        self._release(req=req, req_to_token_pool=self.h.sched.req_to_token_pool)

    def evict_all(self) -> None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.tree.evict(EvictParams(num_tokens=SIZE, swa_num_tokens=SIZE))


# ---- rotate out, overwrite, resume: byte-identical, tree and pools consistent -----------------------
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("prompt,outputs", [(40, 9), (37, 9)])  # 48 restorable tokens; 45 (a partial page at 16)
def test_swa_rotation_and_resume_through_the_runtime(monkeypatch: pytest.MonkeyPatch, page: int, prompt: int,
                                                      outputs: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    s = SWAHarness(monkeypatch, page, verify_rotation=True)
    h = s.h
    other = s.run("a", 30, 5, pool_idx=1)
    sizes_with_a = s.sizes()
    b = s.run("b", prompt, outputs, pool_idx=2)
    n = prompt + outputs - 1  # restorable: the last output token is recomputed
    slots = s.slots(b, n)
    start = s.rot.window_start(slots, n)
    assert start == max(b.kv.swa_evicted, _boundary(n, page)) and start < n  # the window is live
    full_before, window_before = s.full_rows(slots), s.window_rows(slots[start:])
    live = s.slots(other, 35)[other.kv.swa_evicted:]  # the neighbour's own window
    neighbour = (s.full_rows(s.slots(other, 35)), s.window_rows(live))

    h.step(rotate_out=("b",))
    entry = h.rt.store.entries["b"]
    assert entry.host_kv.num_tokens == n and entry.window is not None
    assert (entry.window.start, entry.window.num_tokens, entry.window.rows) == (start, n, n - start)
    assert entry.window.nbytes == (n - start) * s.rot.layout.window_row_bytes  # only the window went to host
    assert s.sizes() == sizes_with_a  # b's full slots and window rows are all back
    digest = h.rt.store.digests["b"]

    s.overwrite_free()
    h.step(resume=("b",))
    assert "b" not in h.rt.store.entries and h.rt.store.resume_locks.keys() == {"b"}
    restored = n // page * page  # a partial last page is recomputed by the extend
    kept = min(start, restored)  # first restored token with a window row
    tokens = (b.origin_input_ids + b.output_ids)[:restored]
    match = h.tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    assert match.device_prefix_len == restored  # admission takes the whole restored prefix
    new = h.tree.path_device_indices(match.last_device_node).to(torch.int64)
    assert not torch.equal(new, slots[:restored])
    for got, want in zip(s.full_rows(new), full_before, strict=True):  # every full-attention row
        assert torch.equal(got, want[:restored])
    mapping = s.alloc.full_to_swa_index_mapping
    assert torch.all(mapping[new[:kept]] == 0)  # out-of-window tokens have no window row
    for got, want in zip(s.window_rows(new[kept:]), window_before, strict=True):  # every in-window row
        assert torch.equal(got, want[: restored - kept])
    assert s.tree.full_evictable_size() == 0 and s.tree.swa_evictable_size() == 0  # under our lock
    assert s.tree.full_protected_size() == restored and s.tree.swa_protected_size() == restored - kept
    for got, want in zip((s.full_rows(s.slots(other, 35)), s.window_rows(live)), neighbour):
        assert all(torch.equal(x, y) for x, y in zip(got, want, strict=True))  # the neighbour is untouched

    # SGLang admits b: its row starts with the matched prefix; the KV byte check reads it back
    h.sched.req_to_token_pool.req_to_token[2, :restored] = new.to(torch.int32)
    b.prefix_len = restored
    h.rt.store.unlock_admitted([b])
    stats = h.rt.stats
    if restored == n:
        assert (stats.kv_verified, stats.kv_mismatches, stats.kv_unverified) == (1, 0, 0)
        # the check reads the window layers: one changed in-window row would be reported
        row = mapping[new[n - 1]]
        s.pool.swa_kv_pool.k_buffer[0][row] += 1.0
        assert kv_adapter.device_kv_digest(h.sched, b, n) != digest[1]
    else:
        assert (stats.kv_verified, stats.kv_mismatches, stats.kv_unverified) == (0, 0, 1)
    assert rotation.same_kv(h.sched, new, new.clone(), kept)
    assert h.rt.store.resume_locks == {} and s.tree.full_evictable_size() == restored

    # the tree owns the restored rows: evicting it and releasing the neighbour returns both sub-pools
    s.evict_all()
    s.release(other)
    assert s.sizes() == (SIZE, SIZE_SWA) and torch.all(mapping[:-1] == 0)
    h.rt.store.forget("b")  # b finishes: its mirror (the restored blocks) goes too
    assert h.engine.host_pool.allocator.num_used == 0


def test_the_startup_opens_the_engine_on_the_full_attention_sub_pool() -> None:
    from superinfer_sgl.integration import handshake

    pool, alloc = _pool(16)
    sched = SimpleNamespace(tree_cache=_tree(alloc, 16), token_to_kv_pool_allocator=alloc)
    setup = open_engine(sched, SuperInferConfig(rotary_pool_gb=0.001, rotation_budget_blocks=4))
    assert setup.engine is not None and setup.disabled_reason is None
    # the host block holds the full-attention layers only (the window rows travel in HostWindow)
    assert setup.engine.host_pool.bytes_per_token == len(FULL_LAYERS) * 2 * HEADS * DIM * 4
    (_, report, _), *_ = handshake.hooks(SuperInferConfig(), ["x"])
    sched.tp_rank, sched._superinfer = 0, SimpleNamespace(engine=setup.engine, disabled_reason=None)
    info = report({}, sched)[handshake.INIT_INFO_KEY]
    assert info["kv_pool"] == "SWAKVPool" and info["rotation"].startswith("on")


def test_a_tree_without_a_window_component_is_refused_by_name() -> None:
    _, alloc = _pool(1)
    tree = SimpleNamespace(disable=False, supports_prefix_sharing=lambda: True, supports_swa=lambda: False)
    setup = open_engine(SimpleNamespace(tree_cache=tree, token_to_kv_pool_allocator=alloc),
                        SuperInferConfig(rotary_pool_gb=0.001, rotation_budget_blocks=4))
    assert setup.engine is None and setup.disabled_reason.startswith("SWAKVPool: the radix tree")


# ---- prefetch, abort, recompute ----------------------------------------------------------------
@pytest.mark.parametrize("page", [1, 16])
def test_a_prefetched_resume_loads_the_window_and_a_cancelled_one_frees_both_sub_pools(
        monkeypatch: pytest.MonkeyPatch, page: int) -> None:
    s = SWAHarness(monkeypatch, page, prefetch=False)
    h = s.h
    b = s.run("b", 40, 9, pool_idx=2)
    n = 48
    slots = s.slots(b, n)
    start = s.rot.window_start(slots, n)
    full_before, window_before = s.full_rows(slots), s.window_rows(slots[start:])
    h.step(rotate_out=("b",))
    entry = h.rt.store.entries["b"]
    free = s.sizes()
    # a wrong guess: its slots (full for every token, window rows for the window only) go back
    p = rotation.prefetch(h.sched, h.engine, rotation.incoming(entry, page))
    assert p is not None and p.window_start == start
    assert s.sizes() == (free[0] - n, free[1] - (n - start))
    h.rt.store.prefetched["b"] = p
    h.rt.store.drop_prefetch("b")
    assert s.sizes() == free and h.rt.stats.prefetch_cancelled == 1
    # a right one: the resume takes its slots and loads the window rows into them
    s.overwrite_free()
    h.rt.store.prefetched["b"] = rotation.prefetch(h.sched, h.engine, rotation.incoming(entry, page))
    h.step(resume=("b",))
    assert h.rt.stats.prefetch_hits == 1 and "b" not in h.rt.store.entries
    new = h.rt.store.prefetched.get("b")
    assert new is None
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    match = s.tree.match_prefix(MatchPrefixParams(key=RadixKey((b.origin_input_ids + b.output_ids)[:n])))
    got = s.tree.path_device_indices(match.last_device_node).to(torch.int64)
    assert match.device_prefix_len == n
    assert all(torch.equal(x, y) for x, y in zip(s.full_rows(got), full_before, strict=True))
    assert all(torch.equal(x, y) for x, y in zip(s.window_rows(got[start:]), window_before, strict=True))
    h.rt.store.unlock_admitted([SimpleNamespace(rid="b")])
    s.evict_all()
    assert s.sizes() == (SIZE, SIZE_SWA)


@pytest.mark.parametrize("page", [1, 16])
def test_an_abort_while_rotary_drops_its_window_and_leaks_nothing(monkeypatch: pytest.MonkeyPatch, page: int) -> None:
    s = SWAHarness(monkeypatch, page)
    h = s.h
    other, b = s.run("a", 30, 5, pool_idx=1), s.run("b", 40, 9, pool_idx=2)
    h.step(rotate_out=("b",))
    entry = h.rt.store.entries["b"]
    assert entry.window is not None
    h.rt.before_abort(SimpleNamespace(abort_all=False, rid="b"))
    assert h.rt.store.entries == {} and h.rt.stats.aborted_rotary == 1 and entry.window is None
    assert b in h.sched.waiting_queue  # SGLang's own abort path finds it there
    assert h.engine.host_pool.allocator.num_used == 0
    s.release(other)
    assert s.sizes() == (SIZE, SIZE_SWA)


def test_a_hole_inside_the_window_falls_back_to_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    s = SWAHarness(monkeypatch, 1)
    h = s.h
    b = s.run("b", 40, 9, pool_idx=2)
    hole = s.slots(b, 48)[45:46]
    s.alloc.free_swa(hole)  # a window row gone from inside the window (SGLang never does this)
    with pytest.raises(Exception, match="inside the window"):
        s.rot.save(s.slots(b, 48), 48)
    h.step(rotate_out=("b",))
    assert h.rt.store.entries == {} and h.rt.stats.recompute_fallbacks == 1 and h.requeued == [b]
    assert b.kv.holds_kv is False  # released as SGLang's retraction does
    assert h.engine.host_pool.allocator.num_used == 0


def test_other_pools_have_no_window_side() -> None:
    from test_runtime_duplex import FakeAllocator

    assert window_rotation(SimpleNamespace(token_to_kv_pool_allocator=FakeAllocator(8))) is None
    _, alloc = _pool(1)
    assert isinstance(window_rotation(SimpleNamespace(token_to_kv_pool_allocator=alloc, tree_cache=None)),
                      SWAWindowRotation)


def test_the_single_request_rotate_out_keeps_the_window_or_leaves_the_request_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = SWAHarness(monkeypatch, 1)
    h = s.h
    b, c = s.run("b", 40, 9, pool_idx=2), s.run("c", 40, 9, pool_idx=3)
    entry = rotation.rotate_out(h.sched, b, h.engine, now=0.0)
    assert entry is not None and entry.window is not None and entry.window.rows == 48 - entry.window.start
    s.alloc.free_swa(s.slots(c, 48)[45:46])  # a hole inside c's window
    assert rotation.rotate_out(h.sched, c, h.engine, now=0.0) is None and c.kv.holds_kv  # nothing changed
