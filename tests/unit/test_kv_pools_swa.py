"""DuplexKV on SGLang's sliding-window pool (issue 37, item 3: SWAKVPool).

Built on SGLang 0.5.23's own classes on a CPU: SWAKVPool (two MHATokenToKVPool sub-pools), its
SWATokenToKVPoolAllocator (the full-to-window map), SGLang's own frees of a running request's
out-of-window rows (free_swa_segment, as free_swa_out_of_window_slots calls it) and of a released
request (free_kv_row_segments), and UnifiedRadixCache with its FULL and SWA components. A rotated-out
request keeps the full-attention rows of every token (moved by the engine) and the window rows of the
tokens still in its window only; a resume allocates full slots for every token and window rows for
the window only, the map 0 (SGLang's "no window row") for the rest, and inserts the prefix into the
tree with those tokens as window tombstones. Page size 1 and 16, float32 and bf16.
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest
import torch

from superinfer_sgl.duplexkv.engine import RotationEngine
from superinfer_sgl.duplexkv.host_pool import HostKVPool
from superinfer_sgl.duplexkv.pool_layout import (UnrotatablePool, WindowNotRestorable, layout_of, swa_layout_of,
                                                 swa_unsupported_reason, unsupported_reason, window_start)
from superinfer_sgl.integration.kv_adapter import SWAWindowRotation, UnsupportedKVPool, device_pool_view

swa_memory_pool = pytest.importorskip("sglang.srt.mem_cache.swa_memory_pool")
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator  # noqa: E402

SIZE, SIZE_SWA, HEADS, DIM = 256, 128, 2, 8
SWA_LAYERS, FULL_LAYERS = [0, 2, 3], [1]  # three window layers, one full-attention layer


def _pool(page: int, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    pool = swa_memory_pool.SWAKVPool(size=SIZE, size_swa=SIZE_SWA, page_size=page, dtype=dtype, head_num=HEADS,
                                     head_dim=DIM, swa_attention_layer_ids=SWA_LAYERS,
                                     full_attention_layer_ids=FULL_LAYERS, device="cpu", enable_memory_saver=False)
    alloc = SWATokenToKVPoolAllocator(SIZE, SIZE_SWA, page, dtype, "cpu", pool, need_sort=False)
    return pool, alloc


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _scribble(planes: list[torch.Tensor], rows: torch.Tensor) -> None:
    for p in planes:
        _bits(p)[rows] = torch.randint(0, 256, _bits(p)[rows].shape, dtype=torch.uint8)


def _planes(sub: Any) -> list[torch.Tensor]:
    return [*sub.k_buffer, *sub.v_buffer]


def _admit(alloc: Any, n: int) -> torch.Tensor:
    """A running request's slots the way SGLang's prefill allocates them (full and window rows)."""
    if alloc.page_size == 1:
        return alloc.alloc(n).to(torch.int64)
    pages = -(-n // alloc.page_size) * alloc.page_size
    t = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    return alloc.alloc_extend(t(0), t(0), t(pages), t(pages), t(-1), pages).to(torch.int64)


def _running(pool: Any, alloc: Any, n: int, evicted: int) -> torch.Tensor:
    """A request of n tokens whose rows hold random bits and whose window rows of tokens [0, evicted)
    SGLang has already freed (free_swa_out_of_window_slots' call)."""
    slots = _admit(alloc, n)
    _scribble(_planes(pool.full_kv_pool), slots)
    _scribble(_planes(pool.swa_kv_pool), alloc.full_to_swa_index_mapping[slots])
    if evicted:
        alloc.free_swa_segment(slots[:evicted], start_pos=0)
    return slots


def _release(alloc: Any, slots: torch.Tensor, evicted: int) -> None:
    """Free a request's row as SGLang's release does: [0, evicted) full side only."""
    from sglang.srt.mem_cache.common import free_kv_row_segments

    free_kv_row_segments(alloc, [(slots, 0)], swa_evicted_seqlen=evicted)


def _engine(rot: SWAWindowRotation, block_tokens: int = 4) -> RotationEngine:
    dev = rot.device_pool_view()
    host = HostKVPool(64, dev.layers, dev.kv_heads, dev.head_dim, block_tokens, dev.dtype, pin=False)
    return RotationEngine(dev, host, "torch")


# ---- the layout -------------------------------------------------------------------------------
def test_the_layout_names_both_sub_pools_and_the_engine_view_is_the_full_one() -> None:
    pool, alloc = _pool(1)
    layout = swa_layout_of(pool)
    assert layout.mapping is alloc.full_to_swa_index_mapping
    assert [p.data_ptr() for p in layout.full.k_planes] == [b.data_ptr() for b in pool.full_kv_pool.k_buffer]
    assert [p.data_ptr() for p in layout.window.v_planes] == [b.data_ptr() for b in pool.swa_kv_pool.v_buffer]
    assert layout.full.model_layers == len(FULL_LAYERS) and layout.window.model_layers == len(SWA_LAYERS)
    assert layout.window_row_bytes == len(SWA_LAYERS) * 2 * HEADS * DIM * 4
    assert swa_unsupported_reason(pool) is None
    view = SWAWindowRotation(alloc).device_pool_view()
    assert view.layers == len(FULL_LAYERS) and view.rows == SIZE + 1
    assert view.k_buffers[0].data_ptr() == pool.full_kv_pool.k_buffer[0].data_ptr()


def test_a_supported_pool_rotates_but_has_no_single_index_view() -> None:
    pool, _ = _pool(1)
    assert unsupported_reason(pool) is None  # not refused: the runtime drives its window side
    # one engine view over both sub-pools would drop the window layers: only the full one is a view
    with pytest.raises(UnsupportedKVPool, match="^SWAKVPool: .*no single-index layout.*SWAWindowRotation"):
        device_pool_view(pool)
    with pytest.raises(UnrotatablePool, match="no single-index layout"):
        layout_of(pool)


@pytest.mark.parametrize("attr,value,why", [
    ("swa_req_ring_size", 8, "per-request window ring"),
    ("full_layer_nums", 0, "all-sliding-window pool"),
    ("swa_uses_full_indices", True, "not addressed through the full-to-window map"),
    ("full_to_swa_index_mapping", None, "has not registered"),
])
def test_sliding_window_pools_it_cannot_rotate_are_named(attr: str, value: Any, why: str) -> None:
    pool, _ = _pool(1)
    setattr(pool, attr, value)
    assert why in swa_unsupported_reason(pool)
    with pytest.raises(UnrotatablePool, match=f"^SWAKVPool: .*{why}"):
        swa_layout_of(pool)
    assert why in unsupported_reason(pool)


def test_a_window_sub_pool_with_scale_buffers_is_refused() -> None:
    pool, _ = _pool(1)
    pool.swa_kv_pool.k_scale_buffer = [torch.empty(1)]  # an FP4-style window sub-pool
    assert "window sub-pool cannot rotate" in swa_unsupported_reason(pool)
    assert "scale buffers" in swa_unsupported_reason(pool)


# ---- which window rows a paused request keeps -----------------------------------------------------
@pytest.mark.parametrize("page", [1, 16])
def test_the_window_starts_after_the_rows_sglang_freed(page: int) -> None:
    pool, alloc = _pool(page)
    n, evicted = 70, 32
    slots = _running(pool, alloc, n, evicted)
    assert window_start(alloc.full_to_swa_index_mapping, slots, n, page) == evicted
    # SGLang's retention boundary for a window of 8 (floor_page(n - ceil_page(max(8, page)))) trims more
    expect = max(evicted, (n - -(-max(8, page) // page) * page) // page * page)
    assert window_start(alloc.full_to_swa_index_mapping, slots, n, page, retain=8) == expect > evicted
    # a window at least as wide as the request keeps what SGLang still holds
    assert window_start(alloc.full_to_swa_index_mapping, slots, n, page, retain=1000) == evicted


def test_a_hole_inside_the_window_is_not_saved() -> None:
    pool, alloc = _pool(1)
    slots = _running(pool, alloc, 20, 4)
    rot = SWAWindowRotation(alloc)
    alloc.free_swa(slots[10:11])  # a window row gone from the middle
    assert rot.window_start(slots, 20) == 11  # the live suffix starts after it
    from superinfer_sgl.duplexkv.pool_layout import save_window
    with pytest.raises(WindowNotRestorable, match="token 10 inside the window"):
        save_window(rot.layout, slots, 20, 4)


# ---- rotate out and back in over SGLang's real pool and allocator -----------------------------------
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("retain", [None, 20])
def test_round_trip_is_byte_exact_and_copies_only_the_window(page: int, dtype: torch.dtype,
                                                             retain: int | None) -> None:
    pool, alloc = _pool(page, dtype)
    n, evicted = 64, 16  # page-aligned: the runtime restores whole pages
    other = _running(pool, alloc, 30, 0)  # a neighbour whose rows must not change
    slots = _running(pool, alloc, n, evicted)
    rot = SWAWindowRotation(alloc, retain)
    engine = _engine(rot)
    mapping = alloc.full_to_swa_index_mapping
    full_before = [_bits(p[slots]).clone() for p in _planes(pool.full_kv_pool)]
    window_before = [_bits(p[mapping[slots[evicted:]]]).clone() for p in _planes(pool.swa_kv_pool)]
    neighbour = ([_bits(p[other]).clone() for p in _planes(pool.full_kv_pool)],
                 [_bits(p[mapping[other]]).clone() for p in _planes(pool.swa_kv_pool)])

    hk = engine.save(slots[:n])
    win = rot.save(slots, n)
    start = win.start
    assert start == (evicted if retain is None else max(evicted, (n - -(-max(retain, page) // page) * page)))
    # only the window's rows went to host: tokens before `start` left the window
    assert win.rows == n - start and win.nbytes == (n - start) * rot.layout.window_row_bytes
    assert engine.bytes_out == n * engine.host_pool.bytes_per_token  # full layers: every token
    _release(alloc, slots, evicted)
    assert alloc.full_available_size() == SIZE - _pages(30, page)
    assert alloc.swa_available_size() == SIZE_SWA - _pages(30, page)

    # everything free goes to someone else and gets other bytes before the request comes back
    filler = _admit(alloc, alloc.available_size() // page * page)
    _scribble(_planes(pool.full_kv_pool), filler)
    _scribble(_planes(pool.swa_kv_pool), mapping[filler])
    _release(alloc, filler, 0)

    new = rot.alloc(n, start)
    assert new is not None and not torch.equal(new, slots)
    engine.load(hk, new)
    rot.load(win, new)
    for i, p in enumerate(_planes(pool.full_kv_pool)):
        assert torch.equal(_bits(p[new]), full_before[i]), i
    for i, p in enumerate(_planes(pool.swa_kv_pool)):
        assert torch.equal(_bits(p[mapping[new[start:]]]), window_before[i][start - evicted:]), i
    # the rows that left the window have no window row after the resume either
    assert torch.all(mapping[new[:start]] == 0) and torch.all(mapping[new[start:]] > 0)
    assert alloc.swa_available_size() == SIZE_SWA - _pages(30, page) - (n - start)
    for i, p in enumerate(_planes(pool.full_kv_pool)):
        assert torch.equal(_bits(p[other]), neighbour[0][i])
    for i, p in enumerate(_planes(pool.swa_kv_pool)):
        assert torch.equal(_bits(p[mapping[other]]), neighbour[1][i])
    # SGLang's own release of a row evicted up to `start` gives back exactly what the resume took
    _release(alloc, new, start)
    _release(alloc, other, 0)
    assert alloc.full_available_size() == SIZE and alloc.swa_available_size() == SIZE_SWA
    assert torch.all(mapping[:-1] == 0)
    engine.free(hk)
    assert engine.host_pool.allocator.num_free == engine.host_pool.num_blocks


def _pages(n: int, page: int) -> int:
    return -(-n // page) * page


@pytest.mark.parametrize("page", [1, 16])
def test_a_resume_that_does_not_fit_takes_nothing_and_free_gives_back_everything(page: int) -> None:
    pool, alloc = _pool(page)
    rot = SWAWindowRotation(alloc)
    n = 48
    assert rot.alloc(n, 0) is not None  # 48 window rows
    hog = _admit(alloc, (SIZE_SWA - n) // page * page)  # the window pool is now full, the full one is not
    full_free, window_free = alloc.full_available_size(), alloc.swa_available_size()
    assert rot.alloc(n, n - page) is None  # one page of window rows does not fit: nothing taken
    assert (alloc.full_available_size(), alloc.swa_available_size()) == (full_free, window_free)
    got = rot.alloc(n, n)  # no window rows: fits
    assert got is not None and torch.all(alloc.full_to_swa_index_mapping[got] == 0)
    rot.free(got, n)
    _release(alloc, hog, 0)
    with pytest.raises(ValueError, match="page-aligned"):
        rot.alloc(n, 8 if page > 8 else 0) if page > 1 else rot.alloc(n, n + 1)


# ---- the resume through SGLang's radix tree (UnifiedRadixCache: FULL + SWA components) --------------
@pytest.mark.parametrize("page", [1, 16])
def test_a_restored_prefix_matches_with_its_window_and_tombstones_before_it(page: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    window = 8
    pool, alloc = _pool(page)
    tree = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=page,
        sliding_window_size=window, tree_components=(ComponentType.FULL, ComponentType.SWA)))
    n, evicted = 64, 32
    slots = _running(pool, alloc, n, evicted)
    rot = SWAWindowRotation(alloc, tree.sliding_window_size)
    engine = _engine(rot)
    hk, win = engine.save(slots), rot.save(slots, n)
    start = win.start
    assert start == max(evicted, (n - _pages(max(window, page), page)) // page * page)
    window_before = [_bits(p[alloc.full_to_swa_index_mapping[slots[start:]]]).clone()
                     for p in _planes(pool.swa_kv_pool)]
    _release(alloc, slots, evicted)
    new = rot.alloc(n, start)
    engine.load(hk, new)
    rot.load(win, new)
    key = RadixKey(array("q", range(1000, 1000 + n)))
    tree.insert(rot.insert_params(key, new, start))
    match = tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", range(1000, 1000 + n)))))
    assert match.device_prefix_len == n  # admission takes the whole restored prefix
    assert torch.equal(tree.path_device_indices(match.last_device_node).to(torch.int64), new)
    assert tree.full_evictable_size() == n and tree.swa_evictable_size() == n - start
    for i, p in enumerate(_planes(pool.swa_kv_pool)):  # the window a resumed decode reads
        assert torch.equal(_bits(p[alloc.full_to_swa_index_mapping[new[start:]]]), window_before[i])
    # the tree owns the restored rows now; evicting them gives every row back (no window row freed twice)
    tree.evict(EvictParams(num_tokens=n, swa_num_tokens=n))
    assert alloc.full_available_size() == SIZE and alloc.swa_available_size() == SIZE_SWA
    engine.free(hk)


def test_without_the_window_boundary_the_tree_would_claim_window_rows_that_do_not_exist() -> None:
    """Why the resume inserts with `insert_params`: a plain insert of the same slots makes SGLang's
    tree count a window row for every token, the padding row 0 for those that left the window."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    pool, alloc = _pool(1)
    tree = UnifiedRadixCache(CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1,
        sliding_window_size=8, tree_components=(ComponentType.FULL, ComponentType.SWA)))
    rot = SWAWindowRotation(alloc, 8)
    n, start = 64, 48
    new = rot.alloc(n, start)
    tree.insert(InsertParams(key=RadixKey(array("q", range(n))), value=new, prev_prefix_len=0))
    assert tree.swa_evictable_size() == n != n - start
    assert torch.all(alloc.full_to_swa_index_mapping[new[:start]] == 0)  # 48 of them point at row 0
