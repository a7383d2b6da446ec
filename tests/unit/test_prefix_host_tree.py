"""Host demotion and restore on SGLang's own radix tree (UnifiedRadixCache, Python tree core) over
SGLang's real allocators and MHATokenToKVPool on the CPU, with our hooks wrapped around the real
methods for the test (integration/tree_replay.HookedTreeCore, as SGLang's HookRegistry does in the
server): the KV rows a restore writes are byte-identical to the rows that were demoted, at page
size 1 and 4, through chains and partial restores; the tree's sizes stay consistent; no host block
leaks; unsupported trees and pools are refused with a reason."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

warnings.filterwarnings("ignore", category=UserWarning)
torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache")

from superinfer_sgl.integration.tree_replay import HookedTreeCore, kv_pool  # noqa: E402

SYSTEM = list(range(1000, 1040))  # a shared 40-token system prompt
_UNDO: list[HookedTreeCore] = []


@pytest.fixture(autouse=True)
def _restore_tree_core():  # noqa: ANN202
    yield
    while _UNDO:
        _UNDO.pop().__exit__(None, None, None)


def _cache(pool_tokens: int = 120, host_tokens: int = 400, page: int = 1, min_score: float | None = 0.0,
           layers: int = 2, heads: int = 2, head_dim: int = 4) -> Any:
    """A tree over a real pool whose every byte is random (NaN payloads included)."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    _UNDO.append(HookedTreeCore(host_tokens, min_score).__enter__())
    pool = kv_pool(pool_tokens, page, layers, heads, head_dim)
    gen = torch.Generator().manual_seed(7)
    for b in (*pool.k_buffer, *pool.v_buffer):
        b.view(torch.uint8).copy_(torch.randint(0, 256, b.view(torch.uint8).shape, generator=gen, dtype=torch.uint8))
    if page == 1:
        alloc = TokenToKVPoolAllocator(pool_tokens, torch.float32, "cpu", pool, False)
    else:
        alloc = PagedTokenToKVPoolAllocator(pool_tokens, page, torch.float32, "cpu", pool, False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                             page_size=page, tree_components=(ComponentType.FULL,))
    params.tree_core_backend = "python"
    cache = UnifiedRadixCache(params)
    cache._alloc, cache._pool = alloc, pool
    ticks = iter(range(10**9))
    cache.tree_core._superinfer_prefix.clock = lambda: next(ticks) * 0.01
    return cache


def _host(cache: Any) -> Any:
    return cache.tree_core._superinfer_prefix.host


def _req(rid: str) -> Any:
    return SimpleNamespace(rid=rid, session=None, extra_key=None,
                           sampling_params=SimpleNamespace(custom_params={"slo_class": "interactive"}))


def _match(cache: Any, ids: list[int], rid: str | None = None) -> Any:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return cache.match_prefix(MatchPrefixParams(key=RadixKey(list(ids)), req=_req(rid) if rid else None))


def _serve(cache: Any, ids: list[int], rid: str) -> int:
    """Match (restoring what continues the match), lock, evict until the rest fits, insert, unlock:
    a request served and cached as SGLang's scheduler does. Returns the matched length."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    m = _match(cache, ids, rid)
    lock = cache.inc_lock_ref(m.last_device_node)
    need = len(ids) - len(ids) % cache.page_size
    if cache._alloc.available_size() < need:
        cache.evict(EvictParams(num_tokens=need - cache._alloc.available_size()))
    new = cache._alloc.alloc(need)
    assert new is not None
    cache.insert(InsertParams(key=RadixKey(list(ids[:need])), value=new.to(torch.int64)))
    cache.dec_lock_ref(m.last_device_node, lock.to_dec_params())
    return m.device_prefix_len


def _rows(cache: Any, ids: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The device slots the tree holds for `ids` and their raw bytes, every layer, K and V."""
    core = cache.tree_core
    m = _match(cache, ids)
    assert m.device_prefix_len == len(ids)
    slots = core.collect_full_device_indices(m.last_device_node, core.root_node.id)
    return slots, [b[slots].view(torch.uint8).clone() for b in (*cache._pool.k_buffer, *cache._pool.v_buffer)]


def _evict_all(cache: Any) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache.evict(EvictParams(num_tokens=cache.evictable_size()))
    assert cache.evictable_size() == 0


