"""Largest-VLT-First (LVF): RotaSched's per-iteration decision (paper Algorithm 1).

The steps are the paper's; what they leave open (the head order, who may be rotated out, a prefill
that must wait) the policy answers (rotasched/policy.py: `PAPER`, the paper's own answers, unless
told otherwise).

Block units: `free_blocks`, `budget_blocks`, `blocks_needed` and `blocks_held` must all be
counted in the same unit (rotation blocks of --rotary-block-tokens tokens).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from superinfer_sgl.rotasched.pending import StepQueue
from superinfer_sgl.rotasched.policy import BEST_EFFORT, PAPER, PROMOTED, VIABLE, LvfPolicy, Row
from superinfer_sgl.rotasched.request_view import ReqState, ReqView
from superinfer_sgl.rotasched.vlt import VltParams, vlts

# Scan order as sortable rows (policy.Row): (tier, key, arrival, rid, view, hot), (tier, key) the
# policy's rank; rids are unique, so views are never compared. Hot: VLT > 0 (urgent unless its tier
# says otherwise).
_Ranked = list[Row]

# Enum member lookups through the class cost ~0.1 us each; these run per view per iteration.
_WAITING, _RUNNING, _ROTARY = ReqState.WAITING, ReqState.RUNNING, ReqState.ROTARY


@dataclass(frozen=True, slots=True)
class Decision:
    """Who moves this iteration. The executor rotates out first, then resumes and admits."""

    admit: tuple[str, ...] = ()  # WAITING rids, in admission order
    resume: tuple[str, ...] = ()  # ROTARY rids, in resume order
    rotate_out: tuple[str, ...] = ()  # RUNNING rids to move to host
    contention: bool = False  # False: memory covered all demand and FCFS was used
    # The request the scan stopped at (urgent: VLT > 0; or the head of a queued best-effort tier):
    # it did not fit, and nobody ranked below it may take the memory it waits for. The executor
    # offers nobody else outside LVF's choices.
    blocked: str | None = None
    # The most prefill tokens this iteration may carry (the policy's `step_cap`: the executor's
    # chunk size for this step, if smaller than the configured one); None: the configured size.
    prefill_cap: int | None = None
    # Whether this iteration's prefill rides with the decode batch (SGLang's mixed chunk, where the
    # server enables it); the policy's `mixes` decides (planner.mixes for the executor's answer).
    mix: bool = True

    def __post_init__(self) -> None:
        moved = self.admit + self.resume + self.rotate_out
        assert len(set(moved)) == len(moved), f"a rid in two lists: {moved}"

    @property
    def is_noop(self) -> bool:
        return not (self.admit or self.resume or self.rotate_out)


def lvf_decide(
    views: Sequence[ReqView] | StepQueue,
    free_blocks: int,
    budget_blocks: int,
    now: float,
    params: VltParams,
    policy: LvfPolicy = PAPER,
    host_room_blocks: int | None = None,
) -> Decision:
    """Decide admissions, resumes and rotate-outs for one scheduler iteration.

    Guarantees: admitted+resumed blocks <= free_blocks + rotated-out blocks; resumed
    blocks <= budget_blocks (or one request over the whole budget, resumed alone: `_fcfs`,
    `_HeadScan`) and rotated-out blocks <= min(budget_blocks, host_room_blocks);
    nobody with VLT < 0 moves in; nobody is rotated out unless an urgent request (VLT > 0 and
    not best-effort, or promoted) moves in.

    `views`: a flat list, or a `StepQueue` (the server's, whose pending index is kept between
    steps: the step then reads only what the scans reach). `host_room_blocks`: what the host pool
    can still take (None: unbounded). A rotation the host pool cannot take becomes a recompute (the
    victim's KV dropped, its whole context prefilled again), so none is chosen: under a sustained
    overload the pool fills, and rotating anyway turned each step's rotations into recomputes.
    """
    assert free_blocks >= 0 and budget_blocks >= 0, (free_blocks, budget_blocks)
    queue = views if isinstance(views, StepQueue) else StepQueue.of(views)
    if queue.pending.blocks_needed <= free_blocks:
        return _fcfs(list(queue.pending), budget_blocks)
    out_budget = budget_blocks if host_room_blocks is None else max(0, min(budget_blocks, host_room_blocks))
    return _contended(queue, free_blocks, budget_blocks, out_budget, now, params, policy)


def rank_order(views: Sequence[ReqView], now: float, params: VltParams,
               policy: LvfPolicy = PAPER) -> list[ReqView]:
    """Waiting or rotary views in the head scan's order (step 2): what the executor's idle resume
    and prefetch follow, so that they pick whom LVF would pick."""
    return [row[4] for row in _ranked(views, now, params, policy)]


def idle_resume(decision: Decision, views: Sequence[ReqView] | StepQueue, now: float, params: VltParams,
                policy: LvfPolicy = PAPER) -> Decision:
    """The executor's fallback when nothing runs and LVF moves nobody: resume the rotary request
    LVF ranks first anyway. LVF counts in whole blocks (needs rounded up, free memory rounded
    down) and caps resumes at the rotation budget, so a rotary request within a block of the free
    memory, or just over the budget, would otherwise never come back once the server is idle.
    The executor allocates its slots token-exactly and leaves it rotary if they cannot be had.
    """
    queue = views if isinstance(views, StepQueue) else StepQueue.of(views)
    if not decision.is_noop or queue.running:
        return decision
    rotary = [v for v in queue.pending if v.state is _ROTARY]
    if not rotary:
        return decision
    top = rank_order(rotary, now, params, policy)[0]
    return Decision(resume=(top.rid,), contention=decision.contention)


def _fcfs(pending: list[ReqView], budget: int) -> Decision:
    """Step 1: memory covers everyone, so arrival order is fair; only resumes pay budget. A
    request needing more than the whole budget resumes alone (the step's first resume): skipped,
    it would wait for contention or an idle server while memory sat free."""
    pending = sorted(pending, key=lambda v: (v.arrival, v.rid))
    admit = [v.rid for v in pending if v.state is _WAITING]
    resume: list[str] = []
    inbound = 0
    for v in pending:
        if v.state is _ROTARY and (inbound + v.blocks_needed <= budget or not resume):
            resume.append(v.rid)
            inbound += v.blocks_needed
    return Decision(tuple(admit), tuple(resume), (), contention=False)


def _contended(
    queue: StepQueue,
    free: int,
    budget: int,
    out_budget: int,
    now: float,
    params: VltParams,
    policy: LvfPolicy,
) -> Decision:
    """Steps 2-5: head scan by rank, rotate out from the tail, shrink if the tail falls short.
    Victims are ranked only when the head scan wants more than is free. `budget`: blocks moved
    in; `out_budget`: blocks moved out (the budget, less where the host pool has less room)."""
    rows = policy.head_rows(queue.pending, now, params)
    if rows is None:
        heap = _rows(list(queue.pending), now, params, policy)
        heapq.heapify(heap)
        rows = _pop_all(heap)
    # Memory an urgent request could ever get: what is free plus what running requests hold.
    scan = _HeadScan(_LazyOrder(rows), free, budget, free + queue.held_floor,
                     lambda: free + sum([v.blocks_held for v in queue.fresh_running()]), now, policy)
    chosen, used, blocked = scan.run(free + out_budget)
    out = _tail_scan(_victims(queue, now, params, policy), used - free, out_budget) if used > free else []
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


def _ranked(waiting_rotary: Sequence[ReqView], now: float, params: VltParams,
            policy: LvfPolicy) -> _Ranked:
    """Step 2: sort by the policy's rank (the paper's: VLT descending), ties oldest arrival first,
    then rid."""
    rows = _rows(waiting_rotary, now, params, policy)
    rows.sort()
    return rows


def _rows(waiting_rotary: Sequence[ReqView], now: float, params: VltParams, policy: LvfPolicy) -> _Ranked:
    lags = vlts(waiting_rotary, now, params)
    tiers, keys = policy.rank(waiting_rotary, lags, now)
    return [(tier, key, v.arrival, v.rid, v, lag > 0) for tier, key, v, lag in zip(tiers, keys, waiting_rotary, lags)]


def _pop_all(heap: _Ranked) -> Iterator[Row]:
    while heap:
        yield heapq.heappop(heap)


class _LazyOrder:
    """`_ranked`'s order, produced only as far as the head scans read it, kept in a list the
    second scan reads again: the policy's lazy order (`head_rows`), or a heap of every pending
    row popped one by one. The scan mostly stops early (at the first urgent request that does not
    fit), so a full sort per iteration would order thousands of rows nobody reads. Rows are unique
    by rid, so the heap's order is the sort's."""

    def __init__(self, rows: Iterator[Row]) -> None:
        self.rows, self.done = rows, []

    def __iter__(self) -> Iterator[Row]:
        done, rows = self.done, self.rows
        i = 0
        while True:
            if i == len(done):
                row = next(rows, None)
                if row is None:
                    return
                done.append(row)
            yield done[i]
            i += 1


def _victims(queue: StepQueue, now: float, params: VltParams, policy: LvfPolicy) -> list[ReqView]:
    """Step 4's candidates, tail first: rotatable running requests with VLT < 0 that the policy
    lets go (the paper's: the longest stint first). Only the policy's candidates are read fresh
    (`StepQueue.movable`)."""
    running = queue.running
    movable = queue.movable(policy.victim_candidates(running))
    if not movable:  # (every policy picks victims among these only)
        return []
    stints = vlts(movable, now, params)  # -stint length for running requests
    return policy.victims(running, movable, stints)


class _HeadScan:
    """Step 3: take each request that fits, in rank order.

    Urgent requests (VLT > 0 in the VIABLE tier, or PROMOTED) may use up to `cap` (free memory
    plus what rotation can free); the others are within their slack or best-effort and may not
    displace anyone, so they only get memory still free, and are skipped when they do not fit.
    An urgent request that does not fit stops the scan (head-of-line), unless it could never fit
    (more than `wall`, all memory requests can hold): skipping it would let every smaller request
    behind it take the memory it waits for, and when rotation cannot make room (young victims,
    the budget) it would starve. Resumes also spend the inbound rotation budget; one over it is
    skipped, not waited for, unless PROMOTED (it has waited its bound) and over the whole budget:
    it resumes alone, as the step's first resume (skipped, it could come back only once nothing
    ran; its need counts its decode reserve, which is never copied).

    The policy may also queue prefills: a VIABLE waiting request it `defers` (e.g. it cannot get
    its first token in time behind the prefills already chosen) moves to the end as best-effort.
    And with `queues_best_effort` the best-effort tier is a queue too: its first request that
    does not fit stops the scan, as an urgent one does (but it never displaces anyone).
    """

    def __init__(self, pending: _LazyOrder, free: int, budget: int, wall_floor: int, wall: Callable[[], int],
                 now: float, policy: LvfPolicy) -> None:
        self.pending, self.free, self.budget, self._wall = pending, free, budget, wall
        self.now, self.policy = now, policy
        self._wall_floor, self._wall_blocks = wall_floor, None

    def within_wall(self, need: int) -> bool:
        """need <= the wall; the wall is summed only where its floor does not settle it (only an
        urgent request that does not fit asks)."""
        if need <= self._wall_floor:
            return True
        if self._wall_blocks is None:
            self._wall_blocks = self._wall()
        return need <= self._wall_blocks

    def run(self, cap: int) -> tuple[list[ReqView], int, str | None]:
        """Returns (chosen, blocks used, blocked rid)."""
        chosen: list[ReqView] = []
        free, budget, now = self.free, self.budget, self.now
        defers, queues_best_effort = self.policy.defers, self.policy.queues_best_effort
        used = inbound = 0
        ahead = 0  # prompt tokens of the prefills chosen so far
        deferred: _Ranked = []
        # (chain reads `deferred` once the ranked rows are done: deferred rows come last)
        for tier, key, arrival, rid, view, hot in itertools.chain(self.pending, deferred):
            urgent = tier == PROMOTED or (tier == VIABLE and hot)
            if tier == VIABLE and view.state is _WAITING and defers(view, now, ahead):
                deferred.append((BEST_EFFORT, key, arrival, rid, view, hot))
                continue
            need = view.blocks_needed
            rotary = view.state is _ROTARY
            alone = rotary and not inbound and tier == PROMOTED  # over the budget, it may come in alone
            if need > (cap - used if urgent else max(0, free - used)):
                queued = urgent or (queues_best_effort and tier == BEST_EFFORT)
                if queued and self.within_wall(need) and (not rotary or need <= budget or alone):
                    return chosen, used, view.rid
                continue
            if rotary:
                if inbound + need > budget and not alone:
                    continue
                inbound += need
            else:
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
