"""What the policy sees of SGLang's requests: ReqViews, block needs and the free-block budget.

Reads SGLang's Req and scheduler objects; the rules (the decode reserve, block rounding) are the
shared planner's (`rotasched.planner`), so the simulator builds its views by the same arithmetic.
"""

from __future__ import annotations

import os
from typing import Any

from ..rotasched import ReqState, ReqView
from ..rotasched import planner
from ..rotasched.clock import ReqClock
from . import rotation

# SGLang reads the same variable for its own decode reserve: the clip must match it.
CLIP_MAX_NEW_TOKENS = int(os.environ.get("SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION",
                                         str(planner.CLIP_MAX_NEW_TOKENS)))


def reserve(sched: Any, req: Any) -> float:
    """SGLang's decode reserve of one request admitted now (its remaining outputs x the new-token
    ratio): a waiting or rotary candidate's."""
    return planner.reserve_tokens(req.sampling_params.max_new_tokens - len(req.output_ids),
                                  _ratio(sched, req), CLIP_MAX_NEW_TOKENS)


def running_reserve(sched: Any, req: Any, share: float) -> float:
    """A running request's decode reserve: `share` of its remaining outputs when it is fixed-length
    (planner.running_reserve_ratio; SGLang's PrefillAdder applies the same rule: hooks.py)."""
    fixed = req.sampling_params.ignore_eos
    ratio = planner.running_reserve_ratio(fixed, share if fixed else sched.new_token_ratio_tracker.current, share)
    return planner.reserve_tokens(req.sampling_params.max_new_tokens - len(req.output_ids), ratio,
                                  CLIP_MAX_NEW_TOKENS)


def _ratio(sched: Any, req: Any) -> float:
    """SGLang's new-token ratio for this request's reserve (1 when it ignores EOS)."""
    return 1.0 if req.sampling_params.ignore_eos else sched.new_token_ratio_tracker.current


def resident(req: Any, restored: bool) -> int:
    """Tokens of a waiting request already on the device: a resumed (`restored`) request's KV."""
    return rotation.restorable_tokens(req) if restored else 0


def extend_tokens(req: Any, restored: bool) -> int:
    """Tokens the request's admission computes (planner.extend_tokens)."""
    return planner.extend_tokens(len(req.origin_input_ids), len(req.output_ids), resident(req, restored))


def waiting_need(sched: Any, req: Any, restored: bool) -> float:
    """Device tokens a waiting request needs to be admitted now (planner.waiting_need)."""
    out = len(req.output_ids)
    return planner.waiting_need(len(req.origin_input_ids), out, resident(req, restored),
                                req.sampling_params.max_new_tokens - out, _ratio(sched, req),
                                CLIP_MAX_NEW_TOKENS)


def free_blocks(sched: Any, running_batch: Any, also_free_tokens: int, block_tokens: int, share: float) -> int:
    """The budget SGLang's PrefillAdder admits against, in rotation blocks: free + evictable
    tokens minus the decode reserve of every running request (`running_reserve`), plus
    `also_free_tokens` (slots held for prefetches: given back before anything is allocated,
    unless their request resumes now)."""
    alloc, tree = sched.token_to_kv_pool_allocator, sched.tree_cache
    reserved = sum(running_reserve(sched, r, share) for r in running_batch.reqs if not r.finished())
    return max(0, int(alloc.available_size() + also_free_tokens + tree.evictable_size() - reserved)
               // block_tokens)


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
         prefill_tokens: int = 0) -> ReqView:
    """One request's view: its clock's times and SLO, the blocks it needs or holds, and what the
    goodput policy reads (gaps it may still miss and outputs left, from `max_new_tokens`; TTFT
    met; class weight)."""
    left = max(req.sampling_params.max_new_tokens - len(req.output_ids), 0)
    return ReqView(
        rid=clk.rid, state=state, arrival=clk.arrival, last_token=clk.last_token,
        run_start=clk.run_start if state == ReqState.RUNNING else None,
        ttft_slo=clk.slo.ttft_s, tbt_slo=clk.slo.tbt_s,
        blocks_needed=need, blocks_held=held, rotatable=can_rotate,
        prefill_tokens=max(0, prefill_tokens), misses_left=clk.misses_left(left), ttft_met=clk.ttft_met,
        weight=clk.slo.weight, outputs_left=min(left, CLIP_MAX_NEW_TOKENS),
    )