def _scribble(cache: Any, slots: torch.Tensor) -> None:
    for b in (*cache._pool.k_buffer, *cache._pool.v_buffer):
        b.view(torch.uint8)[slots] = 0xAB  # the freed rows are someone else's now


def _consistent(cache: Any) -> None:
    """SGLang's own tree invariants, our host tier's, and every device slot accounted for."""
    cache.sanity_check()
    _host(cache).check()
    alloc = cache._alloc
    assert alloc.available_size() + cache.evictable_size() + cache.protected_size() == alloc.size


@pytest.mark.parametrize("page", [1, 4])
def test_a_demoted_prefix_comes_back_byte_identical(page: int) -> None:
    cache = _cache(page=page)
    host = _host(cache)
    for i in range(3):
        _serve(cache, SYSTEM + [5000 + 10 * i + k for k in range(page)], f"u{i}")
    slots, before = _rows(cache, SYSTEM)
    _evict_all(cache)
    assert host.store.demoted >= 1 and len(host.store) >= 1
    _scribble(cache, slots)
    _consistent(cache)
    assert _serve(cache, SYSTEM + [9] * page, "back") == len(SYSTEM)  # the request's match includes it
    assert host.store.restored_tokens >= len(SYSTEM)
    new_slots, after = _rows(cache, SYSTEM)
    assert not torch.equal(new_slots, slots) or page > 1  # restored elsewhere (page 1: the pool moved on)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    _consistent(cache)


def test_a_parent_demoted_after_its_child_comes_back_with_it() -> None:
    cache = _cache()
    host = _host(cache)
    tail = list(range(2000, 2020))
    _serve(cache, SYSTEM + tail, "a")
    _serve(cache, SYSTEM + [7, 8], "b")  # splits SYSTEM off: SYSTEM -> {tail, [7, 8]}
    _, before = _rows(cache, SYSTEM + tail)
    _evict_all(cache)  # leaves first, then SYSTEM: both demoted, the tail's entry under SYSTEM's node
    assert host.store.demoted >= 3
    assert _match(cache, SYSTEM + tail + [1], "c").device_prefix_len == len(SYSTEM) + len(tail)
    _, after = _rows(cache, SYSTEM + tail)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert host.store.restored >= 2
    _consistent(cache)


def test_a_partial_match_restores_the_shared_pages_only() -> None:
    cache = _cache()
    host = _host(cache)
    own = list(range(3000, 3010))
    _serve(cache, SYSTEM + own, "a")  # one leaf: SYSTEM + own
    _, before = _rows(cache, SYSTEM)
    _evict_all(cache)
    assert _match(cache, SYSTEM + [1, 2, 3], "b").device_prefix_len == len(SYSTEM)
    _, after = _rows(cache, SYSTEM)
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert _match(cache, SYSTEM + own).device_prefix_len == len(SYSTEM)  # the rest was not kept
    _consistent(cache)


def test_restoring_keeps_free_plus_evictable_memory_and_locks_nothing() -> None:
    cache = _cache(pool_tokens=100)
    _serve(cache, SYSTEM + [1], "a")
    _evict_all(cache)
    for j in range(2):  # fill the pool with other cached prompts
        _serve(cache, [7000 + 100 * j + k for k in range(45)], f"fill{j}")
    total = cache._alloc.available_size() + cache.evictable_size()
    m = _match(cache, SYSTEM + [2], "b")
    assert m.device_prefix_len == len(SYSTEM)
    assert cache._alloc.available_size() + cache.evictable_size() == total  # what admission counts
    assert cache.protected_size() == 0  # our restore lock is gone
    _consistent(cache)


def test_no_room_on_the_device_leaves_the_entry_on_host() -> None:
    from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: F401

    cache = _cache(pool_tokens=60)
    host = _host(cache)
    _serve(cache, SYSTEM + [1], "a")
    _evict_all(cache)
    held = cache._alloc.alloc(cache._alloc.available_size())  # a running request holds everything
    assert _match(cache, SYSTEM + [2], "b").device_prefix_len == 0
    assert host.restore_failures == 1 and len(host.store) >= 1
    cache._alloc.free(held)
    assert _match(cache, SYSTEM + [2], "b").device_prefix_len == len(SYSTEM)
    _consistent(cache)


def test_below_the_threshold_nothing_is_demoted() -> None:
    cache = _cache(min_score=1.0)
    _serve(cache, SYSTEM + [1], "a")
    _evict_all(cache)
    host = _host(cache)
    assert host.store.demoted == 0 and host.engine.host_pool.allocator.num_used == 0
    assert _match(cache, SYSTEM + [2], "b").device_prefix_len == 0


