"""What the policy sees of SGLang's requests: the numbers `rotasched.views` builds ReqViews, block
needs and the free-block budget from, read off SGLang's Req and scheduler objects. The rules
themselves (the decode reserve, block rounding, the clip) are the pure builder's, which the
simulator adapts its requests to as well.
"""

from __future__ import annotations

import os
from typing import Any

from ..rotasched import ReqState, ReqView
from ..rotasched import views as rules_
from ..rotasched.clock import ReqClock
from ..rotasched.views import CLIP_MAX_NEW_TOKENS, ViewRules
from . import rotation

CLIP_ENV = "SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION"


def clip_max_new_tokens() -> int:
    """SGLang's clip of a decode reserve: it reads the same variable for its own (schedule_policy),
    so ours must match. Read when a runtime is created (startup.create_runtime), not at import."""
    return int(os.environ.get(CLIP_ENV, str(CLIP_MAX_NEW_TOKENS)))


def _left(req: Any) -> int:
    return req.sampling_params.max_new_tokens - len(req.output_ids)


def _ratio(sched: Any, req: Any) -> float:
    """SGLang's new-token ratio for this request's reserve (1 when it ignores EOS)."""
    return 1.0 if req.sampling_params.ignore_eos else sched.new_token_ratio_tracker.current


def reserve(sched: Any, req: Any, clip: int = CLIP_MAX_NEW_TOKENS) -> float:
    """SGLang's decode reserve of one request admitted now (its remaining outputs x the new-token
    ratio): a waiting or rotary candidate's."""
    return rules_.reserve_tokens(_left(req), _ratio(sched, req), clip)


def running_reserve(sched: Any, req: Any, share: float, clip: int = CLIP_MAX_NEW_TOKENS) -> float:
    """A running request's decode reserve: `share` of its remaining outputs when it is fixed-length
    (rotasched.views.running_reserve_ratio; SGLang's PrefillAdder applies the same rule: hooks.py)."""
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
    """Device tokens a waiting request needs to be admitted now (rotasched.views.waiting_need)."""
    out = len(req.output_ids)
    return rules_.waiting_need(len(req.origin_input_ids), out, resident(req, restored),
                               req.sampling_params.max_new_tokens - out, _ratio(sched, req), clip)


def free_blocks(sched: Any, also_free_tokens: int, reserved: float, block_tokens: int) -> int:
    """The budget SGLang's PrefillAdder admits against, in rotation blocks: free + evictable
    tokens minus the decode reserve of every running request (`reserved`: `StepViews.build`'s),
    plus `also_free_tokens` (slots held for prefetches: given back before anything is allocated,
    unless their request resumes now)."""
    alloc, tree = sched.token_to_kv_pool_allocator, sched.tree_cache
    return rules_.free_blocks(alloc.available_size() + also_free_tokens + tree.evictable_size(), reserved,
                              block_tokens)


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
    return not (last is not None and last.forward_mode.is_extend() and any(r is req for r in last.reqs))


def view(clk: ReqClock, req: Any, state: ReqState, need: int, held: int, can_rotate: bool,
         prefill_tokens: int = 0, clip: int = CLIP_MAX_NEW_TOKENS) -> ReqView:
    """One request's view with its block counts given (rotasched.views.view)."""
    return rules_.view(clk, state, need, held, can_rotate, prefill_tokens, _left(req), clip)


def waiting_view(rules: ViewRules, clk: ReqClock, req: Any, restored: bool, sglang_ratio: float) -> ReqView:
    ratio = 1.0 if req.sampling_params.ignore_eos else sglang_ratio
    return rules.waiting(clk, len(req.origin_input_ids), len(req.output_ids), resident(req, restored),
                         _left(req), ratio)


class StepViews:
    """A step's views of every running, waiting and rotary request, and the running batch's decode
    reserve (the free-block budget's and prefetch room's: each request's reserve computed once).

    A view depends on the step's time only through the quantum (`can`), so one whose inputs are as
    at its last build (its clock, outputs, host KV, the ratio of its reserve) is reused: between
    decode steps only running requests change, and of those only what the policy reads is checked
    (below; `reads_running_progress`: the goodput policy's gap budgets and first tokens).
    `reuse=False` builds every view afresh (the reference the incremental path is tested
    against)."""

    def __init__(self, rules: ViewRules, reads_running_progress: bool, reuse: bool = True) -> None:
        self.rules, self.progress = rules, reads_running_progress
        self.cache: dict[str, tuple[tuple[object, ...], ReqView]] | None = {} if reuse else None

    def build(self, sched: Any, live: list[Any], clocks: dict[str, ReqClock], restored: Any,
              rotary: dict[str, Any], young: float) -> tuple[list[ReqView], float]:
        """`live`: the running batch's unfinished requests; `restored`: rids of waiting requests
        whose KV is back (a container); `rotary`: rid -> entry (`.req`, `.host_kv`); `young`:
        stints that began after it are within the quantum."""
        rules, old = self.rules, self.cache
        bt, clip, share = rules.block_tokens, rules.clip, rules.running_share
        tracker = getattr(sched, "new_token_ratio_tracker", None)
        sglang_ratio = tracker.current if tracker is not None else 1.0
        cache: dict[str, tuple[tuple[object, ...], ReqView]] = {}
        views: list[ReqView] = []
        add, reserved = views.append, 0.0
        for req in live:
            rid, clk = req.rid, clocks[req.rid]
            fixed, left = req.sampling_params.ignore_eos, _left(req)
            ratio = share if fixed else sglang_ratio
            reserve = rules_.reserve_tokens(left, ratio, clip)
            reserved += reserve
            start = clk.run_start
            can = start is not None and start <= young and rotatable(sched, req)
            # What a policy reads of a running request: its blocks, stint and rotatability (LVF),
            # and, for one that reads its progress (goodput), its gaps left to miss and whether its
            # first token came. Its last token's time and outputs left are read only of waiting and
            # rotary requests, so a view kept for them may hold older values.
            key: tuple[object, ...] = (clk, _RUN, rules_.blocks(req.seqlen + reserve, bt), can, start)
            if self.progress:
                key += (clk.misses_left(left if left > 0 else 0), clk.first_token)
            hit = None if old is None else old.get(rid)
            if hit is None or hit[0] != key:
                hit = (key, rules.running(clk, req.seqlen, left, ratio, can))
            cache[rid] = hit
            add(hit[1])
        for req in sched.waiting_queue:
            rid = req.rid
            clk, back = clocks[rid], rid in restored
            ratio = 1.0 if req.sampling_params.ignore_eos else sglang_ratio
            key = (clk, _WAIT, len(req.output_ids), back, ratio)
            hit = None if old is None else old.get(rid)
            if hit is None or hit[0] != key:
                hit = (key, waiting_view(rules, clk, req, back, sglang_ratio))
            cache[rid] = hit
            add(hit[1])
        for rid, entry in rotary.items():
            clk, req, host = clocks[rid], entry.req, entry.host_kv.num_tokens
            ratio = 1.0 if req.sampling_params.ignore_eos else sglang_ratio
            key = (clk, _ROT, len(req.output_ids), host, ratio)
            hit = None if old is None else old.get(rid)
            if hit is None or hit[0] != key:
                hit = (key, rules.rotary(clk, host, _left(req), ratio))
            cache[rid] = hit
            add(hit[1])
        if old is not None:
            self.cache = cache  # requests gone since the last step drop out
        return views, reserved


_RUN, _WAIT, _ROT = ReqState.RUNNING, ReqState.WAITING, ReqState.ROTARY
