"""A decode memory shortage answered by rotation instead of SGLang's retract-and-recompute.

Before each decode step SGLang checks that the running batch's next tokens fit in the device KV
pool (`ScheduleBatch.check_decode_mem`, in `Scheduler.update_running_batch`). When they do not (or
when its test switch SGLANG_TEST_RETRACT forces it), it calls `ScheduleBatch.retract_decode`: requests
are released (their KV dropped), the scheduler requeues them, and they are prefilled again later:
the recompute tax. With the rotation engine on and `--decode-shortage rotate` (the default), our hook
around `retract_decode` (`answer`) first rotates requests out to the host pool, the KV kept bit-exact
and resumed later through the radix tree like any rotation, until the batch's next step fits; SGLang's
own `retract_decode` then runs only if the batch is still short, on what is left, unchanged.

What `answer` hands back is what SGLang's path expects of `retract_decode`: the batch filtered to the
requests that decode, `(retracted, new_token_ratio, aborted)` with only SGLang's own retractions in
`retracted` (the scheduler requeues those; a rotated request is ours, rotary, and must not be
requeued), and the new-token ratio SGLang's rule gives for the batch left
(`estimate_new_token_ratio_after_retract`, as after a retraction: admission stays as cautious as it
would have been).

Victims, first to last (`rotasched.shortage.victim_key`, which the simulator shares): requests that
can no longer meet their SLOs (TTFT missed or TBT lost: the goodput policy's `lost`, its only
rotate-out victims; lower class weight first), then everyone else; within each, SGLang's own
retraction order (fewest outputs, then longest prompt; or its priority order). A lost request loses
nothing it could still win by a pause; SGLang's order is kept beyond that, so the batch that stays
is the one SGLang would have kept. As in SGLang's loop: at least one
request is taken (its forced test retraction takes one even when memory is not short), then one more
while the next step does not fit, and the last request is never taken. Only rotatable requests
(`may_rotate`: not mid-prefill or in a prefill still in flight under the overlap scheduler, a decode
row of an in-flight mixed batch allowed; no grammar, multimodal input, beams or session) with a
clock are victims; a request the host pool cannot
take (`rotation.rotate_out` returns None, nothing changed) is skipped, and what is left short goes to
SGLang's retraction.

Overlap scheduler: the decode batch in flight holds the rotated requests; their release marks them
retracted (SGLang's `reset_for_retract`), so that batch's result skips them, and only the KV of tokens
before the last output token, written by forwards whose results are processed, is copied. They are
rotary, not queued: the earliest a resume can admit one is the next iteration's prefill, after the
in-flight result was processed (unlike a recompute fallback in our own step, which waits a step:
`RotaSchedRuntime._held_back`). TP: the victim order depends on each rank's clocks, so rank 0's order
is broadcast; every rank reaches this call together (SGLang's shortage check reads state that is the
same on every rank), and the host pools fill alike.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..rotasched import ReqState
from ..rotasched.shortage import victim_key
from . import copy_metrics, rotation
from .metrics import SHORTAGE_ROTATED
from .views import BatchRows, rotatable

logger = logging.getLogger(__name__)

Retraction = tuple[list[Any], float, list[Any]]  # retract_decode's (retracted, new_token_ratio, aborted)
_DECODING_ROWS = BatchRows()  # the in-flight mixed batch's decode rows (`may_rotate`)


def active(rt: Any) -> bool:
    """Whether a shortage is answered by rotation: the engine is on and --decode-shortage rotate."""
    return rt.engine is not None and rt.cfg.decode_shortage == "rotate"


def answer(rt: Any, original: Callable[[Any], Retraction], batch: Any) -> Retraction:
    """`ScheduleBatch.retract_decode(batch)`, with rotation first (module docstring). `original`:
    SGLang's retract_decode bound to nothing (called as `original(batch)`)."""
    if not active(rt):
        return sglang_retraction(rt, original(batch))
    order = rt.broadcast(victim_order(rt, batch) if rt.sync.rank == 0 else None)
    now = time.monotonic()
    index = {req.rid: i for i, req in enumerate(batch.reqs)}
    kept = list(range(len(batch.reqs)))
    rotated: list[Any] = []
    for rid in order:
        if rotated and batch.check_decode_mem(selected_indices=kept):
            break
        if len(kept) <= 1:
            break  # SGLang's rule: always keep one request
        i = index.get(rid)
        if i is None or not may_rotate(rt.sched, batch.reqs[i]):
            continue  # (the same on every rank: the order is rank 0's, the batch everyone's)
        if rotate_one(rt, batch.reqs[i], now):
            kept.remove(i)
            rotated.append(batch.reqs[i])
    if not rotated:
        return sglang_retraction(rt, original(batch))
    copy_metrics.publish(rt.engine.copy_timer)
    batch.filter_batch(keep_indices=kept)
    count(rt, SHORTAGE_ROTATED, len(rotated))
    if batch.check_decode_mem():
        count(rt, "rotation")
        logger.debug("superinfer: decode memory short: %d request(s) rotated out to host, none retracted",
                     len(rotated))
        return [], new_token_ratio(batch.reqs), []
    result = sglang_retraction(rt, original(batch), rotated=True)
    logger.info("superinfer: decode memory short: %d request(s) rotated out, %d retracted by SGLang (host "
                "pool full or not rotatable)", len(rotated), len(result[0]))
    return result


