"""Per-class SLO outcomes in /metrics: ttft, tbt and joint (both met). One difference from the
A/B harness's count: a request with a single output token has no TBT verdict here (no joint
series), while the harness counts its empty gap list as met."""

from __future__ import annotations

from prometheus_client import REGISTRY

from superinfer_sgl.integration.metrics import RotaSchedMetrics


def _value(cls: str, slo: str, outcome: str) -> float:
    v = REGISTRY.get_sample_value("superinfer_slo_requests_total", {"slo_class": cls, "slo": slo, "outcome": outcome})
    return v or 0.0


def test_per_class_joint_attainment_series() -> None:
    m = RotaSchedMetrics()
    m.finished("interactive", True, True)
    m.finished("interactive", True, False)
    m.finished("batch", False, True)
    m.finished(None, True, None)  # TBT unknown (one output token): no joint verdict
    assert (_value("interactive", "joint", "met"), _value("interactive", "joint", "missed")) == (1.0, 1.0)
    assert (_value("batch", "joint", "met"), _value("batch", "joint", "missed")) == (0.0, 1.0)
    assert _value("default", "ttft", "met") == 1.0 and _value("default", "joint", "met") == 0.0
    assert _value("default", "joint", "missed") == 0.0
