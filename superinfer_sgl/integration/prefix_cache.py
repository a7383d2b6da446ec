"""`--prefix-cache predictive`: SGLang's radix tree evicting by predicted reuse.

SGLang's eviction strategies plug into its tree core as `EvictionStrategy.get_priority(node)`, a
key its min-heap pops in order (mem_cache/evict_policy.py, unified_cache/components/full.py). The
Rust tree core (SGLang's default) has its strategies compiled in, so with this option the cache is
built on SGLang's Python tree core (`select_tree_core_backend` -> "python"), which calls the
strategy object; the policy itself is pure (rotasched/prefix_reuse.py). The hooks, each on one
UnifiedTreeCore method:

  __init__             our strategy in place of the one SGLang built (the pool size for pinning)
  match_prefix         a request's hit on every node of its matched path (the predictor's input),
                       until the request has written KV of its own into the tree
  _split_node          the new prefix node inherits the split node's history
  _unregister_node     a node leaves the tree: its history becomes a ghost under (parent, first
                       token), which a returning prefix inherits
  evict_device_start   an eviction round: score the evictable leaves, pick the pin set

  reset                a flush: the old tree's records and ghosts go (and the host tier's entries)

With a host budget (--prefix-host-tokens N > 0), two more (prefix_host.py): evict_device_leaf
(BEFORE: demote a leaf of high predicted reuse to host blocks through DuplexKV before SGLang frees
its slots) and UnifiedRadixCache._match_tree (AROUND: restore demoted entries that continue a
request's match, then match again).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from ..rotasched.prefix_reuse import GHOST_TOKENS, EvictionRanker, Leaf, PredictorParams, ReusePredictor
from .prefix_metrics import PREFIX_PUBLISH_S, prefix_cache_metrics

if TYPE_CHECKING:
    from .prefix_host import PrefixHost

logger = logging.getLogger(__name__)

CORE = "sglang.srt.mem_cache.unified_cache.unified_tree_core.UnifiedTreeCore"
CACHE = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache"
SELECT_CORE = "sglang.srt.mem_cache.unified_cache.tree_core_registry.select_tree_core_backend"
PIN_SHARE = 0.25  # the device pool's share that pinned prefixes may hold
AUTO_HOST = -1  # --prefix-host-tokens auto: prefix_host.auto_host_tokens
_SOURCES = itertools.count()  # each state's own key in the metrics' last-seen counts (ids get reused)


class PrefixCacheState:
    """What one tree core's predictive strategy keeps, and the time our hooks spent (measurement)."""

    def __init__(self, pool_tokens: int, pin_share: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.predictor = ReusePredictor(PredictorParams())
        self.ranker = EvictionRanker(self.predictor, pool_tokens, pin_share=pin_share)
        self.clock = clock
        self.hook_s = 0.0
        self.hook_calls = 0
        self.host: PrefixHost | None = None  # the host tier (--prefix-host-tokens), when on and supported
        self.host_refused: str | None = None  # why it is off although asked for
        self._published = float("-inf")  # perf_counter of the last publish to /metrics
        self._source = next(_SOURCES)
        self._publish_failed = False
        from .metrics_rank import is_metrics_rank

        self._exports = is_metrics_rank()

    def charge(self, start: float) -> None:
        end = time.perf_counter()
        self.hook_s += end - start
        self.hook_calls += 1
        if end - self._published >= PREFIX_PUBLISH_S:
            self.publish(end)

    def publish(self, now: float | None = None) -> None:
        """Our counts to the superinfer_prefix_* series (integration/prefix_metrics.py). Observability
        never takes the scheduler down: a failure is logged once."""
        self._published = time.perf_counter() if now is None else now
        if not self._exports:  # another TP rank's copy of the same counts (integration.metrics)
            return
        try:
            prefix_cache_metrics().publish(self._source, self.hook_s, self.hook_calls,
                                           None if self.host is None else self.host.counters())
        except Exception:
            if not self._publish_failed:
                logger.exception("superinfer: prefix cache metrics not published")
            self._publish_failed = True


def strategy_class() -> type:
    from sglang.srt.mem_cache.evict_policy import EvictionStrategy

    class PredictiveStrategy(EvictionStrategy):
        """Unpinned before pinned, then lowest predicted reuse, then least recently used."""

        def __init__(self, state: PrefixCacheState) -> None:
            self.state = state

        def get_priority(self, node: Any) -> tuple[int, float, float]:
            return self.state.ranker.priority(node.id, node.last_access_time, self.state.clock())

    return PredictiveStrategy


def _state(core: Any) -> PrefixCacheState | None:
    return getattr(core, "_superinfer_prefix", None)


def _ghost_key(node: Any, page_size: int) -> Any:
    parent, key = node.parent, node.key
    if parent is None or key is None or len(key) == 0:
        return None
    try:
        return (parent.id, key.child_key(page_size))
    except (AttributeError, TypeError, IndexError):
        return None


def _has_written(req: Any) -> bool:
    """Whether the request has put KV of its own into the tree: a chunked prefill's next chunk
    (SGLang inserts each chunk, `req.kv.cache_inserted_len`), a request resumed after a rotation or
    re-queued after a retraction (it has output tokens). Its matches from then on find its own
    tokens, and counting them as hits would make every rotated or chunked request's private KV
    look shared (found by the e2e test with forced rotations: the predictor demoted each rotated
    request's decode segments and pushed a shared prompt off the host). Hits by others' writes are
    counted at its first matches, before it writes (the scheduler re-matches a waiting request
    every step)."""
    if getattr(req, "output_ids", None):
        return True
    return bool(getattr(getattr(req, "kv", None), "cache_inserted_len", 0))


def _key_len(node: Any) -> int:
    return len(node.key) if node.key is not None else 0


def _end_depth(node: Any, root: Any, memo: dict[int, int] | None = None) -> int:
    """Tokens from the root through `node`'s end; with `memo` (node id -> depth, for one round)
    each node is walked once however many leaves share it (a deep conversation tree otherwise
    costs a walk to the root per leaf)."""
    path = []
    while node is not None and node is not root and (memo is None or node.id not in memo):
        path.append(node)
        node = node.parent
    depth = memo[node.id] if memo is not None and node is not None and node is not root else 0
    for n in reversed(path):
        depth += _key_len(n)
        if memo is not None:
            memo[n.id] = depth
    return depth


def _tokens(node: Any) -> tuple[int, ...] | None:
    """A node's leading tokens (`prefix_reuse.GHOST_TOKENS`): what tells its ghost from another
    prefix under the same parent and first page."""
    key = getattr(node, "key", None)
    if key is None:
        return None
    try:
        return tuple(key.token_ids[:min(GHOST_TOKENS, len(key))])
    except (AttributeError, TypeError):
        return None


COUNTED = "_superinfer_prefix_counted"  # on a request: the node ids its matches have counted


def hooks(prefix_cache: str, pin_share: float, host_tokens: int = 0, transfer: str = "auto",
          fence: Callable[[], list[Any]] | None = None) -> Iterator[tuple[str, Callable[..., Any], str]]:
    """(target, hook, HookType name) for --prefix-cache; none for SGLang's own radix cache.
    host_tokens > 0: demotion to a host tier of that many tokens (prefix_host.py); AUTO_HOST: sized
    from the device pool (prefix_host.auto_host_tokens); 0: none. fence: what the host tier's copies
    wait for (the server: the forward in flight; default: nothing)."""
    if prefix_cache == "radix":
        return
    strategy = strategy_class()

    def python_core(original: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
        return "python"

    def attach(result: None, core: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        allocator = getattr(params, "token_to_kv_pool_allocator", None)
        pool = int(getattr(allocator, "size", 0) or 0)
        core._superinfer_prefix = state = PrefixCacheState(pool, pin_share)
        core.eviction_strategy = strategy(state)
        if host_tokens != 0:
            from .prefix_host import PrefixHost

            extra = {} if fence is None else {"fence": fence}
            state.host, state.host_refused = PrefixHost.open(core, params, state.predictor, host_tokens, transfer,
                                                             **extra)
            if state.host_refused is not None:
                log = logger.info if host_tokens == AUTO_HOST else logger.warning
                log("superinfer: prefix host tier (--prefix-host-tokens %s) off: %s",
                    "auto" if host_tokens == AUTO_HOST else host_tokens, state.host_refused)
            elif state.host is not None:
                pool = state.host.engine.host_pool
                logger.info("superinfer: prefix host tier %d tokens (%d blocks x %d, %.3f GiB), transfer=%s",
                            state.host.store.budget, pool.num_blocks, pool.block_tokens,
                            pool.num_blocks * pool.bytes_per_block / 2**30, state.host.engine.transfer)
        state.publish()  # the series exist from startup (the host budget among them)

    def on_match(result: Any, core: Any, params: Any, *args: Any, **kwargs: Any) -> None:
        st, req = _state(core), getattr(params, "req", None)
        if st is None or req is None:  # SGLang's own touches (no request): not a hit
            return
        if _has_written(req):  # its own KV is in the tree now: reading it back is not reuse
            return
        start = time.perf_counter()
        now = st.clock()
        custom = getattr(getattr(req, "sampling_params", None), "custom_params", None) or {}
        slo_class = custom.get("slo_class") if isinstance(custom, dict) else None
        node, root, page = result.last_device_node, core.root_node, core.page_size
        if isinstance(node, int):  # the tree core's results carry NodeIds
            node = core._node_arena.get(node)
        # A waiting request is matched again every time the scheduler tries it: each request
        # counts once per node (the set lives and dies with the request).
        counted = getattr(req, COUNTED, None)
        if counted is None:
            counted = set()
            setattr(req, COUNTED, counted)
        end = _end_depth(node, root)
        while node is not None and node is not root:
            length = _key_len(node)
            if node.id not in counted:
                counted.add(node.id)
                st.predictor.hit(node.id, now, slo_class, ghost_key=_ghost_key(node, page), end_depth=end,
                                 length=length, tokens=_tokens(node))
            end -= length
            node = node.parent
        st.charge(start)

    def on_split(result: Any, core: Any, key: Any, child: Any, split_len: int, *args: Any, **kwargs: Any) -> None:
        st = _state(core)
        if st is not None:
            start = time.perf_counter()
            head = result[0]  # now child's parent, holding the child's first split_len tokens
            st.predictor.split(head.id, child.id, st.clock(), int(split_len),
                               ghost_key=_ghost_key(head, core.page_size), child_end_depth=_end_depth(child, core.root_node), child_length=_key_len(child),
                               tokens=_tokens(head))
            st.charge(start)

    def on_unregister(core: Any, node: Any, *args: Any, **kwargs: Any) -> None:
        st = _state(core)
        if st is not None:
            start = time.perf_counter()
            st.predictor.forget(node.id, st.clock(), _ghost_key(node, core.page_size), _tokens(node))
            st.charge(start)
            if st.host is not None:  # dropped, not demoted: the entries hanging under it go
                dropped = st.host.store.dropped
                st.host.store.node_left(node.id)
                if st.host.store.dropped != dropped:
                    st.publish()  # an idle server would show the entries until its next request

    def on_evict_leaf(core: Any, node_id: Any, *args: Any, **kwargs: Any) -> None:
        st = _state(core)
        if st is None or st.host is None:
            return
        node = core._node_arena.get(node_id)
        if node is None:
            return
        now = st.clock()
        score = st.predictor.score(node.id, now)
        store = st.host.store
        before = (store.rejected_room, store.rejected_score, store.host_evicted)
        if st.host.demote(core, node, score, now, st.predictor.nodes.get(node.id)) \
                or (store.rejected_room, store.rejected_score, store.host_evicted) != before:
            st.publish()  # a copy of milliseconds happened, or a refusal: the series follow at once

    def around_match(original: Callable[..., Any], cache: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(cache, params, *args, **kwargs)
        st = _state(getattr(cache, "tree_core", None))
        if st is None or st.host is None or getattr(params, "req", None) is None or cache.disable:
            return result
        failures = st.host.restore_failures
        if st.host.restore(cache, params, result, st.clock()) > 0:
            st.publish()
            result = original(cache, params, *args, **kwargs)  # the tree's own match now covers it
        elif st.host.restore_failures != failures:
            st.publish()
        return result

    def on_reset(result: None, core: Any, *args: Any, **kwargs: Any) -> None:
        # A flush (SGLang's reset swaps its node arena without unregistering a node): the old
        # tree's records would stay forever, keyed by ids that never recur.
        st = _state(core)
        if st is None:
            return
        st.predictor.drop_tree()
        st.ranker.reset()
        if st.host is not None:
            st.host.store.clear()
        st.publish()  # the host tier's gauge and counters moved: an idle server would not update them

    def on_evict_start(core: Any, component_type: Any, request_cnt: int, *args: Any, **kwargs: Any) -> None:
        st = _state(core)
        if st is None or getattr(component_type, "name", "") != "FULL":
            return
        start = time.perf_counter()
        root = core.root_node
        # In node-id order: SGLang's leaf set iterates in memory-address order, which would make
        # the pin set's ties (and so a run) differ from process to process.
        page, known, memo = core.page_size, st.predictor.nodes, {}
        # ghost keys only for nodes the predictor has not seen (the others' are never read)
        leaves = [Leaf(n.id, _end_depth(n, root, memo), _key_len(n),
                       *((None, None) if n.id in known else (_ghost_key(n, page), _tokens(n))))
                  for n in sorted(core.evictable_device_leaves, key=lambda n: n.id)]
        st.ranker.begin_round(leaves, st.clock())
        st.charge(start)

    yield SELECT_CORE, python_core, "AROUND"
    yield f"{CORE}.__init__", attach, "AFTER"
    yield f"{CORE}.match_prefix", on_match, "AFTER"
    yield f"{CORE}._split_node", on_split, "AFTER"
    yield f"{CORE}._unregister_node", on_unregister, "BEFORE"
    yield f"{CORE}.evict_device_start", on_evict_start, "BEFORE"
    yield f"{CORE}.reset", on_reset, "AFTER"
    if host_tokens != 0:
        yield f"{CORE}.evict_device_leaf", on_evict_leaf, "BEFORE"
        yield f"{CACHE}._match_tree", around_match, "AROUND"
