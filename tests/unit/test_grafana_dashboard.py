"""deploy/grafana/superinfer.json: valid dashboard JSON whose PromQL reads only series the code
registers, and covers every superinfer_* series (the live check against /metrics is e2e:
tests/e2e/test_dashboard_metrics.py)."""

from __future__ import annotations

import sys
from pathlib import Path

from prometheus_client import CollectorRegistry

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grafana_dashboard as gd  # noqa: E402

from superinfer_sgl.integration.metrics import RotaSchedMetrics  # noqa: E402
from superinfer_sgl.integration.prefix_metrics import PrefixCacheMetrics  # noqa: E402


def _registered() -> set[str]:
    reg = CollectorRegistry()
    RotaSchedMetrics(registry=reg)
    PrefixCacheMetrics(registry=reg)  # exported with --prefix-cache predictive
    # Labelled series have no samples until a label set is used: name them from the families.
    names = set()
    for family in reg.collect():
        names.add(family.name + "_total" if family.type == "counter" else family.name)
    return names


def test_dashboard_is_well_formed() -> None:
    dash = gd.load()
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    graphs = [p for p in dash["panels"] if p["type"] != "row"]
    assert graphs
    for p in graphs:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
    variables = {v["name"] for v in dash["templating"]["list"]}
    for e in gd.exprs(dash):
        for opener, closer in ("()", "{}", "[]"):
            assert e.count(opener) == e.count(closer), e
        assert e.count('"') % 2 == 0, e
        for var in ("$instance",):
            if var in e:
                assert var[1:] in variables, e


def test_dashboard_reads_registered_series_and_covers_them_all() -> None:
    used = {n for n in gd.metric_names(gd.load()) if n.startswith("superinfer_")}
    registered = _registered()
    assert used - registered == set(), "the dashboard reads series the code does not register"
    assert registered - used == set(), "superinfer_* series missing from the dashboard"
