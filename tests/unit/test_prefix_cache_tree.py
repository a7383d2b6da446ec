"""--prefix-cache predictive on SGLang's own radix tree (UnifiedRadixCache, Python tree core, CPU):
our hooks (integration/prefix_cache.py) wrapped around the real methods for the test only
(integration/tree_replay.HookedTreeCore, the way SGLang's HookRegistry wraps them in the server)."""

from __future__ import annotations

import warnings
from types import SimpleNamespace
from typing import Any

import pytest

warnings.filterwarnings("ignore", category=UserWarning)
torch = pytest.importorskip("torch")
pytest.importorskip("sglang.srt.mem_cache.unified_radix_cache")

from superinfer_sgl.integration.tree_replay import HookedTreeCore  # noqa: E402

SYSTEM = list(range(1000, 1020))  # a shared 20-token system prompt
_UNDO: list[HookedTreeCore] = []


@pytest.fixture(autouse=True)
def _restore_tree_core():  # noqa: ANN202
    yield
    while _UNDO:
        _UNDO.pop().__exit__(None, None, None)


def _cache(monkeypatch: pytest.MonkeyPatch, predictive: bool, pool: int = 400) -> Any:
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    if predictive:  # our hooks on the tree core until the test ends (the Python core named below)
        _UNDO.append(HookedTreeCore().__enter__())
    alloc = TokenToKVPoolAllocator(pool, torch.float32, "cpu", SimpleNamespace(), False)
    params = CacheInitParams(disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc,
                             page_size=1, tree_components=(ComponentType.FULL,))
    params.tree_core_backend = "python"
    cache = UnifiedRadixCache(params)
    cache._alloc = alloc
    if predictive:  # a deterministic clock: 10 ms per reading, whatever the machine's speed
        ticks = iter(range(10**9))
        cache.tree_core._superinfer_prefix.clock = lambda: next(ticks) * 0.01
    return cache


def _req(rid: str) -> Any:
    return SimpleNamespace(rid=rid, session=None, extra_key=None,
                           sampling_params=SimpleNamespace(custom_params={"slo_class": "interactive"}))


def _serve(cache: Any, ids: list[int], rid: str) -> int:
    """A request: match its prompt (a hit on the matched path), then insert it (SGLang caches a
    finished request's tokens). Returns the matched length."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    m = cache.match_prefix(MatchPrefixParams(key=RadixKey(list(ids)), req=_req(rid)))
    cache.insert(InsertParams(key=RadixKey(list(ids)), value=cache._alloc.alloc(len(ids))))
    return m.device_prefix_len


def _matched(cache: Any, ids: list[int]) -> int:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    return cache.match_prefix(MatchPrefixParams(key=RadixKey(list(ids)))).device_prefix_len


def _scenario(cache: Any) -> int:
    """Five users of one system prompt, then six newer one-off prompts; evict enough for SGLang to
    reach past the users' unique tails. Returns the system prompt's cached tokens afterwards."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    for i in range(5):
        _serve(cache, SYSTEM + [2000 + 10 * i + k for k in range(10)], f"user{i}")
    for j in range(6):
        _serve(cache, [3000 + 100 * j + k for k in range(30)], f"once{j}")
    cache.evict(EvictParams(num_tokens=5 * 10 + 30))
    return _matched(cache, SYSTEM)


