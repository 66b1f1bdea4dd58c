"""Strict offline schema validation of everything the kustomizations render, and a check that
every PromQL query (dashboard, alerts, KEDA triggers) names series some component exports.

Built-in kinds are checked against the Kubernetes API's own models (the `kubernetes` client:
each object's fields, recursively, must be fields of its model, and required ones present).
The custom resources (KEDA ScaledObject, Prometheus Operator PodMonitor, ServiceMonitor,
PrometheusRule) are checked against the JSON Schemas in tests/unit/k8s/schemas/, strict
subsets of their CRDs (every object refuses fields it does not list).
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from kubernetes import client as k8s_client  # type: ignore[import-untyped]

from gateway.metrics import GatewayMetrics
from tests.unit.k8s.test_k8s_manifests import (
    DASHBOARD,
    K8S,
    Obj,
    dashboard_exprs,
    exported_series,
    kustomize_tool,
    of_kind,
    render,
)
from worker.metrics import WorkerCollector

SCHEMAS = Path(__file__).parent / "schemas"
CRD_SCHEMAS = {"ScaledObject": "scaledobject.json", "PodMonitor": "podmonitor.json",
               "ServiceMonitor": "servicemonitor.json", "PrometheusRule": "prometheusrule.json"}
# What is applied: the overlays (their components and base included) and the monitoring set
# (k8s/monitoring inside its gpu-tls variant: the same objects, patched).
RENDERED = ("overlays/cpu-dev", "overlays/gpu-fleet", "overlays/gpu-tls",
            "overlays/gpu-tls/monitoring")

needs_kustomize = pytest.mark.skipif(kustomize_tool() is None,
                                     reason="neither kubectl nor kustomize is installed")


@functools.cache
def rendered(directory: str) -> tuple[Obj, ...]:
    return tuple(render(K8S / directory))


# -- built-in kinds: the Kubernetes API's models ------------------------------------------------
def _model_name(obj: Obj) -> str:
    version = str(obj["apiVersion"]).rsplit("/", 1)[-1]
    return f"V{version[1:].capitalize()}{obj['kind']}" if version.startswith("v") else ""


def check_fields(value: Any, klass: str, where: str) -> None:
    """`value` has only fields of model `klass` (a kubernetes.client type string), recursively."""
    if klass.lower().startswith("list["):
        assert isinstance(value, list), f"{where}: expected a list"
        for i, item in enumerate(value):
            check_fields(item, klass[5:-1], f"{where}[{i}]")
    elif klass.lower().startswith(("dict(", "dict[")):
        assert isinstance(value, dict), f"{where}: expected a mapping"
        inner = klass[klass.index(",") + 1:-1].strip()
        for key, item in value.items():
            check_fields(item, inner, f"{where}.{key}")
    elif klass == "str" and re.search(r"\.resources\.(limits|requests)\.[^.]+", where):
        # A resource Quantity (the models say str): a number or a string.
        assert isinstance(value, str | int | float), f"{where}: {value!r} is no quantity"
    elif klass in ("str", "bytes", "bytearray"):  # bytes: base64 text in a manifest
        assert isinstance(value, str), f"{where}: expected a string, got {value!r}"
    elif klass == "int":
        assert isinstance(value, int) and not isinstance(value, bool), f"{where}: {value!r}"
    elif klass == "bool":
        assert isinstance(value, bool), f"{where}: expected a boolean, got {value!r}"
    elif klass == "float":
        assert isinstance(value, int | float), f"{where}: expected a number, got {value!r}"
    elif klass not in ("object", "datetime", "date"):
        model = getattr(k8s_client, klass)
        assert isinstance(value, dict), f"{where}: expected a {klass} mapping"
        by_json = {json_name: attr for attr, json_name in model.attribute_map.items()}
        unknown = sorted(set(value) - set(by_json))
        assert not unknown, f"{where}: {unknown} are not fields of {klass}"
        for key, item in value.items():
            check_fields(item, model.openapi_types[by_json[key]], f"{where}.{key}")


def check_builtin(obj: Obj) -> None:
    klass = _model_name(obj)
    where = f"{obj['kind']} {obj['metadata']['name']}"
    assert hasattr(k8s_client, klass), f"{where}: no API model {klass} for {obj['apiVersion']}"
    check_fields(obj, klass, where)
    # Types and required fields: the client's models validate what they are built from.
    getattr(k8s_client, klass).from_dict(_quantities_as_text(obj))


def _quantities_as_text(value: Any, key: str = "") -> Any:
    """A copy with resource quantities as strings (YAML `nvidia.com/gpu: 1` is a number)."""
    if isinstance(value, dict):
        if key in ("limits", "requests"):
            return {k: str(v) for k, v in value.items()}
        return {k: _quantities_as_text(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_quantities_as_text(v) for v in value]
    return value


# -- custom resources: the vendored schemas -----------------------------------------------------
@functools.cache
def crd_validator(kind: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / CRD_SCHEMAS[kind]).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def check_custom(obj: Obj) -> None:
    errors = sorted(crd_validator(obj["kind"]).iter_errors(obj), key=lambda e: list(e.path))
    assert not errors, f"{obj['kind']} {obj['metadata']['name']}: " + "; ".join(
        f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors)
    if obj["kind"] == "ScaledObject":
        behavior = obj["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {})
        if "behavior" in behavior:
            check_fields(behavior["behavior"], "V2HorizontalPodAutoscalerBehavior",
                         f"ScaledObject {obj['metadata']['name']} behavior")
        for trigger in obj["spec"]["triggers"]:
            if trigger["type"] == "prometheus":  # KEDA's prometheus scaler needs all three
                assert {"serverAddress", "query", "threshold"} <= set(trigger["metadata"])
                float(trigger["metadata"]["threshold"])


def check_schema(obj: Obj) -> None:
    if obj["kind"] in CRD_SCHEMAS:
        check_custom(obj)
    else:
        check_builtin(obj)


def test_the_vendored_schemas_are_strict() -> None:
    """A field nobody defined fails (so the schemas can catch a typo)."""
    for kind in CRD_SCHEMAS:
        schema = json.loads((SCHEMAS / CRD_SCHEMAS[kind]).read_text())
        assert schema["additionalProperties"] is False
        assert schema["properties"]["spec"]["additionalProperties"] is False
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor",
               "metadata": {"name": "x"},
               "spec": {"selector": {}, "podMetricsEndpoints": [{"port": "m", "pth": "/"}]}}
    with pytest.raises(AssertionError, match="pth"):
        check_custom(monitor)
    deployment = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
                  "spec": {"selector": {}, "template": {"spec": {"containers": [
                      {"name": "c", "imagePullPolicy": "Always", "argz": []}]}}}}
    with pytest.raises(AssertionError, match="argz"):
        check_builtin(deployment)


@needs_kustomize
@pytest.mark.parametrize("directory", RENDERED)
def test_rendered_objects_match_their_schemas(directory: str) -> None:
    objs = rendered(directory)
    assert objs
    for obj in objs:
        check_schema(obj)


@needs_kustomize
def test_fleet_objects_are_rendered() -> None:
    """gpu-fleet: KEDA scales both worker pools, which have headless Services; the gateway has
    two replicas; the monitoring set scrapes every worker pod."""
    objs = list(rendered("overlays/gpu-fleet"))
    scaled = {o["spec"]["scaleTargetRef"]["name"] for o in of_kind(objs, "ScaledObject")}
    assert scaled == {"splitserve-prefill", "splitserve-decode"}
    assert not of_kind(objs, "HorizontalPodAutoscaler")  # KEDA owns them
    headless = {o["metadata"]["name"] for o in of_kind(objs, "Service")
                if o["spec"].get("clusterIP") == "None"}
    assert headless == {"splitserve-prefill-headless", "splitserve-decode-headless"}
    gateway = next(d for d in of_kind(objs, "Deployment") if d["metadata"]["name"].endswith(
        "gateway"))
    assert gateway["spec"]["replicas"] >= 2
    hpas = of_kind(list(rendered("overlays/cpu-dev")), "HorizontalPodAutoscaler")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in hpas} == scaled
    tls = list(rendered("overlays/gpu-tls/monitoring"))
    monitors = of_kind(tls, "PodMonitor")
    assert {m["spec"]["selector"]["matchLabels"]["app.kubernetes.io/component"]
            for m in monitors} == {"prefill", "decode"}
    assert all(ep["port"] == "metrics" for m in monitors for ep in m["spec"]["podMetricsEndpoints"])
    endpoints = [ep for m in of_kind(tls, "PodMonitor") for ep in m["spec"]["podMetricsEndpoints"]]
    endpoints += [ep for m in of_kind(tls, "ServiceMonitor") for ep in m["spec"]["endpoints"]]
    assert endpoints and all(ep["scheme"] == "https" and ep["tlsConfig"]["ca"]
                             for ep in endpoints)


# -- PromQL: every query names exported series -------------------------------------------------
_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",)}


class _Idle:
    def __init__(self) -> None:
        self.draining = False
        self.active = 0
        self.started: dict[str, int] = {}


def worker_series() -> set[str]:
    """Series names a worker's /metrics exports (worker/metrics.py), from its collector."""
    loop = asyncio.new_event_loop()
    try:
        collector = WorkerCollector(lambda: None, _Idle(), "m", "decode", loop)
        return {m.name + s for m in collector.describe() for s in _SUFFIXES[m.type]}
    finally:
        loop.close()


