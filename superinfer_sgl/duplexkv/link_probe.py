"""How fast this machine moves KV through a rotation engine: the auto rotation budget's input, and,
on CUDA, which transfer path `--kv-transfer auto` keeps.

`launch_server`'s runtime calls `measure_link` once at startup (`--rotation-budget-blocks auto`),
before any request holds KV; `planner.rotation_budget` turns the speed into blocks per step.
`RotationEngine(transfer="auto")` on CUDA calls `pick_by_probe` (`probe_transfers`, then
`choose_transfer`) when it is built. The engine is duck-typed here (this module must not import engine.py, which imports it).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from typing import Any

import torch

logger = logging.getLogger(__name__)

LINK_PROBE_BLOCKS = 64  # the round trip's size: enough bytes that launch overheads do not dominate
LINK_PROBE_REPEATS = 3  # timed round trips after the warm-up; the median is kept
# The CUDA paths `auto` times. triton-dma-serial stays a candidate while the pipelined triton-dma is
# unmeasured on a GPU: if the ring loses anywhere, the probe says so and keeps the serial form.
PROBE_CANDIDATES = ("triton-dma", "triton-dma-serial", "triton-hybrid", "triton-direct")
COPY_ENGINE_PATHS = ("triton-dma", "triton-dma-serial")  # SMs held only for the on-device gather/scatter
# triton-direct (both ways) and triton-hybrid (out) keep their SMs for a whole transfer, away from the
# forward pass, which the probe does not see: they are kept only when this much faster.
SM_HOLD_MARGIN = 1.10


def _probe_blocks(engine: Any, blocks: int, share: int) -> int:
    bt = engine.host_pool.block_tokens
    return max(1, min(blocks, engine.host_pool.allocator.num_free // share, (engine.device_pool.rows - 1) // bt // share))


def _reset_counters(engine: Any) -> None:
    engine.bytes_out = engine.bytes_in = engine.rotations_out = engine.rotations_in = 0


def measure_link(engine: Any, blocks: int = LINK_PROBE_BLOCKS, repeats: int = LINK_PROBE_REPEATS) -> float:
    """Bytes per second of one rotation's copy: the median over `repeats` round trips of `blocks`
    host blocks through `engine`'s own copy path of the slower direction's time. One untimed round
    trip of the same size comes first: Triton compiles a kernel per argument specialization (a
    count of 1 and a count divisible by 16 are different kernels), so a smaller warm-up left the
    compile inside the timed copy (and a probe that read a fraction of the link). It reads device
    slots 1.. and writes the same bytes back, so the pool is left as it was, and resets the
    engine's traffic counters (a probe is not a rotation). Uses at most a quarter of the host pool
    and of the device pool."""
    blocks = _probe_blocks(engine, blocks, 4)
    slots = torch.arange(1, 1 + blocks * engine.host_pool.block_tokens, device=engine.device_pool.device)
    slower = []
    for _ in range(1 + repeats):  # the warm-up, then the timed round trips
        t0 = time.perf_counter()
        kv = engine.save(slots)
        t1 = time.perf_counter()
        engine.load(kv, slots)
        t2 = time.perf_counter()
        engine.free(kv)
        slower.append(max(t1 - t0, t2 - t1))
    _reset_counters(engine)
    return blocks * engine.host_pool.bytes_per_block / max(statistics.median(slower[1:]), 1e-9)


def probe_transfers(engine: Any, candidates: tuple[str, ...] = PROBE_CANDIDATES, blocks: int = LINK_PROBE_BLOCKS,
                    repeats: int = LINK_PROBE_REPEATS) -> dict[str, float]:
    """Seconds of one duplex rotation per candidate path: `blocks` blocks out of device slots 1..
    while as many come back into the next slots, in one `rotate` call (what a rotation step does),
    the median of `repeats` after an untimed warm-up (Triton's compiles). The blocks coming back are
    the next slots' own bytes, saved first by the same path, so the device pool is left as it was;
    the engine is left on its path, with its counters reset. A candidate that fails to run gets inf
    (never chosen). Uses at most a quarter of the host pool and of the device pool; none at all (and
    returns {}) where that is less than a block each way."""
    bt = engine.host_pool.block_tokens
    if engine.host_pool.allocator.num_free < 8 or engine.device_pool.rows < 1 + 8 * bt:
        return {}
    blocks = _probe_blocks(engine, blocks, 8)
    n = blocks * bt
    device = engine.device_pool.device
    away, back = torch.arange(1, 1 + n, device=device), torch.arange(1 + n, 1 + 2 * n, device=device)
    original = engine.transfer
    seconds: dict[str, float] = {}
    for name in candidates:
        try:
            engine.use_transfer(name)
            seconds[name] = _duplex_seconds(engine, away, back, repeats)
        except Exception as e:  # noqa: BLE001 - a path that cannot run here is simply not chosen
            logger.warning("superinfer: transfer path %s failed its probe: %r", name, e)
            seconds[name] = math.inf
    engine.use_transfer(original)
    _reset_counters(engine)
    return seconds


def _duplex_seconds(engine: Any, away: torch.Tensor, back: torch.Tensor, repeats: int) -> float:
    """Also the path's correctness gate: `back` is saved and restored through the path under test
    (both directions), so with exact host blocks its bytes must come back unchanged; a path that
    changes them raises (and the probe never picks it: an unmeasured path must not corrupt KV)."""
    pool = engine.device_pool
    exact = not engine.host_pool.quantized  # fp8 host blocks round-trip lossily by design
    before = [buf[back].clone() for buf in (*pool.k_buffers, *pool.v_buffers)] if exact else []
    parked = engine.save(back)
    try:
        trips = []
        for _ in range(1 + repeats):
            t0 = time.perf_counter()
            handle = engine.rotate(out=[(None, away, away.numel())], inn=[(parked, back)])
            handle.synchronize()
            trips.append(time.perf_counter() - t0)
            for hk in handle.saved:
                engine.free(hk)
        after = [buf[back] for buf in (*pool.k_buffers, *pool.v_buffers)] if exact else []
        # bit patterns, not values: a NaN in the pool equals itself here
        if not all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, after)):
            raise RuntimeError(f"{engine.transfer}: KV bytes changed across its probe round trip")
        return statistics.median(trips[1:])
    finally:
        engine.free(parked)


def choose_transfer(seconds: dict[str, float], fallback: str) -> str:
    """The fastest probed path; a path that holds SMs for the whole transfer only when it beats the
    fastest copy-engine path by SM_HOLD_MARGIN. `fallback` when nothing ran."""
    ran = {name: s for name, s in seconds.items() if math.isfinite(s)}
    if not ran:
        return fallback
    best = min(ran, key=ran.__getitem__)
    dma = [name for name in ran if name in COPY_ENGINE_PATHS]
    if best not in COPY_ENGINE_PATHS and dma:
        best_dma = min(dma, key=ran.__getitem__)
        if ran[best_dma] <= ran[best] * SM_HOLD_MARGIN:
            return best_dma
    return best


def pick_by_probe(engine: Any) -> dict[str, float]:
    """`auto` on CUDA: time the candidates, switch `engine` to the one chosen; returns the times."""
    seconds = probe_transfers(engine)
    if not seconds:  # no room for a probe: the device kind's pick stays
        return seconds
    engine.use_transfer(choose_transfer(seconds, engine.transfer))
    logger.info("superinfer: transfer path %s chosen by its probe (duplex seconds per path: %s)", engine.transfer,
                {name: round(s, 6) for name, s in seconds.items()})
    return seconds