def test_stock_lru_drops_the_shared_prompt_and_predictive_keeps_it(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _scenario(_cache(monkeypatch, predictive=False)) < len(SYSTEM)
    cache = _cache(monkeypatch, predictive=True)
    assert type(cache.tree_core.eviction_strategy).__name__ == "PredictiveStrategy"
    assert _scenario(cache) == len(SYSTEM)
    state = cache.tree_core._superinfer_prefix
    assert state.ranker.rounds >= 1 and state.hook_calls > 0
    assert state.ranker.pinned_tokens <= state.ranker.pin_budget


def test_hits_splits_and_ghosts_follow_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = _cache(monkeypatch, predictive=True)
    p = cache.tree_core._superinfer_prefix.predictor
    _serve(cache, SYSTEM + [1, 2, 3], "a")
    assert _serve(cache, SYSTEM + [7, 8], "b") == len(SYSTEM)  # splits the node at the prompt's end
    assert _serve(cache, SYSTEM + [9], "c") == len(SYSTEM)
    root = cache.tree_core.root_node
    head = next(iter(root.children.values()))
    assert len(head.key) == len(SYSTEM) and p.nodes[head.id].distinct >= 2
    _serve(cache, SYSTEM + [9], "c")  # the same request again: no new hit
    hits = p.nodes[head.id].hits
    assert _matched(cache, SYSTEM) == len(SYSTEM) and p.nodes[head.id].hits == hits  # no request, no hit
    cache.evict(EvictParams(num_tokens=cache.evictable_size()))
    assert head.id not in p.nodes and p.ghosts  # its history waits as a ghost
    _serve(cache, SYSTEM + [5], "d")
    again = next(iter(root.children.values()))
    _serve(cache, SYSTEM + [6], "e")
    assert p.nodes[again.id].hits >= hits  # the returning prefix inherited its history


def test_a_request_reading_back_its_own_kv_is_not_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request that has written KV of its own (a resumed rotation or a retraction: output tokens;
    a chunked prefill's next chunk: SGLang's req.kv.cache_inserted_len) matches its own tokens:
    not reuse. Before it writes, its matches count (once per node)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache = _cache(monkeypatch, predictive=True)
    p = cache.tree_core._superinfer_prefix.predictor
    _serve(cache, SYSTEM + [1, 2, 3], "a")
    head = next(iter(cache.tree_core.root_node.children.values()))

    def match(req: Any) -> None:
        cache.match_prefix(MatchPrefixParams(key=RadixKey(SYSTEM + [1, 2, 3, 4]), req=req))

    resumed = _req("a")
    resumed.output_ids = [5, 6]  # "a" back after a rotation: its prompt is its own KV
    chunked = _req("b")
    chunked.kv = SimpleNamespace(cache_inserted_len=len(SYSTEM))  # "b" after its first chunk
    for req in (resumed, chunked):
        match(req)
        assert head.id not in p.nodes or p.nodes[head.id].hits == 0, req.rid
    match(_req("c"))  # a new request: a hit
    assert p.nodes[head.id].hits == 1


def test_the_hooks_come_off_again() -> None:
    from sglang.srt.mem_cache.unified_cache.unified_tree_core import UnifiedTreeCore

    before = dict(UnifiedTreeCore.__dict__)
    with HookedTreeCore():
        assert UnifiedTreeCore.__dict__["match_prefix"] is not before["match_prefix"]
    assert all(UnifiedTreeCore.__dict__[k] is v for k, v in before.items())


def test_a_returning_prefix_keeps_its_ghost_across_an_eviction_round(monkeypatch: pytest.MonkeyPatch) -> None:
    """A recomputed prefix's new node may be seen first by an eviction round (its inserting request
    matched nothing, so no hit created its record): the round's record inherits the ghost, and the
    next request's hit finds the history, not a fresh record beside an orphaned ghost."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.unified_cache.components import ComponentType

    cache = _cache(monkeypatch, predictive=True)
    core = cache.tree_core
    p = core._superinfer_prefix.predictor
    for rid, tail in (("a", [1, 2, 3]), ("b", [7, 8]), ("c", [9])):
        _serve(cache, SYSTEM + tail, rid)
    head = next(iter(core.root_node.children.values()))
    hits = p.nodes[head.id].hits
    cache.evict(EvictParams(num_tokens=cache.evictable_size()))
    assert p.ghosts
    _serve(cache, SYSTEM + [5], "d")
    core.evict_device_start(ComponentType.FULL, 0)  # a round before the prefix's next request
    core.evict_device_end(ComponentType.FULL)
    _serve(cache, SYSTEM + [6], "e")
    again = next(iter(core.root_node.children.values()))
    assert p.nodes[again.id].hits >= hits
    assert not [k for k in p.ghosts if k[0] == core.root_node.id]  # the prefix's ghost was taken


def test_a_flush_drops_the_old_trees_records(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's reset (a /flush_cache, a weight update) swaps its node arena without unregistering a
    node: the predictor's records and ghosts of the old tree go with it (ids never recur)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = _cache(monkeypatch, predictive=True)
    state = cache.tree_core._superinfer_prefix
    for rid, tail in (("a", [1, 2, 3]), ("b", [7, 8])):
        _serve(cache, SYSTEM + tail, rid)
    cache.evict(EvictParams(num_tokens=3))
    _serve(cache, [40, 41, 42], "c")
    assert state.predictor.nodes and state.predictor.ghosts
    weights = list(state.predictor.weights)
    cache.reset()
    assert not state.predictor.nodes and not state.predictor.ghosts and not state.ranker.pinned
    assert state.predictor.weights == weights  # what it learned stays
    assert _serve(cache, SYSTEM + [1], "d") == 0 and state.predictor.nodes is not None