def promql_queries() -> Iterator[tuple[str, str]]:
    """(where, query) of every PromQL expression in the repository's manifests."""
    for expr in dashboard_exprs(json.loads(DASHBOARD.read_text())):
        yield "dashboard", expr
    for path in sorted(K8S.rglob("*.yaml")):
        for obj in (d for d in _docs(path) if isinstance(d, dict)):
            if obj.get("kind") == "PrometheusRule":
                for group in obj["spec"]["groups"]:
                    for rule in group["rules"]:
                        yield f"{path.name} {rule.get('alert') or rule.get('record')}", rule["expr"]
            if obj.get("kind") == "ScaledObject":
                for trigger in obj["spec"]["triggers"]:
                    if trigger["type"] == "prometheus":
                        yield f"{path.name} {obj['metadata']['name']}", trigger["metadata"]["query"]


def _docs(path: Path) -> list[Any]:
    import yaml

    return list(yaml.safe_load_all(path.read_text()))


def test_every_promql_query_names_exported_series() -> None:
    series = exported_series() | worker_series()
    assert "splitserve:engine_num_requests_waiting" in series
    assert {m.name for m in GatewayMetrics().registry.collect()} & {"splitserve:worker_healthy"}
    queries = list(promql_queries())
    kinds = {where.split(" ")[0] for where, _ in queries}
    assert {"dashboard", "alerts.yaml", "scaledobjects.yaml"} <= kinds, kinds
    for where, query in queries:
        used = set(re.findall(r"splitserve:[A-Za-z0-9_:]+", query))
        assert used, f"{where}: the query names no splitserve series: {query}"
        unknown = used - series
        assert not unknown, f"{where}: {sorted(unknown)} are exported by no component: {query}"
