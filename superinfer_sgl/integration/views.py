"""What the policy sees of SGLang's requests: the numbers `rotasched.views` builds ReqViews, block
needs and the free-block budget from, read off SGLang's Req and scheduler objects. The rules
themselves (the decode reserve, block rounding, the clip) are the pure builder's, which the
simulator adapts its requests to as well.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from operator import is_
from typing import Any

from ..rotasched import ReqState, ReqView
from ..rotasched import views as rules_
from ..rotasched.clock import ReqClock
from ..rotasched.pending import PendingIndex, StepQueue
from ..rotasched.views import CLIP_MAX_NEW_TOKENS, ViewRules
from . import rotation

CLIP_ENV = "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION"


def clip_max_new_tokens() -> int:
    """SGLang's clip of a decode reserve: it reads the same variable for its own (schedule_policy),
    so ours must match. Read when a runtime is created (startup.create_runtime), not at import."""
    return int(os.environ.get(CLIP_ENV, str(CLIP_MAX_NEW_TOKENS)))


def _left(req: Any) -> int:
    return req.sampling_params.max_new_tokens - len(req.output_ids)


def running_reserve(sched: Any, req: Any, share: float, clip: int = CLIP_MAX_NEW_TOKENS) -> float:
    """A running request's decode reserve: `share` of SGLang's (rotasched.views.running_reserve_ratio;
    SGLang's PrefillAdder applies the same rule: hooks.py)."""
    fixed = req.sampling_params.ignore_eos
    ratio = rules_.running_reserve_ratio(fixed, 1.0 if fixed else sched.new_token_ratio_tracker.current, share)
    return rules_.reserve_tokens(_left(req), ratio, clip)


def resident(req: Any, restored: bool) -> int:
    """Tokens of a waiting request already on the device: a resumed (`restored`) request's KV."""
    return rotation.restorable_tokens(req) if restored else 0


def extend_tokens(req: Any, restored: bool) -> int:
    """Tokens the request's admission computes (rotasched.views.extend_tokens)."""
    return rules_.extend_tokens(len(req.origin_input_ids), len(req.output_ids), resident(req, restored))


def waiting_need(sched: Any, req: Any, restored: bool, clip: int = CLIP_MAX_NEW_TOKENS) -> float:
    """Device tokens a waiting request needs to be admitted now (rotasched.views.waiting_need, at
    SGLang's admission ratio: all its remaining outputs)."""
    out = len(req.output_ids)
    return rules_.waiting_need(len(req.origin_input_ids), out, resident(req, restored),
                               req.sampling_params.max_new_tokens - out, rules_.ADMISSION_RATIO, clip)


def free_blocks(sched: Any, also_free_tokens: int, reserved: float, block_tokens: int) -> int:
    """The budget SGLang's PrefillAdder admits against, in rotation blocks: free + evictable
    tokens minus the decode reserve of every running request (`reserved`: `StepViews.build`'s),
    plus `also_free_tokens` (slots held for prefetches: given back before anything is allocated,
    unless their request resumes now)."""
    alloc, tree = sched.token_to_kv_pool_allocator, sched.tree_cache
    return rules_.free_blocks(alloc.available_size() + also_free_tokens + tree.evictable_size(), reserved,
                              block_tokens)


class BatchRows:
    """The requests of one batch list as a set of ids, built once per list: `rotatable` asks about
    the last batch for every running request (and `decode_shortage.may_rotate` about its decode
    rows), and walking the batch for each one costs O(running x batch) a step (9.4 ms for 1,000
    running requests on the dev VM). Keyed on the list's identity and length: SGLang builds a new
    list when it filters a batch and extends the list when it merges one. The list is held, so no
    id in the set can be reused meanwhile."""

    def __init__(self) -> None:
        self._reqs: list[Any] | None = None
        self._len = -1
        self._ids: frozenset[int] = frozenset()

    def holds(self, reqs: list[Any], req: Any) -> bool:
        if reqs is not self._reqs or len(reqs) != self._len:
            self._reqs, self._len, self._ids = reqs, len(reqs), frozenset(map(id, reqs))
        return id(req) in self._ids


_LAST_BATCH_ROWS = BatchRows()


def rotatable(sched: Any, req: Any) -> bool:
    """Whether the request's KV may be moved to host now (not mid-prefill, no grammar, multimodal,
    beam or session state our rotation does not carry)."""
    if req is sched.chunked_req or not rotation.can_rotate(req):
        return False
    if getattr(req, "grammar", None) is not None or getattr(req, "multimodal_inputs", None) is not None:
        return False
    if getattr(req, "beam_group", None) is not None or getattr(req, "session", None) is not None:
        return False
    last = sched.last_batch
    # Under the overlap scheduler a prefill still in flight is writing this request's KV.
    return not (last is not None and last.forward_mode.is_extend() and _LAST_BATCH_ROWS.holds(last.reqs, req))


def view(clk: ReqClock, req: Any, state: ReqState, need: int, held: int, can_rotate: bool,
         prefill_tokens: int = 0, clip: int = CLIP_MAX_NEW_TOKENS) -> ReqView:
    """One request's view with its block counts given (rotasched.views.view)."""
    return rules_.view(clk, state, need, held, can_rotate, prefill_tokens, _left(req), clip)


def waiting_view(rules: ViewRules, clk: ReqClock, req: Any, restored: bool) -> ReqView:
    """A waiting request's view, its need at SGLang's admission ratio (rotasched.views.ADMISSION_RATIO)."""
    return rules.waiting(clk, len(req.origin_input_ids), len(req.output_ids), resident(req, restored),
                         _left(req), rules_.ADMISSION_RATIO, req.sampling_params.ignore_eos)


def same_objects(a: list[Any], b: list[Any]) -> bool:
    """The same objects in the same order (identity, at C speed)."""
    return len(a) == len(b) and all(map(is_, a, b))


class QueueWatch:
    """What changed in SGLang's waiting queue since the last look. SGLang appends to and rebuilds
    that list in many places; comparing the identities of its entries (at C speed) tells whether
    it changed at all, and which entries came and went, without a Python step per queued request
    where only arrivals were appended (the common change). The entries seen are held, so their ids
    cannot be reused by new objects meanwhile. What changed is kept until `StepViews` takes it
    (`take`), however often the queue was looked at."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget the last look: every entry is new again (after aborts dropped clocks)."""
        self._held: list[Any] = []
        self._id_set: set[int] = set()
        self._changed, self._new, self._gone = True, [], []  # since the last `take`
        self.by_rid: dict[str, Any] = {}  # rid -> request, in queue order

    def look(self, queue: list[Any]) -> list[Any]:
        """The entries new since the last look (all of them after `reset`)."""
        held = self._held
        n = len(held)
        if len(queue) == n and same_objects(queue, held):
            return []
        if len(queue) > n and same_objects(queue[:n], held):
            new = queue[n:]  # arrivals appended: only they are looked at
            held += new
            self._id_set.update(map(id, new))
            self.by_rid.update((r.rid, r) for r in new)
        else:
            ids = set(map(id, queue))
            self._gone += [r for r in held if id(r) not in ids]
            seen = self._id_set
            new = [r for r in queue if id(r) not in seen]
            self._held, self._id_set = list(queue), ids
            self.by_rid = {r.rid: r for r in queue}
        self._changed = True
        self._new += new
        return new

    def note_removed(self, reqs: list[Any]) -> None:
        """Requests the runtime's admission took out of the queue, which otherwise keeps its
        order: forgotten here, so the next look finds the rest in place (one C-speed search each,
        not a look at every entry)."""
        held, ids, by_rid = self._held, self._id_set, self.by_rid
        for r in reqs:
            if id(r) in ids:
                del held[held.index(r)]  # (Req compares by identity)
                ids.discard(id(r))
                if by_rid.get(r.rid) is r:
                    del by_rid[r.rid]
                self._gone.append(r)
                self._changed = True

    def take(self) -> tuple[bool, list[Any], list[str]]:
        """(whether the queue changed, the entries that came and are still queued, the rids of
        those that left and are not queued) since the last take."""
        changed, new, gone, by_rid = self._changed, self._new, self._gone, self.by_rid
        self._changed, self._new, self._gone = False, [], []
        return (changed, [r for r in new if by_rid.get(r.rid) is r],
                [r.rid for r in gone if r.rid not in by_rid])


class StepViews:
    """A step's views of every running, waiting and rotary request, and the running batch's decode
    reserve (the free-block budget's and prefetch room's: each request's reserve computed once).

    Between decode steps only running requests change, and what a policy reads of them every step
    (state, stint, SLOs, first token, gaps left to miss) comes from their clocks: a running view
    is kept while its clock's `version` is the one it was built at. Its blocks and rotatability,
    which only LVF's wall and victims read, are checked when LVF asks (`StepQueue.fresh_running`,
    `StepQueue.movable`: `_refresh`). Waiting and rotary views live in a `PendingIndex` kept between steps: a step
    looks at a waiting request only when it entered the queue (`QueueWatch`), or when what every
    view reads moved (SGLang's new-token ratio, the set of restored requests), and at the rotary
    set only when it changed. `reuse=False` builds every view afresh (the reference the
    incremental path is tested against)."""

    def __init__(self, rules: ViewRules, reuse: bool = True) -> None:
        self.rules = rules
        self.cache: dict[str, _Running] | None = {} if reuse else None
        self.watch = QueueWatch()
        self.pending = PendingIndex()
        self._filed: dict[str, tuple[object, ...]] = {}  # rid -> key of its view in `pending`
        self._stale = True  # file every waiting and rotary request again at the next sync
        self._restored: frozenset[str] = frozenset()
        # the rotary entries at the last sync, held (not their id()s: a freed entry's address is
        # reused by the next one parked, and a changed set would read as the same)
        self._rotary_entries: list[Any] = []
        self._rotary_rids: list[str] = []
        self._live: list[Any] = []  # the running batch at the last build, and its views as kept
        self._hits: list[_Running] = []

    def reset(self) -> None:
        """Look at every request again next step (clocks were dropped: aborts)."""
        self.watch.reset()
        self.pending, self._filed, self._stale = PendingIndex(), {}, True
        self._live, self._hits = [], []
        if self.cache is not None:
            self.cache = {}

    def build(self, sched: Any, live: list[Any], clocks: dict[str, ReqClock], restored: Any,
              rotary: dict[str, Any], young: float) -> tuple[StepQueue, float]:
        """`live`: the running batch's unfinished requests (their clocks observed this step);
        `restored`: rids of waiting requests whose KV is back (a container); `rotary`: rid ->
        entry (`.req`, `.host_kv`); `young`: stints that began after it are within the quantum.
        The waiting queue is the one `watch.look` last saw. Returns the step's queue (its running
        views' blocks and rotatability refreshed when LVF asks) and
        the running batch's decode reserve."""
        tracker = getattr(sched, "new_token_ratio_tracker", None)
        sglang_ratio = tracker.current if tracker is not None else 1.0
        if self.cache is None:  # the reference: every view afresh
            running, reserved = [], 0.0
            for req in live:
                built = self._build_running(sched, req, clocks[req.rid], young, sglang_ratio)
                running.append(built.view)
                reserved += built.reserve
            pending = PendingIndex(view for _, (_, view) in self._pending(clocks, restored, sched.waiting_queue,
                                                                          rotary))
            return StepQueue(running, pending), reserved
        running, reserved, tokens = self._running(sched, live, clocks, young, sglang_ratio)
        self._sync(sched, clocks, restored, rotary)
        # Each running view holds blocks(its tokens + its reserve) >= that over the block size; the
        # float sums' rounding is far inside the margin of one block and a relative 1e-9.
        floor = max(0, int((tokens + reserved) / self.rules.block_tokens * (1.0 - 1e-9)) - 1)
        return StepQueue(running, self.pending, lambda views: self._refresh(sched, young, sglang_ratio, views),
                         lambda views: self._refresh(sched, young, sglang_ratio, views, movable=True), floor), reserved

    def _running(self, sched: Any, live: list[Any], clocks: dict[str, ReqClock], young: float,
                 sglang_ratio: float) -> tuple[list[ReqView], float, int]:
        """The running views, each kept while its clock is at the version it was built at (what
        the policy reads every step comes from the clock), the batch's decode reserve and its
        tokens."""
        rules, cache = self.rules, self.cache
        assert cache is not None
        clip = rules.clip
        # the running ratio (rotasched.views.running_reserve_ratio) of each kind, once a step
        fixed_ratio, eos_ratio = rules.running_ratio(True, sglang_ratio), rules.running_ratio(False, sglang_ratio)
        same = same_objects(live, self._live)  # the batch as at the last step (a decode step's)
        # (a kept view's clock is the request's: `reset` empties the cache when clocks go)
        kept = self._hits if same else [cache.get(r.rid) for r in live]
        hits: list[_Running] = []
        running: list[ReqView] = []
        rebuilt: list[_Running] = []
        reserved, tokens = 0.0, 0
        for req, hit in zip(live, kept):
            if hit is None or hit.version != hit.clock.version or hit.req is not req:
                hit = self._build_running(sched, req, clocks[req.rid], young, sglang_ratio)
                rebuilt.append(hit)
            hits.append(hit)
            running.append(hit.view)
            outputs = len(req.output_ids)
            tokens += hit.prompt + outputs
            # SGLang's reserve of it, for the free blocks (rotasched.views.reserve_tokens)
            reserved += rules_.reserve_tokens(hit.max_new - outputs, fixed_ratio if hit.fixed else eos_ratio, clip)
        if not same:
            self.cache = {h.req.rid: h for h in hits}  # requests gone since the last step drop out
        else:
            for h in rebuilt:
                cache[h.req.rid] = h
        self._live, self._hits = list(live), hits
        return running, reserved, tokens

    def _refresh(self, sched: Any, young: float, sglang_ratio: float, views: list[ReqView],
                 movable: bool = False) -> list[ReqView]:
        """`views` (this step's running views, as `_running` kept them) with every field current: a
        view is rebuilt only where its blocks or its rotatability moved (the rest comes from its
        clock, at the version it was built at). `movable`: only those that may be rotated out now
        (rotatable, holding blocks); the others' blocks are not looked at."""
        cache, rules = self.cache, self.rules
        assert cache is not None
        fixed_ratio, eos_ratio = rules.running_ratio(True, sglang_ratio), rules.running_ratio(False, sglang_ratio)
        out: list[ReqView] = []
        for view in views:
            hit = cache[view.rid]
            req, start = hit.req, view.run_start
            can = start is not None and start <= young and rotatable(sched, req)
            if movable and not can:
                continue
            outputs = len(req.output_ids)
            reserve = rules_.reserve_tokens(hit.max_new - outputs, fixed_ratio if hit.fixed else eos_ratio, rules.clip)
            if rules_.blocks(hit.prompt + outputs + reserve, rules.block_tokens) != view.blocks_held or \
                    can != view.rotatable:
                # in place: the step's kept list (`_hits`) and the cache hold this one object
                built = self._build_running(sched, req, hit.clock, young, sglang_ratio)
                hit.version, hit.view, hit.reserve = built.version, built.view, built.reserve
            if not movable or hit.view.blocks_held > 0:
                out.append(hit.view)
        return out

    def _build_running(self, sched: Any, req: Any, clk: ReqClock, young: float, sglang_ratio: float) -> _Running:
        """One running request's view, as of now."""
        rules = self.rules
        fixed, left = req.sampling_params.ignore_eos, _left(req)
        ratio = rules.running_ratio(fixed, sglang_ratio)
        start = clk.run_start
        can = start is not None and start <= young and rotatable(sched, req)
        return _Running(clk, clk.version, rules.running(clk, req.seqlen, left, ratio, can, fixed), len(req.origin_input_ids),
                        req.sampling_params.max_new_tokens, fixed, req, rules_.reserve_tokens(left, ratio, rules.clip))

    def _sync(self, sched: Any, clocks: dict[str, ReqClock], restored: Any, rotary: dict[str, Any]) -> None:
        """Bring the pending index up to the queue and the rotary set: drop who left, file who came
        or changed."""
        back = frozenset(restored)
        every = self._stale or back != self._restored
        entries = list(rotary.values())
        rotary_moved = every or not same_objects(entries, self._rotary_entries)
        watch = self.watch
        changed, new, gone = watch.take()
        if not (every or changed or rotary_moved):
            return
        filed, pending = self._filed, self.pending
        queued = watch.by_rid
        if rotary_moved:  # rotary requests that left (resumed ones are queued: re-filed below)
            gone = gone + [rid for rid in self._rotary_rids if rid not in rotary]
        for rid in gone:
            if rid in filed and rid not in queued and rid not in rotary:
                del filed[rid]
                pending.drop(rid)
        self._stale, self._restored, self._rotary_entries = False, back, entries
        self._rotary_rids = list(rotary)
        waiting = sched.waiting_queue if every else new
        for rid, (key, view) in self._pending(clocks, back, waiting, rotary if rotary_moved else {}):
            filed[rid] = key
            pending.put(view)

    def _pending(self, clocks: dict[str, ReqClock], restored: Any, waiting: Any, rotary_now: dict[str, Any]
                 ) -> Iterator[tuple[str, tuple[tuple[object, ...], ReqView]]]:
        """(rid, (key, view)) of the `waiting` requests and the `rotary_now` entries whose key differs
        from the one filed (every one for the reference, `reuse=False`)."""
        rules, filed, fresh = self.rules, self._filed, self.cache is None
        for req in waiting:
            rid = req.rid
            clk, back = clocks[rid], rid in restored
            key = (clk, _WAIT, len(req.output_ids), back)
            if fresh or filed.get(rid) != key:
                yield rid, (key, waiting_view(rules, clk, req, back))
        for rid, entry in rotary_now.items():
            clk, req, host = clocks[rid], entry.req, entry.host_kv.num_tokens
            key = (clk, _ROT, len(req.output_ids), host)
            if fresh or filed.get(rid) != key:
                yield rid, (key, rules.rotary(clk, host, _left(req), rules_.ADMISSION_RATIO))


_RUN, _WAIT, _ROT = ReqState.RUNNING, ReqState.WAITING, ReqState.ROTARY


@dataclass(slots=True)
class _Running:
    """A running request's view as built, with what decides whether it still holds."""

    clock: ReqClock
    version: int  # the clock's at the build
    view: ReqView
    prompt: int
    max_new: int
    fixed: bool  # ignore_eos: its reserve keeps the running share
    req: Any
    reserve: float  # its decode reserve at the build
