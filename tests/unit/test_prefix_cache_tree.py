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
    assert len(head.key) == len(SYSTEM) and p.nodes[head.id].hits >= 2
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


# ---- found by a review of the predictor (2026-12-03); each fails on the code before it ----


def _match(cache: Any, ids: list[int], req: Any) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache.match_prefix(MatchPrefixParams(key=RadixKey(list(ids)), req=req))


def test_waiting_requests_matched_every_step_count_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    """Six waiting requests re-matched for 50 steps are six hits (a window of four recent
    requesters per node counted 300)."""
    cache = _cache(monkeypatch, predictive=True)
    p = cache.tree_core._superinfer_prefix.predictor
    _serve(cache, SYSTEM + [1], "writer")
    waiting = [_req(f"w{i}") for i in range(6)]
    for _ in range(50):
        for req in waiting:
            _match(cache, SYSTEM + [2], req)
    head = next(iter(cache.tree_core.root_node.children.values()))
    assert p.nodes[head.id].hits == 6


def test_hits_and_splits_record_the_nodes_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Depth and length came only from eviction rounds: a node known by its hits had 0 / 0, and a
    split head took the split length as its depth."""
    cache = _cache(monkeypatch, predictive=True)
    p = cache.tree_core._superinfer_prefix.predictor
    _serve(cache, [1, 2] + SYSTEM + [3, 4, 5], "a")
    _serve(cache, [1, 2] + SYSTEM + [3, 4, 5], "b")  # an exact hit on the 25-token node
    node = next(iter(cache.tree_core.root_node.children.values()))
    assert (p.nodes[node.id].end_depth, p.nodes[node.id].length) == (25, 25)
    _serve(cache, [1, 2, 7], "c")  # splits it after two tokens
    head = next(iter(cache.tree_core.root_node.children.values()))
    tail = next(c for c in head.children.values() if c.id == node.id)
    assert (p.nodes[head.id].end_depth, p.nodes[head.id].length) == (2, 2)
    assert (p.nodes[tail.id].end_depth, p.nodes[tail.id].length) == (25, 23)


def test_a_prefix_that_shares_only_a_first_token_does_not_inherit_a_ghost(monkeypatch: pytest.MonkeyPatch) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    cache = _cache(monkeypatch, predictive=True)
    p = cache.tree_core._superinfer_prefix.predictor
    a = [5] + list(range(100, 130))
    for i in range(4):
        _serve(cache, a, f"a{i}")
    cache.evict(EvictParams(num_tokens=cache.evictable_size()))
    assert len(p.ghosts) == 1
    updates = p.updates
    _serve(cache, [5] + list(range(900, 930)), "b")
    _serve(cache, [5] + list(range(900, 930)), "b2")
    b = next(iter(cache.tree_core.root_node.children.values()))
    assert p.nodes[b.id].hits == 1 and len(p.ghosts) == 1  # its own history; A's ghost still waits
    assert p.updates == updates  # nothing learned from A's sample


def test_an_eviction_round_reads_each_leafs_depth(monkeypatch: pytest.MonkeyPatch) -> None:
    """The round's depths (one walk per node, shared by the leaves under it) equal a walk from
    each leaf to the root, on a deep conversation-like tree."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from superinfer_sgl.integration.prefix_cache import _end_depth

    cache = _cache(monkeypatch, predictive=True, pool=2000)
    p = cache.tree_core._superinfer_prefix.predictor
    for conv in range(5):
        turns = [conv * 1000]
        for t in range(6):
            turns = turns + [conv * 1000 + 10 * t + k for k in range(1, 8)]
            _serve(cache, turns + [9999 - t], f"c{conv}t{t}")
    root = cache.tree_core.root_node
    leaves = list(cache.tree_core.evictable_device_leaves)
    cache.evict(EvictParams(num_tokens=1))
    for leaf in leaves:
        if leaf.id in p.nodes:
            assert p.nodes[leaf.id].end_depth == _end_depth(leaf, root)
