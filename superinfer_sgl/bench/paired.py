"""Paired mode (`--paired`): two systems at the same time, on the same arrival schedule, each on
its own cores.

Why: a shared machine's speed drifts within minutes. Run side by side, a slow phase of the machine
hits both systems of a pair at once, so their difference keeps little of it; run one after the
other, it lands on one system only.

What it costs: each server (with its load generator) has half the machine (one core of two here;
OMP_NUM_THREADS set to its share), so absolute speed halves and calibration scales SLOs and rates
to that. What the two sides still share: memory bandwidth, the last-level cache, the kernel and its
interrupts. An A/A pair (stock against its twin, `--noise`) measures what that leaves.

Cores alternate between the two sides from point to point, so a core busier with interrupts does
not favour one system.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from .servers import SystemSpec, noise_twin_name

def pairs_for(systems: Sequence[SystemSpec]) -> list[tuple[SystemSpec, SystemSpec]]:
    """(A, B) pairs, B - A being the difference reported: every baseline against each of our
    systems (ours is B), and stock against its twin (the A/A pair). Without ours, the systems pair
    up in order."""
    by_name = {s.name: s for s in systems}
    twin = noise_twin_name("sglang")
    pairs: list[tuple[SystemSpec, SystemSpec]] = []
    ours = [s for s in systems if s.ours]
    if ours:
        pairs += [(s, o) for o in ours for s in systems if not s.ours and s.name != twin]
    if twin in by_name and "sglang" in by_name:
        pairs.append((by_name["sglang"], by_name[twin]))
    if not pairs:
        rest = [s for s in systems if s.name != twin]
        pairs = [(a, b) for a, b in zip(rest[::2], rest[1::2])]
    if not pairs:
        raise ValueError(f"--paired needs two systems to pair; got {[s.name for s in systems]}")
    return pairs


def core_halves() -> tuple[frozenset[int], frozenset[int]]:
    """The cores this process may use, split in two halves (one core each on a 2-core machine)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise ValueError(f"--paired needs at least 2 cores; this process may use {cores}")
    half = len(cores) // 2
    return frozenset(cores[:half]), frozenset(cores[half: 2 * half])
