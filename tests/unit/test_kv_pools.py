"""KV pools DuplexKV must refuse, and paged pools it must rotate losslessly (issue 34, item 6).

Built on SGLang's own classes on a CPU: MHATokenToKVPool with an FP4 KV quant method (scale
buffers beside the codes), with SGLANG_USE_HND_KVCACHE (HND layout), and a paged allocator plus
RadixCache at page size 16 under the runtime's real rotation path.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from superinfer_sgl.duplexkv.device_pool import DevicePoolView, unsupported_reason
from superinfer_sgl.integration.kv_adapter import UnsupportedKVPool, device_pool_view

memory_pool = pytest.importorskip("sglang.srt.mem_cache.memory_pool")
PAGE = 16


def _pool(**kw: Any) -> Any:
    return memory_pool.MHATokenToKVPool(size=64, page_size=PAGE, dtype=torch.bfloat16, head_num=2, head_dim=32,
                                        layer_num=2, device="cpu", enable_memory_saver=False, **kw)


def test_a_plain_paged_pool_is_supported() -> None:
    pool = _pool()
    assert unsupported_reason(pool) is None
    view = device_pool_view(pool)
    assert view.rows == 64 + PAGE and view.layers == 2


def test_an_fp4_pool_with_scale_buffers_is_refused_with_a_clear_message() -> None:
    from sglang.srt.layers.quantization.fp4_kv_cache_quant_method import FP4MXBlock16KVCacheMethod

    pool = _pool(quant_method=FP4MXBlock16KVCacheMethod())
    assert pool.k_scale_buffer is not None  # the codes alone would lose their scales
    with pytest.raises(UnsupportedKVPool, match="^MHATokenToKVPool: .*scale buffers.*k_scale_buffer.*rotation is off"):
        device_pool_view(pool)
    with pytest.raises(ValueError, match="scale buffers"):
        DevicePoolView.from_sglang(pool)


def test_an_hnd_pool_reports_unsupported_instead_of_raising_elsewhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    pool = _pool()
    assert pool.kv_cache_layout == "hnd" and pool.k_buffer[0].dim() == 4
    with pytest.raises(UnsupportedKVPool, match="^MHATokenToKVPool: the 'hnd' KV layout .* is unsupported"):
        device_pool_view(pool)


def test_a_pool_without_per_layer_buffers_is_unsupported() -> None:
    with pytest.raises(UnsupportedKVPool, match="^SimpleNamespace: not a pool DuplexKV rotates"):
        device_pool_view(SimpleNamespace(kv_buffer=torch.empty(4)))
    bare = object.__new__(memory_pool.MHATokenToKVPool)  # the right class without its buffers
    bare.k_buffer = bare.v_buffer = None
    with pytest.raises(UnsupportedKVPool, match="no per-layer k_buffer/v_buffer lists"):
        device_pool_view(bare)


# ---- page size 16: rotation out and resume through SGLang's paged allocator and radix tree ----------
def _paged(h: Any, size: int) -> None:
    """Swap the harness's allocator and tree for SGLang's paged ones (page 16)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    kvcache = h.alloc.get_kvcache()
    alloc = PagedTokenToKVPoolAllocator(size, PAGE, torch.float32, "cpu", None, False)
    alloc.get_kvcache = lambda: kvcache  # type: ignore[attr-defined]
    tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                                      page_size=PAGE))
    h.alloc, h.tree = alloc, tree
    h.sched.token_to_kv_pool_allocator, h.sched.tree_cache = alloc, tree


@pytest.mark.parametrize("prompt,outputs", [(37, 9), (40, 9), (20, 2)])
def test_rotation_and_resume_are_lossless_at_page_16(monkeypatch: pytest.MonkeyPatch, prompt: int,
                                                      outputs: int) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from test_runtime_duplex import Harness

    size = 128
    h = Harness(monkeypatch, pool=size + PAGE)  # device rows: size + one reserved page (+1)
    if not hasattr(h.sched, "new_token_ratio_tracker"):  # SGLang's scheduler has one (the reserve reads it)
        h.sched.new_token_ratio_tracker = SimpleNamespace(current=1.0)
    _paged(h, size)
    other = h.run("a", 30, 5, pool_idx=1, page=PAGE)
    b = h.run("b", prompt, outputs, pool_idx=2, page=PAGE)
    h.step(rotate_out=("b",))
    assert "b" in h.rt.store.entries and h.rt.store.entries["b"].host_kv.num_tokens == prompt + outputs - 1
    # the freed pages go to someone else and get other bytes before b comes back
    filler = h.alloc.alloc(h.alloc.available_size() // PAGE * PAGE)
    for buf in (*h.dev.k_buffers, *h.dev.v_buffers):
        buf[filler] = torch.randn((len(filler), *buf.shape[1:]))
    h.alloc.free(filler)
    h.step(resume=("b",))
    assert "b" not in h.rt.store.entries and h.rt.store.resume_locks.keys() == {"b"}
    restored = (prompt + outputs - 1) // PAGE * PAGE  # a partial last page is recomputed by the extend
    tokens = (b.origin_input_ids + b.output_ids)[:restored]
    match = h.tree.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
    assert match.device_prefix_len == restored
    slots = h.tree.path_device_indices(match.last_device_node)
    assert all(torch.equal(x, y[:restored]) for x, y in zip(h.device_kv(slots), h.kv["b"], strict=True))
    assert torch.all(slots[::PAGE] % PAGE == 0)  # restored into whole pages
    assert other.rid not in h.rt.store.entries
