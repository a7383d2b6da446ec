"""The Grafana dashboard (deploy/grafana/superinfer.json): loading it and the metric names its
PromQL reads, shared by the unit check (names the code registers) and the e2e check (names a live
server's /metrics exports)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "superinfer.json"
PREFIX_CACHE = "superinfer_prefix_"  # series a server exports with --prefix-cache predictive only
_NAME = re.compile(r"\b(superinfer_[a-z0-9_]+|sglang:[a-z0-9_:]+)")


def load() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def exprs(dash: dict[str, Any]) -> list[str]:
    out = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        q = var.get("query")
        if isinstance(q, dict):
            out.append(q["query"])
    return out


def metric_names(dash: dict[str, Any]) -> set[str]:
    """Every sample name (as /metrics writes it: counters with _total) the dashboard reads."""
    return {m for e in exprs(dash) for m in _NAME.findall(e)}


def exported_names(metrics_text: str) -> set[str]:
    """Sample names in a Prometheus text exposition."""
    return {line.split("{")[0].split(" ")[0] for line in metrics_text.splitlines()
            if line and not line.startswith("#")}
