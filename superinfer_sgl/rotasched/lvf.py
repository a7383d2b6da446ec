"""Largest-VLT-First (LVF): RotaSched's per-iteration decision (paper Algorithm 1).

Block units: `free_blocks`, `budget_blocks`, `blocks_needed` and `blocks_held` must all be
counted in the same unit (rotation blocks of --rotary-block-tokens tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from superinfer_sgl.rotasched.state import ReqState, ReqView
from superinfer_sgl.rotasched.vlt import VltParams, vlts

# Scan order as sortable rows: (-VLT, arrival, rid, view); rids are unique, so views are
# never compared.
_Ranked = list[tuple[float, float, str, ReqView]]

# Enum member lookups through the class cost ~0.1 us each; these run per view per iteration.
_WAITING, _RUNNING, _ROTARY = ReqState.WAITING, ReqState.RUNNING, ReqState.ROTARY


@dataclass(frozen=True, slots=True)
class Decision:
    """Who moves this iteration. The executor rotates out first, then resumes and admits."""

    admit: tuple[str, ...] = ()  # WAITING rids, in admission order
    resume: tuple[str, ...] = ()  # ROTARY rids, in resume order
    rotate_out: tuple[str, ...] = ()  # RUNNING rids to move to host
    contention: bool = False  # False: memory covered all demand and FCFS was used
    # The urgent (VLT > 0) request the scan stopped at: it did not fit, and nobody ranked below it
    # may take the memory it waits for. The executor offers nobody else outside LVF's choices.
    blocked: str | None = None

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
) -> Decision:
    """Decide admissions, resumes and rotate-outs for one scheduler iteration.

    Guarantees: admitted+resumed blocks <= free_blocks + rotated-out blocks; resumed
    blocks <= budget_blocks and rotated-out blocks <= budget_blocks (each direction);
    nobody with VLT < 0 moves in; nobody is rotated out unless a VLT > 0 request moves in.
    """
    assert free_blocks >= 0 and budget_blocks >= 0, (free_blocks, budget_blocks)
    assert len({v.rid for v in views}) == len(views), "duplicate rid in views"
    pending = [v for v in views if v.state is not _RUNNING]
    if sum([v.blocks_needed for v in pending]) <= free_blocks:  # a list sums faster than a genexpr
        return _fcfs(pending, budget_blocks)
    return _contended(views, pending, free_blocks, budget_blocks, now, params)


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
) -> Decision:
    """Steps 2-5: head scan by VLT, rotate out from the tail, shrink if the tail falls short."""
    pending, victims = _rank(views, waiting_rotary, now, params)
    # Memory an urgent request could ever get: what is free plus what running requests hold.
    wall = free + sum([v.blocks_held for v in views if v.state is _RUNNING])
    chosen, used, blocked = _head_scan(pending, free + budget, free, budget, wall)
    out = _tail_scan(victims, used - free, budget)
    freed = sum(v.blocks_held for v in out)
    if used > free + freed:
        # The tail could not free enough: rescan against what it did free. The rescan
        # keeps every prefix of the first choice that fits, and may fit smaller ones too.
        chosen, used, blocked = _head_scan(pending, free + freed, free, budget, wall)
        out = _shortest_cover(out, used - free)
    return Decision(
        admit=tuple(v.rid for v in chosen if v.state is _WAITING),
        resume=tuple(v.rid for v in chosen if v.state is _ROTARY),
        rotate_out=tuple(v.rid for v in out),
        contention=True,
        blocked=blocked,
    )


def _rank(
    views: Sequence[ReqView], waiting_rotary: list[ReqView], now: float, params: VltParams
) -> tuple[_Ranked, _Ranked]:
    """Step 2: sort by VLT descending, ties oldest arrival first, then rid.

    Returns the head candidates (waiting/rotary: `waiting_rotary`, the non-running views)
    and the tail candidates (rotatable running with VLT < 0), the latter in tail-first
    order (longest stint first).
    """
    pending = [
        (-lag, v.arrival, v.rid, v)
        for v, lag in zip(waiting_rotary, vlts(waiting_rotary, now, params))
    ]
    movable = [v for v in views if v.state is _RUNNING and v.rotatable and v.blocks_held > 0]
    victims = [
        (-lag, v.arrival, v.rid, v) for v, lag in zip(movable, vlts(movable, now, params)) if lag < 0
    ]
    pending.sort()
    victims.sort(reverse=True)
    return pending, victims


def _head_scan(pending: _Ranked, cap: int, free: int, budget: int,
               wall: int) -> tuple[list[ReqView], int, str | None]:
    """Step 3: take each request that fits; returns (chosen, blocks used, blocked rid).

    VLT > 0 may use up to `cap` (free memory plus what rotation can free); VLT == 0 is
    within its slack and may not displace anyone, so it only gets memory still free, and is
    skipped when it does not fit. An urgent request (VLT > 0) that does not fit stops the scan
    (head-of-line), unless it could never fit (more than `wall`, all memory requests can hold):
    skipping it would let every smaller request behind it take the memory it waits for, and
    when rotation cannot make room (young victims, the budget) it would starve. Resumes also
    spend the inbound rotation budget; one over it is skipped, not waited for.
    """
    chosen: list[ReqView] = []
    add = chosen.append
    used = inbound = 0
    left = cap  # cap - used, kept up to date: the common (VLT > 0) case reads it directly
    for neg_lag, _, _, view in pending:
        need = view.blocks_needed
        if need > (left if neg_lag < 0 else max(0, free - used)):
            if neg_lag < 0 and need <= wall and not (view.state is _ROTARY and need > budget):
                return chosen, used, view.rid
            continue
        if view.state is _ROTARY:
            if inbound + need > budget:
                continue
            inbound += need
        add(view)
        used += need
        left -= need
    return chosen, used, None


def _tail_scan(victims: _Ranked, b_swap: int, budget: int) -> list[ReqView]:
    """Step 4: rotate out longest stints first until B_swap is covered, within the budget."""
    out: list[ReqView] = []
    moved = 0
    for _, _, _, view in victims:
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