def count(rt: Any, key: str, n: int = 1) -> None:
    """RotationStats.shortages: how shortages were answered (metrics.SHORTAGE_ANSWERS) and the
    requests rotated out for them (metrics.SHORTAGE_ROTATED)."""
    shortages = rt.stats.shortages
    shortages[key] = shortages.get(key, 0) + n


def victim_order(rt: Any, batch: Any) -> list[str]:
    """Rids of the batch's rotatable requests, the first victim first (module docstring)."""
    reqs = batch.reqs
    keep_first = batch._get_decode_retraction_order(reqs)  # SGLang's: most preferred to keep first
    sglang_turn = {idx: turn for turn, idx in enumerate(reversed(keep_first))}
    clocks, rows = rt.clocks.by_rid, []
    for i, req in enumerate(reqs):
        clk = clocks.get(req.rid)
        if clk is None or not may_rotate(rt.sched, req):
            continue
        left = req.sampling_params.max_new_tokens - len(req.output_ids)
        rows.append((victim_key(clk, left, sglang_turn[i]), req.rid))
    rows.sort()
    return [row[1] for row in rows]


def may_rotate(sched: Any, req: Any) -> bool:
    """`views.rotatable`, and also a request that is only a decode row of the mixed batch in flight
    (SGLang's mixed chunk, on by default with rotation: a decode step beside prefills, our resumes'
    one-token extends among them). `rotatable` refuses every request of an in-flight extend or mixed
    batch, since a prefill row is still writing its KV; a decode row's forward writes only its last
    output token's KV, which a rotation never copies (as in a plain decode batch in flight). Without
    this, a shortage right after a mixed step (the common case: the step's admissions took the
    memory) finds nothing rotatable and goes to SGLang's retraction."""
    if rotatable(sched, req):
        return True
    last = sched.last_batch
    if last is None or not last.forward_mode.is_mixed() or not last.decoding_reqs \
            or not _DECODING_ROWS.holds(last.decoding_reqs, req):
        return False
    sched.last_batch = None  # the same checks, with that batch set aside
    try:
        return rotatable(sched, req)
    finally:
        sched.last_batch = last


def rotate_one(rt: Any, req: Any, now: float) -> bool:
    """Rotate one running request out to host (already chosen; still in the batch's list): False,
    with nothing changed, when the host pool cannot take it."""
    store = rt.store
    store.digest([req])  # SUPERINFER_VERIFY_ROTATION: its KV as admission will read it back
    t0 = time.monotonic()
    entry = rotation.rotate_out(rt.sched, req, rt.engine, now)
    if entry is None:
        store.digests.pop(req.rid, None)
        return False
    rt.clocks.meter.observe_rotation(time.monotonic() - t0)
    store.park(entry, rt.iteration)
    clk = rt.clocks.by_rid[req.rid]
    clk.rotations += 1
    clk.set_state(ReqState.ROTARY, now)
    return True


def sglang_retraction(rt: Any, result: Retraction, rotated: bool = False) -> Retraction:
    """SGLang retracted these requests to recompute them: counted, and their host mirrors dropped
    (recomputed KV may differ in its last bits from a mirror). `rotated`: after rotations of ours.
    (SGLang's forced test retraction of a one-request batch takes nobody: no shortage counted.)
    Requests it aborted instead (a beam group, a lone request that cannot fit) leave through its
    abort output, never the output stream that calls `on_finished`: their mirror and clock go here."""
    retracted, aborted = result[0], result[2]
    if retracted or aborted or rotated:
        count(rt, "rotation_and_retraction" if rotated else "retraction")
    rt.stats.sglang_retractions += len(retracted)
    rt.forget_kv(retracted)
    if aborted:
        gone = {req.rid for req in aborted}
        rt.clocks.drop(gone.__contains__)
        for rid in gone:
            rt.store.forget(rid)
    return result


def new_token_ratio(reqs: list[Any]) -> float:
    """SGLang's new-token ratio after a retraction, for the batch left (retract_decode's own rule)."""
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker

    return NewTokenRatioTracker.estimate_new_token_ratio_after_retract(reqs)
