"""The RotaSched step, once for the server and the simulator: from request views to a Decision
and the order in which SGLang's PrefillAdder is offered the waiting queue.

`integration/runtime.py` and `sim/policies/rotasched.py` both build views of their requests
(`rotasched.views`) and call `plan_step` and `admission_order`; the rules below exist nowhere
else. The policy is chosen by name (--policy) from `POLICIES`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet

from superinfer_sgl.registry import Registry
from superinfer_sgl.rotasched.goodput import GoodputLvf
from superinfer_sgl.rotasched.lvf import Decision, idle_resume, lvf_decide
from superinfer_sgl.rotasched.pending import StepQueue
from superinfer_sgl.rotasched.policy import LvfPolicy, PaperLvf, PolicyClass
from superinfer_sgl.rotasched.request_view import ReqView
from superinfer_sgl.rotasched.vlt import VltParams
# The memory rules live with the view builder (rotasched/views.py); named here too, for callers
# that plan steps.
from superinfer_sgl.rotasched.views import (  # noqa: F401
    CLIP_MAX_NEW_TOKENS,
    blocks,
    extend_tokens,
    reserve_tokens,
    running_reserve_ratio,
    waiting_need,
)

# The server's --policy choices (the first is the default's place in --help only).
POLICIES: Registry[PolicyClass] = Registry("policy", {"goodput": GoodputLvf, "paper": PaperLvf})
# --mix-prefill: "always" (every prefill rides with the decode batch where the server mixes);
# "needed" (a step that leaves nobody waiting mixes only when the policy says: `plan_step`).
MIX_PREFILL = ("always", "needed")

PAPER_BUDGET_BLOCKS = 2400  # the paper's B_xfer
BUDGET_POOL_SHARE = 8  # default budget: at most 1/8 of the device KV pool per iteration


def rotation_budget(blocks: int | None, pool_tokens: int, block_tokens: int,
                    link_blocks_per_step: float | None = None) -> int:
    """B_xfer, rotation blocks per iteration and direction: `blocks` if set (the flag), else
    (auto) the blocks the KV link moves in one decode step, `link_blocks_per_step` (measured link
    bandwidth times measured step time, over bytes per block: a step's copies then hide under the
    next step's compute where they overlap, as on a GPU), or the paper's 2400 while that is unknown;
    either way at most an eighth of the device pool (2400 blocks exceed a small pool many times
    over; then every iteration could reshuffle all of memory)."""
    if blocks is not None:
        return blocks
    link = PAPER_BUDGET_BLOCKS if link_blocks_per_step is None else int(link_blocks_per_step)
    return max(1, min(link, pool_tokens // block_tokens // BUDGET_POOL_SHARE))


def quantum_s(policy: str, min_stint_ms: float | None, rotation_s: float) -> float:
    """The rotation quantum (a running request is not rotated out before this long in its stint):
    `min_stint_ms` if set, else the policy's default for a rotation that costs `rotation_s`."""
    if min_stint_ms is not None:
        return min_stint_ms / 1000.0
    return POLICIES[policy].quantum_s(rotation_s)


def plan_step(views: Sequence[ReqView] | StepQueue, free_blocks: int, budget_blocks: int, now: float,
              params: VltParams, policy: LvfPolicy, chunked_active: bool, mixed: bool = True,
              mix_prefill: str = "always", host_room_blocks: int | None = None) -> Decision:
    """LVF's decision, plus the idle resume when no chunked prefill is making progress, plus the
    policy's prefill cap of this step (`prefill_cap`, then `step_cap` once the admissions are
    known). `views`: a flat list, or the server's `StepQueue` (its pending index kept between
    steps). `mixed`: the server lets prefills ride with the decode batch (SGLang's mixed chunk).
    Without it SGLang runs a prefill alone and the next chunk of a split prompt before any decode,
    so the running requests wait for the whole prompt however it is chunked: the TBT cap would
    protect nobody and only add steps. It is left out then; `step_cap`'s TTFT deadlines stay.
    `mix_prefill` (MIX_PREFILL) "always", the default: where the server mixes, every prefill is
    mixed. "needed": a step that leaves nobody waiting may run its prefill alone (`Decision.mix`,
    `LvfPolicy.mixes`: goodput mixes then only when a running request's next gap needs it), and
    then without the TBT cap too; while requests wait, a mixed step saves the running batch a
    decode step's fixed time, throughput the queue needs (in the simulator, running those
    prefills alone too cost 5-6% of the output throughput past capacity). Resumes always ride
    along (`mixes`). `host_room_blocks`: blocks the host pool can still take (`lvf_decide`
    rotates out no more)."""
    queue = views if isinstance(views, StepQueue) else StepQueue.of(views)
    policy = policy.batched(queue.running)
    cap = policy.prefill_cap(queue.running) if mixed else None
    if cap is not None:
        policy = policy.capped(cap)
    decision = lvf_decide(queue, free_blocks, budget_blocks, now, params, policy, host_room_blocks)
    if not chunked_active:
        decision = idle_resume(decision, queue, now, params, policy)
    pending = queue.pending.views
    admitted: list[ReqView] = [pending[rid] for rid in decision.admit]
    mix = mixed
    nobody_left = bool(admitted) and len(queue.pending) == len(admitted)  # every queued request admitted
    if mixed and mix_prefill == "needed" and not decision.resume and nobody_left:
        # a split prompt's rest is not in the views: unknown, the policy assumes the worst
        mix = policy.mixes(queue.running, None if chunked_active else sum(v.prefill_tokens for v in admitted))
    cap = policy.step_cap(queue.running, admitted, now, cap if mix else None)
    if cap is not None or not mix:
        decision = dataclasses.replace(decision, prefill_cap=cap, mix=mix)
    return decision


def mixes(decision: Decision, restored: Sequence[str]) -> bool:
    """Whether this step's prefill rides with the decode batch, where the server mixes at all: as
    the decision says, and always while restored requests are queued (a resume's one-token extend
    stalls nobody only mixed)."""
    return decision.mix or bool(restored)


def chunk_tokens(configured: int | None, decision: Decision, mixed_rows: int = 0) -> int | None:
    """The chunked-prefill size of this step: the configured one, lowered so that the step carries
    at most the decision's cap of prefill tokens. SGLang's PrefillAdder charges a mixed step's
    decode rows (one token per running request) to the same budget, so they are added back
    (`mixed_rows`; the simulator does not charge them: 0). None or <= 0 configured (chunking off)
    stays as it is: a prompt cannot be split then."""
    if configured is None or configured <= 0 or decision.prefill_cap is None:
        return configured
    return min(configured, decision.prefill_cap + max(0, mixed_rows))


def admission_order(waiting: Iterable[str], restored: Sequence[str], decision: Decision) -> list[str]:
    """The waiting queue as the PrefillAdder sees it: restored requests (resumed earlier or now,
    their KV back in the radix tree) first, then LVF's admissions in LVF's order (a rid in both
    keeps its later place), then every other waiting request in queue order: LVF counts in whole
    blocks (need rounded up, free rounded down), so a request that fits in tokens could otherwise
    never be offered, and the adder admits them only into memory that is really free. When LVF
    stopped at an urgent request that does not fit, only that one follows: the others must not
    take the memory it waits for. `waiting` is the queue (restored rids may already be in it)."""
    first = [*restored, *decision.admit]
    rank = {rid: i for i, rid in enumerate(first)}  # a rid listed twice keeps its later place
    queued = waiting if isinstance(waiting, AbstractSet) else set(waiting)  # (the server's: dict keys)
    ranked = sorted((rid for rid in rank if rid in queued or rid in restored), key=rank.__getitem__)
    blocked = decision.blocked
    if blocked is not None:  # (rids are unique: the queue's rest is the blocked one, or nobody)
        return ranked + ([blocked] if blocked in queued and blocked not in rank else [])
    return ranked + ([rid for rid in waiting if rid not in rank] if rank else list(waiting))
