"""deploy/k8s: the bundle renders for N replicas and every object passes the Kubernetes OpenAPI
schemas (kubernetes-validate, strict, offline); the gateway's arguments parse with smg's own
parser and select the server pods; the autoscaler and the adapter read series our server exports."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

kubernetes_validate = pytest.importorskip("kubernetes_validate")
REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("k8s_render", REPO / "deploy" / "k8s" / "render.py")
render = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render)


def _bundle(n: int, *sets: str) -> dict[str, dict]:
    docs = render.render(render.load_values(sets=[f"replicas={n}", *sets]))
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


@pytest.mark.parametrize("n", [1, 3])
def test_renders_and_validates_for_n_replicas(n):
    docs = render.render(render.load_values(sets=[f"replicas={n}"]))
    for version in ("1.30.0", render.K8S_VERSION):
        assert render.validate(docs, version) == []
    by = {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}
    assert "replicas" not in by["Deployment/superinfer-server"]["spec"]  # the autoscaler's (below)
    hpa = by["HorizontalPodAutoscaler/superinfer-server"]["spec"]
    assert hpa["minReplicas"] == n and hpa["maxReplicas"] >= n
    assert hpa["scaleTargetRef"]["name"] == "superinfer-server"
    # the round trip through the CLI's YAML is the same objects
    assert list(yaml.safe_load_all(render.dump(docs))) == docs


def test_the_validator_rejects_what_kubernetes_would():
    docs = render.render(render.load_values())
    dep = next(d for d in docs if d["kind"] == "Deployment")
    dep["spec"]["replicaz"] = 2  # unknown field (strict)
    hpa = next(d for d in docs if d["kind"] == "HorizontalPodAutoscaler")
    hpa["spec"]["metrics"][0]["external"]["target"]["type"] = 7  # wrong type
    errors = render.validate(docs)
    assert any("replicaz" in e for e in errors) and any("HorizontalPodAutoscaler" in e for e in errors)
    with pytest.raises(ValueError):
        render.render(render.load_values(sets=["replicas=0"]))


def test_server_pods_run_our_launcher_with_metrics_on_the_probed_port():
    by = _bundle(2)
    pod = by["Deployment/superinfer-server"]["spec"]["template"]
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["python", "-m", "superinfer_sgl.launch_server"]
    args = c["args"]
    assert "--enable-metrics" in args and args[args.index("--port") + 1] == str(c["ports"][0]["containerPort"])
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == args[args.index("--port") + 1]
    from superinfer_sgl.config import SuperInferConfig

    ours = [a for a in args if a.startswith("--") and a[2:].replace("-", "_") in SuperInferConfig.__dataclass_fields__]
    assert "--policy" in ours  # values' extra flags reach our launcher's own options


def test_gateway_arguments_parse_with_smg_and_select_the_server_pods():
    smg = pytest.importorskip("smg.launch_router")
    by = _bundle(3)
    gw = by["Deployment/superinfer-gateway"]["spec"]["template"]["spec"]
    parsed = smg.parse_router_args(gw["containers"][0]["args"])
    assert parsed.service_discovery and parsed.service_discovery_port == 30000
    assert parsed.service_discovery_namespace == "superinfer"
    selector = dict(s.split("=", 1) for s in parsed.selector) if isinstance(parsed.selector, list) else parsed.selector
    server_labels = by["Deployment/superinfer-server"]["spec"]["template"]["metadata"]["labels"]
    assert selector and all(server_labels.get(k) == v for k, v in selector.items())
    gateway_labels = by["Deployment/superinfer-gateway"]["spec"]["template"]["metadata"]["labels"]
    assert not all(gateway_labels.get(k) == v for k, v in selector.items())  # it does not route to itself
    # the gateway can watch pods in its namespace
    role = by["Role/superinfer-gateway"]["rules"][0]
    assert "pods" in role["resources"] and {"list", "watch"} <= set(role["verbs"])
    assert gw["serviceAccountName"] == by["RoleBinding/superinfer-gateway"]["subjects"][0]["name"]


def _registered_series() -> set[str]:
    src = (REPO / "superinfer_sgl" / "integration" / "metrics.py").read_text()
    return set(re.findall(r'"(superinfer_[a-z_]+)"', src))


def test_autoscaler_and_adapter_read_series_the_server_exports():
    by = _bundle(1)
    series = _registered_series()
    hpa = by["HorizontalPodAutoscaler/superinfer-server"]["spec"]
    names = {m["external"]["metric"]["name"] for m in hpa["metrics"]}
    assert names == {"superinfer_requests_at_risk", "superinfer_queue_vlt_max_seconds"} and names <= series
    rules = yaml.safe_load(by["ConfigMap/superinfer-adapter-rules"]["data"]["config.yaml"])["externalRules"]
    assert {r["name"]["as"] for r in rules} == names
    for r in rules:
        assert r["seriesQuery"].split("{")[0] in series and "<<.Series>>" in r["metricsQuery"]
    # the HPA's selector matches the job label the scrape config gives the server pods' series
    jobs = yaml.safe_load(by["ConfigMap/superinfer-prometheus-scrape"]["data"]["scrape_configs.yml"])
    server_job = next(j for j in jobs if j["job_name"].endswith("-servers"))
    for m in hpa["metrics"]:
        assert m["external"]["metric"]["selector"]["matchLabels"]["job"] == server_job["job_name"]
    # the scrape job keeps exactly the server pods: its keep rules match their labels and port name
    pod = by["Deployment/superinfer-server"]["spec"]["template"]
    labels = {"__meta_kubernetes_pod_label_" + render._prom(k): v for k, v in pod["metadata"]["labels"].items()}
    labels["__meta_kubernetes_pod_container_port_name"] = pod["spec"]["containers"][0]["ports"][0]["name"]
    for rule in server_job["relabel_configs"]:
        if rule.get("action") == "keep":
            assert re.fullmatch(rule["regex"], labels[rule["source_labels"][0]])
    assert {r.get("target_label") for r in server_job["relabel_configs"]} >= {"namespace", "pod"}


def test_autoscaling_can_be_switched_off():
    assert not any(k.startswith("HorizontalPodAutoscaler/") for k in _bundle(2, "autoscaling.enabled=false"))


def test_probes_fit_what_sglang_answers():
    """/health generates a token and answers after 1 s at the earliest (up to
    SGLANG_HEALTH_CHECK_TIMEOUT, 20 s): probed with the kubelet's default 1 s timeout the pods never
    became ready. Startup and readiness read /ready (immediate), liveness /health with room."""
    from sglang.srt.entrypoints import http_server

    c = _bundle(2)["Deployment/superinfer-server"]["spec"]["template"]["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"] == "/ready" and c[probe].get("timeoutSeconds", 1) >= 2
    live = c["livenessProbe"]
    assert live["httpGet"]["path"] == "/health" and live["timeoutSeconds"] > http_server.HEALTH_CHECK_TIMEOUT
    routes = {getattr(r, "path", None) for r in http_server.app.routes}
    assert {"/ready", "/health"} <= routes


def test_the_autoscaler_owns_the_replica_count():
    """With the HPA on, an apply must not reset the Deployment's scale to `replicas`."""
    on = _bundle(3)
    assert "replicas" not in on["Deployment/superinfer-server"]["spec"]
    assert on["HorizontalPodAutoscaler/superinfer-server"]["spec"]["minReplicas"] == 3
    assert _bundle(3, "autoscaling.enabled=false")["Deployment/superinfer-server"]["spec"]["replicas"] == 3
