"""How fast this machine moves KV through a rotation engine: the auto rotation budget's input.

`launch_server`'s runtime calls `measure_link` once at startup (`--rotation-budget-blocks auto`),
before any request holds KV; `planner.rotation_budget` turns the speed into blocks per step.
"""

from __future__ import annotations

import statistics
import time

import torch

from superinfer_sgl.duplexkv.engine import RotationEngine

LINK_PROBE_BLOCKS = 64  # the round trip's size: enough bytes that launch overheads do not dominate
LINK_PROBE_REPEATS = 3  # timed round trips after the warm-up; the median is kept


def measure_link(engine: RotationEngine, blocks: int = LINK_PROBE_BLOCKS,
                 repeats: int = LINK_PROBE_REPEATS) -> float:
    """Bytes per second of one rotation's copy: the median over `repeats` round trips of `blocks`
    host blocks through `engine`'s own copy path of the slower direction's time. One untimed round
    trip of the same size comes first: Triton compiles a kernel per argument specialization (a
    count of 1 and a count divisible by 16 are different kernels), so a smaller warm-up left the
    compile inside the timed copy (and a probe that read a fraction of the link). It reads device
    slots 1.. and writes the same bytes back, so the pool is left as it was, and resets the
    engine's traffic counters (a probe is not a rotation). Uses at most a quarter of the host pool
    and of the device pool."""
    bt = engine.host_pool.block_tokens
    blocks = max(1, min(blocks, engine.host_pool.allocator.num_free // 4,
                        (engine.device_pool.rows - 1) // bt // 4))
    slots = torch.arange(1, 1 + blocks * bt, device=engine.device_pool.device)
    slower = []
    for _ in range(1 + repeats):  # the warm-up, then the timed round trips
        t0 = time.perf_counter()
        kv = engine.save(slots)
        t1 = time.perf_counter()
        engine.load(kv, slots)
        t2 = time.perf_counter()
        engine.free(kv)
        slower.append(max(t1 - t0, t2 - t1))
    engine.bytes_out = engine.bytes_in = engine.rotations_out = engine.rotations_in = 0
    return blocks * engine.host_pool.bytes_per_block / max(statistics.median(slower[1:]), 1e-9)