def test_a_reset_drops_every_entry_and_frees_its_host_blocks() -> None:
    cache = _cache()
    host = _host(cache)
    _serve(cache, SYSTEM + [1], "a")
    _evict_all(cache)
    assert host.engine.host_pool.allocator.num_used > 0
    cache.reset()  # e.g. new weights: every saved KV is stale
    assert len(host.store) == 0 and host.engine.host_pool.allocator.num_used == 0
    assert _match(cache, SYSTEM + [2], "b").device_prefix_len == 0


def test_a_random_replay_never_leaks_and_the_tree_stays_consistent() -> None:
    import random

    cache = _cache(pool_tokens=150, host_tokens=160)
    host = _host(cache)
    rnd = random.Random(3)
    prompts = [list(range(10_000 * p, 10_000 * p + rnd.randint(8, 50))) for p in range(6)]
    for i in range(150):
        base = prompts[rnd.randrange(len(prompts))]
        ids = base[: rnd.randint(4, len(base))] + [rnd.randint(1, 999) for _ in range(rnd.randint(1, 12))]
        _serve(cache, ids, f"r{i}")
        _consistent(cache)
    assert host.store.restored > 0 and host.store.demoted > 0
    _evict_all(cache)
    cache.reset()
    assert host.engine.host_pool.allocator.num_used == 0


def test_unsupported_trees_and_pools_are_refused_with_a_reason() -> None:
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    from superinfer_sgl.integration.prefix_host import refusal

    full = SimpleNamespace(component_types=(ComponentType.FULL,), is_eagle=False)
    pool = kv_pool(16)

    def params(kvcache: Any, **kw: Any) -> Any:
        return SimpleNamespace(token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: kvcache),
                               tp_cache_group=None, attn_cp_size=1, pp_size=1, **kw)

    assert refusal(full, params(pool)) is None
    swa = SimpleNamespace(component_types=(ComponentType.FULL, ComponentType.SWA), is_eagle=False)
    assert "hybrid radix tree (FULL, SWA)" in refusal(swa, params(pool))
    assert "MHATokenToKVPool only" in refusal(full, params(SimpleNamespace()))
    assert "EAGLE" in refusal(SimpleNamespace(component_types=(ComponentType.FULL,), is_eagle=True), params(pool))
    p = params(pool)
    p.pp_size = 2
    assert "pp_size 2" in refusal(full, p)


def test_an_unsupported_pool_turns_demotion_off_and_the_cache_still_works() -> None:
    from superinfer_sgl.integration.tree_replay import TreeReplay

    _UNDO.append(HookedTreeCore(host_tokens=100).__enter__())
    rep = TreeReplay("predictive", 100, {})  # the replay's allocator without a KV pool
    state = rep.cache.tree_core._superinfer_prefix
    assert state.host is None and "MHATokenToKVPool only" in state.host_refused
    assert rep.serve("a", SYSTEM, [1], 0.0) == 0 and rep.serve("b", SYSTEM + [2], [1], 1.0) == len(SYSTEM)


def test_the_host_hooks_come_off_again() -> None:
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    before = dict(UnifiedTreeCore.__dict__), dict(UnifiedRadixCache.__dict__)
    with HookedTreeCore(host_tokens=10):
        assert UnifiedTreeCore.__dict__["evict_device_leaf"] is not before[0]["evict_device_leaf"]
        assert UnifiedRadixCache.__dict__["_match_tree"] is not before[1]["_match_tree"]
    assert all(UnifiedTreeCore.__dict__[k] is v for k, v in before[0].items())
    assert all(UnifiedRadixCache.__dict__[k] is v for k, v in before[1].items())


