"""Room in the device KV pool for the next chunk of a prompt split over steps (SGLang's chunked
prefill), where our running reserve is below SGLang's.

SGLang's PrefillAdder admits a prompt only if it fits beside every running request's decode reserve,
and then lets the prompt's later chunks (the scheduler's `chunked_req`) take their whole chunk
whenever its budget says nothing is left (`available_chunk_tokens`: the prefill must make progress
to release its KV). That holds because each running request reserves all its remaining outputs.
Ours reserves a share of them (--running-reserve, goodput 0.4): the running requests may grow into
the room the next chunk needs, and its allocation then fails ("Out of memory", the scheduler dies;
seen with --running-reserve 0.15 at 1.5x capacity on the CPU, 2026-11-29). A decode step that runs
short is answered by rotation (decode_shortage.py); this is the same for the chunk, before SGLang's
prefill: running requests rotate out to the host pool, in the decode shortage's victim order, until
the chunk fits (`victims`), and the step's chunk is cut to what is then free (`step_chunk`), so a
rotation that the host pool refused cannot leave it over-committed either.
"""

from __future__ import annotations

import logging
from typing import Any

from .decode_shortage import victim_order

logger = logging.getLogger(__name__)


def allocatable(sched: Any) -> int:
    """Device KV tokens an allocation can take now: free, or held only by evictable prefixes (as
    SGLang's prefill budget counts them)."""
    cache = sched.tree_cache
    evictable = cache.full_evictable_size() if cache.supports_mamba() else cache.evictable_size()
    return sched.token_to_kv_pool_allocator.available_size() + evictable


def next_chunk(sched: Any, chunk_size: int | None) -> int:
    """Tokens the chunked request's next chunk computes (0: no chunked request)."""
    req = sched.chunked_req
    if req is None:
        return 0
    left = max(0, _held(req) - int(req.prefix_len))  # prefix_len: computed so far (checkpointed)
    return left if chunk_size is None or chunk_size <= 0 else min(left, chunk_size)


def shortfall(sched: Any, chunk_size: int | None, rows: int) -> int:
    """Tokens the next chunk lacks beside `rows` decode rows of a mixed step (one token each), with
    a page of rounding for each: 0 when it fits."""
    chunk = next_chunk(sched, chunk_size)
    if chunk <= 0:
        return 0
    page = sched.token_to_kv_pool_allocator.page_size
    return max(0, chunk + (rows + 1) * page - allocatable(sched))


def victims(rt: Any, running_batch: Any, chosen: list[Any], resuming: list[Any], chunk_size: int | None,
            mixed: bool) -> list[Any]:
    """Running requests to rotate out (beyond `chosen`, this step's other rotations) so that the
    next chunk fits beside this step's resumes (`resuming`, whose KV comes back into the pool; a
    prefetched one's slots are taken already, `rt.store.prefetched`):
    the decode shortage's order (lost requests first; those it may rotate, decode rows of the mixed
    step in flight among them: the previous chunk's step was one, with every running request in
    it), each counted for the device tokens it holds and the decode row it no longer needs. The same
    list on every TP rank (rank 0's order, and memory is the same everywhere)."""
    sched = rt.sched
    if sched.chunked_req is None:
        return []
    gone = {id(r) for r in chosen}
    rows = sum(1 for r in running_batch.reqs if id(r) not in gone) if mixed else 0
    prefetched = rt.store.prefetched
    short = (shortfall(sched, chunk_size, rows) + sum(_held(r) for r in resuming if r.rid not in prefetched)
             - sum(_held(r) for r in chosen))
    if short <= 0:
        return []
    order = rt.broadcast(victim_order(rt, running_batch) if rt.sync.rank == 0 else None)
    by_rid = {r.rid: r for r in running_batch.reqs}
    page = sched.token_to_kv_pool_allocator.page_size
    out = []
    for rid in order:
        req = by_rid.get(rid)
        if req is None or id(req) in gone:
            continue
        out.append(req)
        short -= _held(req) + (page if mixed else 0)
        if short <= 0:
            break
    logger.info("chunked prefill of %s: %d running request(s) rotated out for its next chunk%s",
                sched.chunked_req.rid, len(out), "" if short <= 0 else f" ({short} tokens still short: the chunk is cut)")
    return out


def step_chunk(sched: Any, chunk_size: int | None, rows: int) -> int | None:
    """This step's chunked-prefill size (SGLang's `chunked_prefill_size`, which the adder lowers by
    the mixed step's `rows`) cut so that the chunked request's next chunk fits what is free; as
    given when nothing is chunked, it fits, or not even one token is free (SGLang's own path then)."""
    if sched.chunked_req is None or chunk_size is None or chunk_size <= 0:
        return chunk_size
    page = sched.token_to_kv_pool_allocator.page_size
    room = allocatable(sched) - (rows + 1) * page
    if room < 1:
        return chunk_size
    return min(chunk_size, room + rows)


def _held(req: Any) -> int:
    """Device KV tokens a running request holds (its prompt and outputs so far)."""
    return len(req.origin_input_ids) + len(req.output_ids)
