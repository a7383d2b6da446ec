"""The decode-shortage victim order (rotasched.shortage), shared by the server and the simulator."""

from __future__ import annotations

from superinfer_sgl.rotasched.clock import ReqClock
from superinfer_sgl.rotasched.shortage import victim_key
from superinfer_sgl.rotasched.slo import Slo


def _clock(rid: str, weight: float = 1.0, ttft_met: bool | None = True, gaps_missed: int = 0) -> ReqClock:
    """A clock with a 1 s TTFT SLO, its first token in time, late, or not yet."""
    clk = ReqClock(rid, 0.0, Slo(1000.0, 100.0, weight), gaps_missed=gaps_missed)
    clk.first_token = None if ttft_met is None else (0.5 if ttft_met else 2.0)
    return clk


def test_lost_requests_go_first_lighter_classes_first_then_sglangs_order() -> None:
    rows = {
        "keep_a": victim_key(_clock("keep_a"), 10, 0),  # SGLang would retract it first
        "keep_b": victim_key(_clock("keep_b"), 10, 1),
        "lost_heavy": victim_key(_clock("lost_heavy", weight=4.0, ttft_met=False), 10, 2),
        "lost_light": victim_key(_clock("lost_light", weight=1.0, ttft_met=False), 10, 3),
        "tbt_lost": victim_key(_clock("tbt_lost", weight=2.0, gaps_missed=5), 10, 4),  # 10 gaps: 1 may miss
    }
    assert sorted(rows, key=rows.__getitem__) == ["lost_light", "tbt_lost", "lost_heavy", "keep_a", "keep_b"]


def test_a_request_without_a_first_token_yet_is_not_lost() -> None:
    assert victim_key(_clock("w", ttft_met=None), 5, 7) == (1, 0.0, 7)
    assert victim_key(_clock("w", ttft_met=None), -3, 7) == (1, 0.0, 7)  # outputs left clipped at 0
