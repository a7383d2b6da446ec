#!/usr/bin/env python
"""Render (and validate) the Kubernetes bundle: N superinfer_sgl servers behind SGLang's model
gateway, Prometheus scrape jobs, prometheus-adapter rules and an HPA on the headroom gauges.

    python deploy/k8s/render.py > superinfer.yaml                      # values.yaml as is
    python deploy/k8s/render.py --set replicas=3 --set namespace=llm    # Helm-style overrides
    python deploy/k8s/render.py -f my-values.yaml --validate 1.33.0     # + Kubernetes schema check
    kubectl apply -f superinfer.yaml

A Helm chart in miniature: Jinja2 templates (templates/*.yaml.j2) over values.yaml, no Helm binary
needed (neither Helm nor kustomize installs from PyPI; this renders in CI with the test extras).
`--validate` checks every rendered object against the Kubernetes OpenAPI schemas of that version
with kubernetes-validate (schemas bundled, offline; strict: unknown fields are errors) and the
embedded Prometheus and adapter configs for shape (docs/deploy.md, "Kubernetes").
"""

from __future__ import annotations

import argparse
import copy
import json
import posixpath
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
TEMPLATES = ("namespace", "server", "gateway", "prometheus", "prometheus-adapter", "hpa")
K8S_VERSION = "1.33.0"


def load_values(files: list[Path] = (), sets: list[str] = ()) -> dict[str, Any]:
    """values.yaml, then each -f file merged over it, then each --set key.sub=value (YAML scalar)."""
    values = yaml.safe_load((HERE / "values.yaml").read_text())
    for f in files:
        _merge(values, yaml.safe_load(Path(f).read_text()) or {})
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key=value")
        node = values
        *path, last = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(raw)
    return values


def _merge(base: dict[str, Any], over: dict[str, Any]) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


def server_labels(v: dict[str, Any], component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": v["name"], "app.kubernetes.io/component": component}


def gateway_args(v: dict[str, Any]) -> list[str]:
    """smg's command line: discover the server pods by label in this namespace."""
    g = v["gateway"]
    sel = [f"{k}={val}" for k, val in server_labels(v, "server").items()]
    return ["--host", "0.0.0.0", "--port", str(g["port"]), "--policy", g["policy"],
            "--service-discovery", "--selector", *sel, "--service-discovery-port", str(v["server"]["port"]),
            "--service-discovery-namespace", v["namespace"], "--prometheus-port", str(g["prometheusPort"]),
            "--prometheus-host", "0.0.0.0", "--health-check-interval-secs", str(g["healthCheckIntervalSecs"])]


def scrape_configs(v: dict[str, Any]) -> list[dict[str, Any]]:
    """Prometheus scrape jobs: server pods (port `http`) and gateway pods (port `metrics`)."""
    def job(component: str, port_name: str) -> dict[str, Any]:
        keep = [{"source_labels": [f"__meta_kubernetes_pod_label_{_prom(k)}"], "regex": val, "action": "keep"}
                for k, val in server_labels(v, component).items()]
        return {
            "job_name": f"{v['name']}-{component}s",
            "scrape_interval": v["prometheus"]["scrapeInterval"],
            "metrics_path": "/metrics",
            "kubernetes_sd_configs": [{"role": "pod", "namespaces": {"names": [v["namespace"]]}}],
            "relabel_configs": keep + [
                {"source_labels": ["__meta_kubernetes_pod_container_port_name"], "regex": port_name, "action": "keep"},
                {"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
                {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"},
            ],
        }

    return [job("server", "http"), job("gateway", "metrics")]


def _prom(label: str) -> str:
    """A Kubernetes label name as Prometheus's kubernetes_sd meta label suffix."""
    return "".join(c if c.isalnum() else "_" for c in label)


ADAPTER_SERIES = (("superinfer_requests_at_risk", "sum"), ("superinfer_queue_vlt_max_seconds", "max"))


def adapter_rules(v: dict[str, Any]) -> dict[str, Any]:
    """prometheus-adapter config: each headroom gauge as an external metric, aggregated over pods."""
    return {"externalRules": [
        {"seriesQuery": f'{series}{{namespace!="",pod!=""}}',
         "resources": {"overrides": {"namespace": {"resource": "namespace"}}},
         "name": {"matches": f"^{series}$", "as": series},
         "metricsQuery": f"{agg}(<<.Series>>{{<<.LabelMatchers>>}})"}
        for series, agg in ADAPTER_SERIES]}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    """Every object of the bundle, in apply order (the namespace first)."""
    import jinja2

    v = copy.deepcopy(values)
    if int(v["replicas"]) < 1:
        raise ValueError(f"replicas must be >= 1, got {v['replicas']}")
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True)
    env.filters["dirname"] = posixpath.dirname
    ctx = {**v, "labels": lambda c: json.dumps(server_labels(v, c)), "gateway_args": gateway_args(v),
           "scrape_configs": yaml.safe_dump(scrape_configs(v), sort_keys=False),
           "adapter_rules": yaml.safe_dump(adapter_rules(v), sort_keys=False)}
    docs: list[dict[str, Any]] = []
    for name in TEMPLATES:
        text = env.get_template(f"{name}.yaml.j2").render(**ctx)
        docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def validate(docs: list[dict[str, Any]], version: str = K8S_VERSION) -> list[str]:
    """Kubernetes schema errors (strict) and config-shape errors; empty when all is well."""
    import kubernetes_validate

    errors = []
    for d in docs:
        kind = f"{d.get('kind')}/{d.get('metadata', {}).get('name')}"
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            errors.append(f"{kind}: {exc.message} at {'.'.join(map(str, exc.path))}")
        except Exception as exc:  # noqa: BLE001 - a kind without a schema is an error too
            errors.append(f"{kind}: {exc}")
        if d.get("kind") == "ConfigMap":
            for key, text in (d.get("data") or {}).items():
                try:
                    yaml.safe_load(text)
                except yaml.YAMLError as exc:
                    errors.append(f"{kind}: {key} is not YAML: {exc}")
    return errors


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMaps' embedded configs) as YAML block literals."""


_Dumper.add_representer(str, lambda d, s: d.represent_scalar("tag:yaml.org,2002:str", s,
                                                             style="|" if "\n" in s else None))


def dump(docs: list[dict[str, Any]]) -> str:
    return yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python deploy/k8s/render.py", description=__doc__.split("\n\n")[0])
    p.add_argument("-f", "--values", type=Path, action="append", default=[], help="values file merged over values.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="e.g. replicas=3, server.port=8000")
    p.add_argument("--validate", nargs="?", const=K8S_VERSION, metavar="K8S_VERSION",
                   help=f"check against the Kubernetes schemas of this version (default {K8S_VERSION})")
    p.add_argument("-o", "--out", type=Path, help="write here instead of stdout")
    a = p.parse_args(argv)
    docs = render(load_values(a.values, a.set))
    if a.validate:
        errors = validate(docs, a.validate)
        if errors:
            print("\n".join(errors), file=sys.stderr)
            return 1
        print(f"{len(docs)} objects valid against Kubernetes {a.validate} (strict)", file=sys.stderr)
    text = dump(docs)
    if a.out:
        a.out.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
