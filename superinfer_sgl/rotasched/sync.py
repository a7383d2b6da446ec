"""Tensor-parallel agreement on the LVF decision.

VLT reads wall time, so ranks that each ran LVF could disagree by a clock tick and
schedule different batches. Rank 0 decides alone and every other rank adopts its result.
"""

from __future__ import annotations

from collections.abc import Callable

from superinfer_sgl.rotasched.lvf import Decision


class DecisionSync:
    """`broadcast(obj)`: on rank 0 sends obj and returns it; elsewhere returns rank 0's obj."""

    def __init__(self, rank: int, broadcast: Callable[[object], object]) -> None:
        assert rank >= 0, rank
        self.rank = rank
        self._broadcast = broadcast

    def decide(self, fn: Callable[[], Decision]) -> Decision:
        """Rank 0 runs `fn` and shares the result; other ranks never call `fn`."""
        if self.rank == 0:
            decision = fn()
            self._broadcast(decision)
            return decision
        received = self._broadcast(None)
        if not isinstance(received, Decision):
            raise TypeError(f"rank {self.rank} received {type(received).__name__}, not Decision")
        return received
