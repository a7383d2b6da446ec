"""Who a decode memory shortage rotates out first: one order for the server
(integration/decode_shortage.py, over SGLang's batch) and the simulator (sim/policies/rotasched.py).

Requests that can no longer meet their SLOs go first (TTFT missed or TBT lost: a pause costs them
nothing they could still win; lower class weight first), then everyone else; within each, SGLang's
own retraction order, so the batch that stays is the one SGLang would have kept. Pure Python.
"""

from __future__ import annotations

from superinfer_sgl.rotasched.clock import ReqClock

VictimKey = tuple[int, float, int]


def victim_key(clock: ReqClock, outputs_left: int, sglang_turn: int) -> VictimKey:
    """Sort key of a shortage victim, the first victim smallest. `sglang_turn`: its place in
    SGLang's retraction order (0: the first SGLang would retract)."""
    lost = clock.ttft_met is False or clock.misses_left(outputs_left if outputs_left > 0 else 0) < 0
    return (0, clock.slo.weight, sglang_turn) if lost else (1, 0.0, sglang_turn)
