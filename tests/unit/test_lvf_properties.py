"""LVF invariants over random views, and a pure-Python serving loop under overload."""

from __future__ import annotations

import random
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from superinfer_sgl.rotasched import Decision, ReqState, ReqView, VltParams, lvf_decide, vlt

NOW = 100.0
# Times as integer milliseconds before NOW: integers draw and shrink much faster than floats.
_ago = st.integers(0, 20_000)
_raw_view = st.tuples(
    st.sampled_from(ReqState), _ago, st.one_of(st.none(), _ago), _ago, st.integers(0, 40),
    st.sampled_from([0.5, 2.0, 5.0]), st.sampled_from([0.05, 0.1]), st.booleans(),
)


_Raw = tuple[ReqState, int, int | None, int, int, float, float, bool]


def _make_view(i: int, raw: _Raw) -> ReqView:
    state, arrived_ago, token_ago, stint, blocks, ttft, tbt, rotatable = raw
    arrival = NOW - arrived_ago / 1000
    last = None if token_ago is None else NOW - min(token_ago, arrived_ago) / 1000
    if state is ReqState.ROTARY and last is None:
        last = arrival
    running = state is ReqState.RUNNING
    return ReqView(
        rid=f"r{i}", state=state, arrival=arrival, last_token=last,
        run_start=NOW - min(stint, arrived_ago) / 1000 if running else None,
        ttft_slo=ttft, tbt_slo=tbt,
        blocks_needed=0 if running else blocks, blocks_held=blocks if running else 0,
        rotatable=rotatable or not running,
    )


_views = st.lists(_raw_view, max_size=30).map(
    lambda raws: [_make_view(i, raw) for i, raw in enumerate(raws)]
)

_params = st.builds(
    VltParams,
    alpha=st.sampled_from([0.5, 1.0, 3.0]),
    beta_ttft=st.sampled_from([0.0, 0.5]),
    beta_tbt=st.sampled_from([0.0, 1.0]),
)


def check_invariants(views: list[ReqView], d: Decision, free: int, budget: int,
                     params: VltParams, now: float = NOW) -> None:
    by_rid = {v.rid: v for v in views}
    moved = d.admit + d.resume + d.rotate_out
    assert len(set(moved)) == len(moved), "a rid in two lists"
    assert all(by_rid[r].state is ReqState.WAITING for r in d.admit)
    assert all(by_rid[r].state is ReqState.ROTARY for r in d.resume)
    assert all(by_rid[r].state is ReqState.RUNNING and by_rid[r].rotatable for r in d.rotate_out)
    inbound = sum(by_rid[r].blocks_needed for r in d.resume)
    outbound = sum(by_rid[r].blocks_held for r in d.rotate_out)
    admitted = sum(by_rid[r].blocks_needed for r in d.admit) + inbound
    assert (inbound <= budget or len(d.resume) == 1) and outbound <= budget  # one over the budget goes alone
    assert admitted <= free + outbound
    lags = [vlt(by_rid[r], now, params) for r in d.admit + d.resume]
    assert all(lag >= 0 for lag in lags)
    assert not d.rotate_out or any(lag > 0 for lag in lags)


@settings(max_examples=200, deadline=None, database=None)
@given(_views, st.integers(0, 120), st.integers(0, 60), _params)
def test_invariants_hold(views: list[ReqView], free: int, budget: int, params: VltParams) -> None:
    d = lvf_decide(views, free, budget, NOW, params)
    check_invariants(views, d, free, budget, params)


@settings(max_examples=200, deadline=None, database=None)
@given(_views, st.integers(0, 120), st.integers(0, 60), st.randoms(use_true_random=False))
def test_deterministic_under_shuffle(views: list[ReqView], free: int, budget: int,
                                     rnd: random.Random) -> None:
    shuffled = views[:]
    rnd.shuffle(shuffled)
    assert lvf_decide(views, free, budget, NOW, VltParams()) == lvf_decide(
        shuffled, free, budget, NOW, VltParams())


