"""Largest-VLT-First (LVF): RotaSched's per-iteration decision (paper Algorithm 1).

Block units: `free_blocks`, `budget_blocks`, `blocks_needed` and `blocks_held` must all be
counted in the same unit (rotation blocks of --rotary-block-tokens tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from superinfer_sgl.rotasched import goodput as gp_rules
from superinfer_sgl.rotasched.goodput import BEST_EFFORT, PROMOTED, VIABLE, GoodputParams
from superinfer_sgl.rotasched.request_view import ReqState, ReqView
from superinfer_sgl.rotasched.vlt import VltParams, vlts

# Scan order as sortable rows: (tier, key, arrival, rid, view, urgent); rids are unique, so views
# are never compared. The paper's rule: one tier, key -VLT. Goodput mode: gp_rules.tier, key
# gp_rules.rank_key (earliest deadline first). Urgent: VLT > 0 (it may take memory rotation frees).
_Ranked = list[tuple[int, float, float, str, ReqView, bool]]

# Enum member lookups through the class cost ~0.1 us each; these run per view per iteration.
_WAITING, _RUNNING, _ROTARY = ReqState.WAITING, ReqState.RUNNING, ReqState.ROTARY


@dataclass(frozen=True, slots=True)
class Decision:
    """Who moves this iteration. The executor rotates out first, then resumes and admits."""

    admit: tuple[str, ...] = ()  # WAITING rids, in admission order
    resume: tuple[str, ...] = ()  # ROTARY rids, in resume order
    rotate_out: tuple[str, ...] = ()  # RUNNING rids to move to host
    contention: bool = False  # False: memory covered all demand and FCFS was used
    # The request the scan stopped at (urgent: VLT > 0; or goodput mode's best-effort queue head):
    # it did not fit, and nobody ranked below it may take the memory it waits for. The executor
    # offers nobody else outside LVF's choices.
    blocked: str | None = None
    # Goodput mode: the most prefill tokens this iteration may carry (the executor's chunk size
    # for this step, if smaller than the configured one); None: the configured chunk size.
    prefill_cap: int | None = None

    def __post_init__(self) -> None:
        moved = self.admit + self.resume + self.rotate_out
        assert len(set(moved)) == len(moved), f"a rid in two lists: {moved}"

    @property
    def is_noop(self) -> bool:
        return not (self.admit or self.resume or self.rotate_out)


def lvf_decide(
    views: Sequence[ReqView],
    free_blocks: int,
    budget_blocks: int,
    now: float,
    params: VltParams,
    goodput: GoodputParams | None = None,
    chunk: int | None = None,
) -> Decision:
    """Decide admissions, resumes and rotate-outs for one scheduler iteration.

    `goodput`: None is the paper's rule (one tier, LVF by VLT); otherwise goodput mode
    (rotasched.goodput: viable requests before best-effort ones, TBT- and cost-aware victims).
    `chunk`: goodput mode's prefill cap for this step (`goodput.prefill_cap`), which sets how
    long the chosen prefills take; None: uncapped.

    Guarantees: admitted+resumed blocks <= free_blocks + rotated-out blocks; resumed
    blocks <= budget_blocks and rotated-out blocks <= budget_blocks (each direction);
    nobody with VLT < 0 moves in; nobody is rotated out unless an urgent request (VLT > 0 and
    not best-effort) moves in.
    """
    assert free_blocks >= 0 and budget_blocks >= 0, (free_blocks, budget_blocks)
    assert len({v.rid for v in views}) == len(views), "duplicate rid in views"
    pending = [v for v in views if v.state is not _RUNNING]
    if sum([v.blocks_needed for v in pending]) <= free_blocks:  # a list sums faster than a genexpr
        return _fcfs(pending, budget_blocks)
    return _contended(views, pending, free_blocks, budget_blocks, now, params, goodput, chunk)


def idle_resume(decision: Decision, views: Sequence[ReqView], now: float, params: VltParams) -> Decision:
    """The executor's fallback when nothing runs and LVF moves nobody: resume the rotary request
    LVF ranks first anyway. LVF counts in whole blocks (needs rounded up, free memory rounded
    down) and caps resumes at the rotation budget, so a rotary request within a block of the free
    memory, or just over the budget, would otherwise never come back once the server is idle.
    The executor allocates its slots token-exactly and leaves it rotary if they cannot be had.
    """
    if not decision.is_noop or any(v.state is _RUNNING for v in views):
        return decision
    rotary = [v for v in views if v.state is _ROTARY]
    if not rotary:
        return decision
    lags = vlts(rotary, now, params)
    top = min(zip(rotary, lags), key=lambda p: (-p[1], p[0].arrival, p[0].rid))[0]
    return Decision(resume=(top.rid,), contention=decision.contention)


def _fcfs(pending: list[ReqView], budget: int) -> Decision:
    """Step 1: memory covers everyone, so arrival order is fair; only resumes pay budget."""
    pending = sorted(pending, key=lambda v: (v.arrival, v.rid))
    admit = [v.rid for v in pending if v.state is _WAITING]
    resume: list[str] = []
    inbound = 0
    for v in pending:
        if v.state is _ROTARY and inbound + v.blocks_needed <= budget:
            resume.append(v.rid)
            inbound += v.blocks_needed
    return Decision(tuple(admit), tuple(resume), (), contention=False)


def _contended(
    views: Sequence[ReqView],
    waiting_rotary: list[ReqView],
    free: int,
    budget: int,
    now: float,
    params: VltParams,
    goodput: GoodputParams | None,
    chunk: int | None,
) -> Decision:
    """Steps 2-5: head scan by VLT, rotate out from the tail, shrink if the tail falls short."""
    pending, victims = _rank(views, waiting_rotary, now, params, goodput, chunk)
    # Memory an urgent request could ever get: what is free plus what running requests hold.
    wall = free + sum([v.blocks_held for v in views if v.state is _RUNNING])
    scan = _HeadScan(pending, free, budget, wall, now, goodput, chunk)
    chosen, used, blocked = scan.run(free + budget)
    out = _tail_scan(victims, used - free, budget)
    freed = sum(v.blocks_held for v in out)
    if used > free + freed:
        # The tail could not free enough: rescan against what it did free. The rescan
        # keeps every prefix of the first choice that fits, and may fit smaller ones too.
        chosen, used, blocked = scan.run(free + freed)
        out = _shortest_cover(out, used - free)
    return Decision(
        admit=tuple(v.rid for v in chosen if v.state is _WAITING),
        resume=tuple(v.rid for v in chosen if v.state is _ROTARY),
        rotate_out=tuple(v.rid for v in out),
        contention=True,
        blocked=blocked,
    )


def _rank(
    views: Sequence[ReqView], waiting_rotary: list[ReqView], now: float, params: VltParams,
    goodput: GoodputParams | None, chunk: int | None = None,
) -> tuple[_Ranked, list[ReqView]]:
    """Step 2: sort by VLT descending, ties oldest arrival first, then rid (goodput mode: by
    tier first, then `goodput.rank_key`: earliest deadline, best-effort longest output left).

    Returns the head candidates (waiting/rotary: `waiting_rotary`, the non-running views)
    and the tail candidates (rotatable running with VLT < 0) in tail-first order: the paper's
    longest stint first; goodput mode's `goodput.victim_key` order, only if a rotation is
    affordable at all.
    """
    lags = vlts(waiting_rotary, now, params)
    if goodput is None:
        pending = [(VIABLE, -lag, v.arrival, v.rid, v, lag > 0) for v, lag in zip(waiting_rotary, lags)]
    else:
        tiers = [gp_rules.tier(v, now, goodput, chunk) for v in waiting_rotary]
        pending = [(t, gp_rules.rank_key(v, now, t), v.arrival, v.rid, v, lag > 0)
                   for v, lag, t in zip(waiting_rotary, lags, tiers)]
    pending.sort()
    movable = [v for v in views if v.state is _RUNNING and v.rotatable and v.blocks_held > 0]
    stints = vlts(movable, now, params)  # -stint length for running requests
    if goodput is None:
        rows = sorted(((-lag, v.arrival, v.rid, v) for v, lag in zip(movable, stints) if lag < 0),
                      reverse=True)
        return pending, [row[3] for row in rows]
    running = [v for v in views if v.state is _RUNNING]
    if not gp_rules.rotation_affordable(running, goodput.costs):
        return pending, []
    keyed = []
    for v, lag in zip(movable, stints):
        key = gp_rules.victim_key(v, -lag) if lag < 0 else None
        if key is not None:
            keyed.append((key, v.arrival, v.rid, v))
    keyed.sort()
    return pending, [row[3] for row in keyed]


class _HeadScan:
    """Step 3: take each request that fits, in rank order.

    Urgent requests (VLT > 0, not best-effort; or promoted past the starvation bound) may use up
    to `cap` (free memory plus what rotation can free); the others are within their slack or
    best-effort and may not displace anyone, so they only get memory still free, and are skipped
    when they do not fit. An urgent request that does not fit stops the scan (head-of-line),
    unless it could never fit (more than `wall`, all memory requests can hold): skipping it would
    let every smaller request behind it take the memory it waits for, and when rotation cannot
    make room (young victims, the budget) it would starve. Resumes also spend the inbound
    rotation budget; one over it is skipped, not waited for.

    Goodput mode also queues prefills: a viable waiting request that cannot get its first token
    in time behind the prefills already chosen is deferred to the end as best-effort. And the
    best-effort tier is a queue too: its first request that does not fit stops the scan, as an
    urgent one does (but it never displaces anyone), since its longest-output-first order puts
    the largest requests first, and any smaller one behind would take each block freed for them.
    """

    def __init__(self, pending: _Ranked, free: int, budget: int, wall: int, now: float,
                 goodput: GoodputParams | None, chunk: int | None = None) -> None:
        self.pending, self.free, self.budget, self.wall = pending, free, budget, wall
        self.now, self.goodput, self.chunk = now, goodput, chunk

    def run(self, cap: int) -> tuple[list[ReqView], int, str | None]:
        """Returns (chosen, blocks used, blocked rid)."""
        chosen: list[ReqView] = []
        free, budget, wall, goodput = self.free, self.budget, self.wall, self.goodput
        used = inbound = 0
        ahead = 0  # prompt tokens of the prefills chosen so far
        queue = list(self.pending)
        for tier, key, arrival, rid, view, hot in queue:  # a deferred row is appended: it comes last
            urgent = tier == PROMOTED or (tier == VIABLE and hot)
            if goodput is not None and tier == VIABLE and view.last_token is None:
                if not gp_rules.ttft_reachable(view, self.now, ahead, goodput.costs, self.chunk):
                    queue.append((BEST_EFFORT, key, arrival, rid, view, hot))
                    continue
            need = view.blocks_needed
            if need > (cap - used if urgent else max(0, free - used)):
                queued = urgent or (goodput is not None and tier == BEST_EFFORT)
                if queued and need <= wall and not (view.state is _ROTARY and need > budget):
                    return chosen, used, view.rid
                continue
            if view.state is _ROTARY:
                if inbound + need > budget:
                    continue
                inbound += need
            elif goodput is not None:
                ahead += view.prefill_tokens
            chosen.append(view)
            used += need
        return chosen, used, None


def _tail_scan(victims: list[ReqView], b_swap: int, budget: int) -> list[ReqView]:
    """Step 4: rotate out from the tail (`_rank`'s order) until B_swap is covered, within the budget."""
    out: list[ReqView] = []
    moved = 0
    for view in victims:
        if moved >= b_swap:
            break
        if moved + view.blocks_held > budget:
            continue  # would exceed the outbound budget; a smaller one may still fit
        out.append(view)
        moved += view.blocks_held
    return out


def _shortest_cover(out: list[ReqView], b_swap: int) -> list[ReqView]:
    """Step 5: keep only the leading rotate-outs still needed to free `b_swap` blocks."""
    kept: list[ReqView] = []
    moved = 0
    for view in out:
        if moved >= b_swap:
            break
        kept.append(view)
        moved += view.blocks_held
    return kept
