"""Tensor-parallel agreement on the LVF decision.

VLT reads wall time, so ranks that each ran LVF could disagree by a clock tick and
schedule different batches. Rank 0 decides alone and every other rank adopts its result, and
its rotation budget (each rank measures its own step times).
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

    def decide(self, fn: Callable[[], Decision], budget: int = 0) -> tuple[Decision, int]:
        """Rank 0 runs `fn` and shares the result with its rotation `budget` (blocks per direction
        this step); other ranks never call `fn` and take rank 0's budget for their own: each rank
        measures its own step times, and budgets a block apart would prefetch and copy differently."""
        if self.rank == 0:
            decision = fn()
            self._broadcast((decision, budget))
            return decision, budget
        received = self._broadcast(None)
        if not (isinstance(received, tuple) and len(received) == 2 and isinstance(received[0], Decision)
                and isinstance(received[1], int)):
            raise TypeError(f"rank {self.rank} received {type(received).__name__}, not (Decision, budget)")
        return received