def test_auto_sizes_the_host_tier_like_the_device_pool_within_its_ram_share() -> None:
    from superinfer_sgl.integration import prefix_cache
    from superinfer_sgl.integration.prefix_host import AUTO_RAM_FRACTION, auto_host_tokens

    assert auto_host_tokens(1000, 100, available_ram=10**9) == 1000  # the device pool's tokens
    assert auto_host_tokens(1000, 100, available_ram=int(400 * 100 / AUTO_RAM_FRACTION)) == 400  # RAM-bound
    cache = _cache(pool_tokens=120, host_tokens=prefix_cache.AUTO_HOST)
    assert _host(cache).store.budget == 128  # 120 tokens in whole 16-token blocks
    targets = {t for t, _, _ in prefix_cache.hooks("predictive", 0.25, prefix_cache.AUTO_HOST)}
    assert f"{prefix_cache.CORE}.evict_device_leaf" in targets and f"{prefix_cache.CACHE}._match_tree" in targets
    assert not {t for t, _, _ in prefix_cache.hooks("predictive", 0.25, 0)} & {f"{prefix_cache.CACHE}._match_tree"}
    assert list(prefix_cache.hooks("radix", 0.25, prefix_cache.AUTO_HOST)) == []


def test_the_server_installs_the_host_hooks_with_the_predictive_cache_unless_off() -> None:
    from superinfer_sgl.config import SuperInferConfig
    from superinfer_sgl.integration import hooks, prefix_cache

    def targets(**kw: Any) -> set[str]:
        return {t for t, _, _ in hooks.hooks(SuperInferConfig(**kw))}

    host = {f"{prefix_cache.CORE}.evict_device_leaf", f"{prefix_cache.CACHE}._match_tree"}
    reset = f"{prefix_cache.CORE}.reset"  # the predictor's records go on a flush, host tier or not
    assert host | {reset} <= targets(prefix_cache="predictive")  # auto
    assert reset in targets(prefix_cache="predictive", prefix_host_tokens=0)
    assert not host & targets(prefix_cache="predictive", prefix_host_tokens=0)
    assert not (host | {reset}) & targets()  # SGLang's own radix cache: none of ours
    assert hooks.forward_fence() == []  # no scheduler yet: nothing to wait for


def test_a_failing_insert_leaks_neither_host_blocks_nor_device_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    cache = _cache()
    host = _host(cache)
    _serve(cache, SYSTEM + [1], "a")
    _evict_all(cache)
    free_before = cache._alloc.available_size()

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("insert failed")

    monkeypatch.setattr(cache, "insert", boom)
    with pytest.raises(RuntimeError, match="insert failed"):
        _match(cache, SYSTEM + [2], "b")
    assert cache._alloc.available_size() == free_before  # the restore's slots went back
    assert cache.protected_size() == 0  # and its lock
    host.check()  # the taken entry's blocks were freed: only live entries hold host blocks


def test_the_prefix_series_follow_the_host_tier_s_counts() -> None:
    """superinfer_prefix_* (integration/prefix_metrics.py): what a demotion, a restore and a failed
    restore did, as the store counted it, published when the copy happens (no waiting for the
    throttle), with the predictor's own time beside it."""
    from prometheus_client import REGISTRY

    def value(name: str, **labels: str) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    series = [("superinfer_prefix_host_copied_tokens_total", {"direction": "demoted"}),
              ("superinfer_prefix_host_copied_tokens_total", {"direction": "restored"}),
              ("superinfer_prefix_host_entries_total", {"event": "demoted"}),
              ("superinfer_prefix_host_entries_total", {"event": "restored"}),
              ("superinfer_prefix_host_entries_total", {"event": "restore_failures"}),
              ("superinfer_prefix_predictor_seconds_total", {})]
    before = [value(n, **lab) for n, lab in series]
    cache = _cache(pool_tokens=100)
    host = _host(cache)
    assert value("superinfer_prefix_host_tokens_used") == 0  # published at startup
    assert value("superinfer_prefix_host_tokens_total") == host.store.budget
    _serve(cache, SYSTEM + [1], "a")
    _serve(cache, SYSTEM + [2], "a2")  # a hit: the prompt is worth demoting
    _evict_all(cache)
    held = cache._alloc.alloc(cache._alloc.available_size())
    assert _match(cache, SYSTEM + [3], "b").device_prefix_len == 0  # no room: a failed restore
    cache._alloc.free(held)
    assert _match(cache, SYSTEM + [3], "c").device_prefix_len == len(SYSTEM)
    s = host.store
    assert s.demoted >= 1 and s.restored >= 1 and host.restore_failures == 1
    got = [value(n, **lab) - b for (n, lab), b in zip(series, before)]
    assert got[:5] == [s.demoted_tokens, s.restored_tokens, s.demoted, s.restored, 1]
    assert got[5] > 0
    assert value("superinfer_prefix_host_tokens_used") == s.used