@settings(max_examples=200, deadline=None, database=None)
@given(_views, st.integers(0, 60))
def test_no_contention_admits_every_waiting(views: list[ReqView], budget: int) -> None:
    free = sum(v.blocks_needed for v in views if v.state is not ReqState.RUNNING)
    d = lvf_decide(views, free, budget, NOW, VltParams())
    waiting = {v.rid for v in views if v.state is ReqState.WAITING}
    assert not d.contention and not d.rotate_out and set(d.admit) == waiting


# --- A serving loop: one LVF decision per step, fixed device capacity, sustained overload.

CAPACITY = 48  # device blocks
BUDGET = 12  # rotation blocks per step, each direction
DT = 0.05  # seconds per step
STEPS = 400
ARRIVE_UNTIL = 300  # one arrival per step until here, then the queue drains


@dataclass
class SimReq:
    rid: str
    arrival: float
    blocks: int
    remaining: int  # decode steps left
    state: ReqState = ReqState.WAITING
    last_token: float | None = None
    run_start: float | None = None
    admitted_at: int | None = None
    done_at: int | None = None

    def view(self) -> ReqView:
        running = self.state is ReqState.RUNNING
        return ReqView(
            self.rid, self.state, self.arrival, self.last_token, self.run_start,
            ttft_slo=1.0, tbt_slo=0.1,
            blocks_needed=0 if running else self.blocks,
            blocks_held=self.blocks if running else 0,
        )


def _apply(d: Decision, live: dict[str, SimReq], step: int, now: float) -> int:
    """Execute a decision like the engine does: out first, then in. Returns block delta."""
    delta = 0
    for rid in d.rotate_out:
        req = live[rid]
        req.state, req.run_start = ReqState.ROTARY, None
        delta += req.blocks
    for rid in d.admit + d.resume:
        req = live[rid]
        req.state, req.run_start = ReqState.RUNNING, now
        req.admitted_at = step if req.admitted_at is None else req.admitted_at
        delta -= req.blocks
    return delta


def _decode(live: dict[str, SimReq], step: int, now: float) -> int:
    """Every running request emits a token; finished ones release their blocks."""
    freed = 0
    for req in [r for r in live.values() if r.state is ReqState.RUNNING]:
        req.last_token = now
        req.remaining -= 1
        if req.remaining == 0:
            req.done_at = step
            freed += req.blocks
            del live[req.rid]
    return freed


def _check_step(live: dict[str, SimReq], free: int) -> None:
    held = sum(r.blocks for r in live.values() if r.state is ReqState.RUNNING)
    assert free >= 0 and free + held == CAPACITY, (free, held)
    assert all(r.state in (ReqState.WAITING, ReqState.RUNNING, ReqState.ROTARY)
               for r in live.values())


def test_serving_loop_under_overload() -> None:
    rng = random.Random(7)
    params = VltParams()
    everyone: list[SimReq] = []
    live: dict[str, SimReq] = {}
    free, rotations = CAPACITY, 0
    for step in range(STEPS):
        now = step * DT
        if step < ARRIVE_UNTIL:
            # ~4.5 blocks x ~12 steps per step in flight: above the 48-block capacity.
            req = SimReq(f"q{step}", now, rng.randint(2, 7), rng.randint(6, 18))
            everyone.append(req)
            live[req.rid] = req
        d = lvf_decide([r.view() for r in live.values()], free, BUDGET, now, params)
        check_invariants([r.view() for r in live.values()], d, free, BUDGET, params, now)
        rotations += len(d.rotate_out)
        free += _apply(d, live, step, now)
        _check_step(live, free)
        free += _decode(live, step, now)
        _check_step(live, free)
    assert rotations > 0, "the scenario never contended; it tests nothing"
    # No starvation: everyone that arrived well before the end got in, and once arrivals
    # stop the backlog drains completely.
    starved = [r.rid for r in everyone if r.arrival < (STEPS - 100) * DT and r.admitted_at is None]
    assert not starved
    assert not live and all(r.done_at is not None for r in everyone)
