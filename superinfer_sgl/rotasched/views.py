"""Request views from plain numbers: the one builder behind the server's views
(integration/views.py, over SGLang's `Req`) and the simulator's (sim/policies/rotasched.py, over
`SimReq`), and the memory rules both count by.

An adapter reads a request's numbers (its clock, prompt and output tokens, tokens resident on the
device, outputs left, the new-token ratio) and hands them to `ViewRules`; the arithmetic (decode
reserve, block rounding, clipping) exists only here. Pure Python.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from superinfer_sgl.rotasched.clock import ReqClock
from superinfer_sgl.rotasched.request_view import ReqState, ReqView

# SGLang's SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION default: the decode reserve clips outputs here.
CLIP_MAX_NEW_TOKENS = 4096
_WAITING, _RUNNING, _ROTARY = ReqState.WAITING, ReqState.RUNNING, ReqState.ROTARY
# SGLang's PrefillAdder admits a waiting request (a resumed one re-admitted too) against all its
# remaining outputs, clipped, whatever the new-token ratio (`add_one_req`): the ratio discounts
# only the reserves of requests already running. A candidate's need is counted at this ratio; at
# SGLang's decayed ratio, resumes of requests that may stop at EOS were planned that its adder then
# refused, and in the simulator their restored KV filled the pool with nothing left running.
ADMISSION_RATIO = 1.0


def reserve_tokens(outputs_left: int, new_token_ratio: float, clip: int = CLIP_MAX_NEW_TOKENS) -> float:
    """SGLang's decode reserve of one request: its remaining outputs, clipped, times the ratio
    (min(max(outputs_left, 0), clip) * ratio, without builtin calls: every running request's,
    every step)."""
    if outputs_left <= 0:
        return 0.0
    return (outputs_left if outputs_left < clip else clip) * new_token_ratio


def running_reserve_ratio(ignore_eos: bool, sglang_ratio: float, share: float) -> float:
    """The new-token ratio of a *running* request's decode reserve: `share` (`running_reserve`) of
    SGLang's. SGLang keeps back every remaining output token of a fixed-length request (ignore_eos,
    ratio 1) and its decaying estimate `sglang_ratio` of one that may stop at EOS (raised again
    after a retraction, or a shortage we answer by rotation). Below 1 more requests share the device
    pool, and when it runs short LVF rotates a request out to host memory instead of SGLang
    retracting one to recompute. A waiting candidate's own need (`waiting_need`) is SGLang's
    either way."""
    return share * (1.0 if ignore_eos else sglang_ratio)


def extend_tokens(prompt_tokens: int, outputs: int, resident: int) -> int:
    """Tokens a waiting request's admission computes: its prompt and outputs so far, less what is
    already resident on the device (a resumed request's restored KV)."""
    return prompt_tokens + outputs - resident


def waiting_need(prompt_tokens: int, outputs: int, resident: int, outputs_left: int,
                 new_token_ratio: float, clip: int = CLIP_MAX_NEW_TOKENS) -> float:
    """Device tokens a waiting request needs to be admitted now: `extend_tokens` plus its decode
    reserve (`reserve_tokens`). The one rule for the server's views, its prefetch room, its
    headroom gauges and the simulator (whose stock admission passes ratio 1)."""
    return extend_tokens(prompt_tokens, outputs, resident) + reserve_tokens(outputs_left, new_token_ratio, clip)


def rotary_need(host_tokens: int, outputs_left: int, new_token_ratio: float,
                clip: int = CLIP_MAX_NEW_TOKENS) -> float:
    """Device tokens a rotary request needs to resume: its host KV, the last output token (never
    copied: recomputed by the resume's one-token extend) and its decode reserve."""
    return host_tokens + 1 + reserve_tokens(outputs_left, new_token_ratio, clip)


def blocks(tokens: float, block_tokens: int) -> int:
    n = math.ceil(tokens / block_tokens)
    return n if n > 0 else 0


def free_blocks(free_tokens: float, reserved_tokens: float, block_tokens: int) -> int:
    """The admission budget in blocks: free (and evictable) tokens less the running decode reserve."""
    return max(0, int(free_tokens - reserved_tokens) // block_tokens)


def view(clk: ReqClock, state: ReqState, need: int, held: int, rotatable: bool, prefill_tokens: int,
         outputs_left: int, clip: int = CLIP_MAX_NEW_TOKENS, fixed: bool = False) -> ReqView:
    """One request's view: its clock's times and SLO, the blocks it needs or holds, and what the
    goodput policy reads (gaps it may still miss from `outputs_left`, TTFT met, class weight,
    outputs left clipped as the reserve is: past the clip a server cannot tell long from
    unbounded; `fixed`: it ignores EOS, so its outputs left are known, clipped or not)."""
    left = outputs_left if outputs_left > 0 else 0
    slo = clk.slo
    # Positional, in ReqView's field order: keywords cost ~0.4 us per view.
    return ReqView(clk.rid, state, clk.arrival, clk.last_token, clk.run_start if state is _RUNNING else None,
                   slo.ttft_ms / 1000.0, slo.tbt_ms / 1000.0, need, held, rotatable,
                   prefill_tokens if prefill_tokens > 0 else 0, clk.misses_left(left), clk.ttft_met,
                   slo.weight, left if left < clip else clip, fixed)


@dataclass(frozen=True, slots=True)
class ViewRules:
    """A server's constants of view building: rotation block size, SGLang's reserve clip, and the
    share of SGLang's decode reserve a running request keeps back (`running_share`)."""

    block_tokens: int
    clip: int = CLIP_MAX_NEW_TOKENS
    running_share: float = 1.0

    def __post_init__(self) -> None:
        assert self.block_tokens > 0 and self.clip > 0 and 0 < self.running_share <= 1, self

    def running_ratio(self, ignore_eos: bool, sglang_ratio: float) -> float:
        return running_reserve_ratio(ignore_eos, sglang_ratio, self.running_share)

    def running_reserve(self, outputs_left: int, ignore_eos: bool, sglang_ratio: float) -> float:
        return reserve_tokens(outputs_left, self.running_ratio(ignore_eos, sglang_ratio), self.clip)

    def running(self, clk: ReqClock, seqlen: int, outputs_left: int, ratio: float, rotatable: bool,
                fixed: bool = False) -> ReqView:
        """A running request: it holds its KV (`seqlen` tokens) and its decode reserve at `ratio`
        (`running_ratio`); `fixed`: it ignores EOS (its outputs left, and so its gap budget, are
        exact)."""
        held = blocks(seqlen + reserve_tokens(outputs_left, ratio, self.clip), self.block_tokens)
        return view(clk, _RUNNING, 0, held, rotatable, 0, outputs_left, self.clip, fixed)

    def waiting(self, clk: ReqClock, prompt: int, outputs: int, resident: int, outputs_left: int,
                ratio: float, fixed: bool = False) -> ReqView:
        """A waiting request, `resident` tokens of it already on the device (a restored prefix);
        `fixed`: it ignores EOS (its outputs left are exact)."""
        need = blocks(waiting_need(prompt, outputs, resident, outputs_left, ratio, self.clip), self.block_tokens)
        return view(clk, _WAITING, need, 0, True, extend_tokens(prompt, outputs, resident), outputs_left, self.clip,
                    fixed)

    def rotary(self, clk: ReqClock, host_tokens: int, outputs_left: int, ratio: float) -> ReqView:
        """A rotary request, `host_tokens` of its KV on host."""
        need = blocks(rotary_need(host_tokens, outputs_left, ratio, self.clip), self.block_tokens)
        return view(clk, _ROTARY, need, 0, True, 0, outputs_left, self.clip)