# ---- a review of 2026-12-03: each test below fails on the code before its fix -----------------
def test_a_restore_that_cannot_fit_evicts_nothing() -> None:
    """Free plus evictable memory short of the entry: the restore fails without emptying the
    device cache first (a waiting request is matched again every step)."""
    cache = _cache(pool_tokens=100, min_score=0.05)
    host = _host(cache)
    _serve(cache, SYSTEM + [1], "a")
    _serve(cache, SYSTEM + [2], "a2")
    _evict_all(cache)
    hot = list(range(5000, 5020))
    _serve(cache, hot + [1], "h1")
    _serve(cache, hot + [2], "h2")
    held = cache._alloc.alloc(cache._alloc.available_size() - 10)  # running requests hold the rest
    assert cache._alloc.available_size() + cache.evictable_size() < len(SYSTEM)
    evictable = cache.evictable_size()
    assert _match(cache, SYSTEM + [3], "waiting").device_prefix_len == 0 and host.restore_failures == 1
    assert cache.evictable_size() == evictable and _match(cache, hot).device_prefix_len == len(hot)
    cache._alloc.free(held)
    _consistent(cache)


def test_a_few_shared_tokens_do_not_consume_a_demoted_prompt() -> None:
    """Another tenant's prompt sharing only the chat template's first tokens must not restore
    those and drop the rest of the entry and everything chained under it."""
    cache = _cache(pool_tokens=1200, host_tokens=2000)
    host = _host(cache)
    template = [1, 32001, 9125, 13]
    tenant_a = template + list(range(5000, 5200))
    for i in range(3):
        _serve(cache, tenant_a + [100 + i] * 5, f"a{i}")
    _evict_all(cache)
    entries = len(host.store)
    assert _match(cache, template + list(range(7000, 7010)), "tenant-b").device_prefix_len == 0
    assert len(host.store) == entries and host.store.dropped == 0
    assert _match(cache, tenant_a + [100] * 5 + [9], "a-again").device_prefix_len == len(tenant_a) + 5
    _consistent(cache)


def test_a_reset_publishes_the_host_tier_series() -> None:
    from prometheus_client import REGISTRY

    cache = _cache(pool_tokens=100)
    host = _host(cache)
    _serve(cache, SYSTEM + [1], "a")
    _serve(cache, SYSTEM + [2], "a2")
    _evict_all(cache)
    assert REGISTRY.get_sample_value("superinfer_prefix_host_tokens_used") == host.store.used > 0
    cache.reset()
    assert REGISTRY.get_sample_value("superinfer_prefix_host_tokens_used") == 0


def test_auto_splits_its_ram_share_among_the_nodes_scheduler_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    from superinfer_sgl.integration import prefix_cache, startup
    from superinfer_sgl.integration.prefix_host import AUTO_RAM_FRACTION, auto_host_tokens

    ram = int(400 * 100 / AUTO_RAM_FRACTION)
    assert auto_host_tokens(1000, 100, available_ram=ram, processes=4) == 100
    from superinfer_sgl import host_memory

    monkeypatch.setattr(startup, "local_schedulers", lambda sched: (4, 1))  # e.g. --dp-size 4
    per_token = 2 * 2 * 2 * 4 * 4  # the test pool: layers, K and V, heads, head_dim, float32
    monkeypatch.setattr(host_memory, "available_ram_bytes", lambda: int(4 * 64 * per_token / AUTO_RAM_FRACTION))
    cache = _cache(pool_tokens=120, host_tokens=prefix_cache.AUTO_HOST)
    assert _host(cache).store.budget == 64  # a quarter of the RAM share (256 tokens), not the device pool's 120


def test_entries_dropped_with_their_parent_are_published_at_once() -> None:
    """An eviction that drops host entries (their parent left the tree) or refuses one updates
    the series then, not at the next request (an idle server would show them for good)."""
    from prometheus_client import REGISTRY

    cache = _cache(pool_tokens=120, host_tokens=30)
    host = _host(cache)
    tail = list(range(2000, 2020))
    _serve(cache, SYSTEM + tail, "a")
    _serve(cache, SYSTEM + [7, 8], "b")
    _serve(cache, SYSTEM + tail, "a2")  # a hit: the tail is worth demoting
    _evict_all(cache)  # the tail is demoted; SYSTEM (40 tokens) does not fit and takes the tail's entry along
    assert host.store.dropped >= 1 and host.store.used == 0
    assert REGISTRY.get_sample_value("superinfer_prefix_host_tokens_used") == 0
