"""Monitoring as shipped: every query of the Grafana dashboard names a series Tessera exports,
and the chart's ServiceMonitor scrapes the node plugins' metrics port."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.metrics_core import Metric

from controlplane.dashboard.metrics import read_ledger
from controlplane.metrics import process_registry
from nodeplugin.metrics import FAMILIES
from tests.deploy.chart import RELEASE, ROOT, render

DASHBOARD = ROOT / "deploy" / "grafana" / "tessera-dashboard.json"

# The sample names a family of each type puts on the wire (OpenMetrics suffixes).
_SUFFIXES = {
    "gauge": ("",),
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
    "info": ("_info",),
}
# PromQL words that look like identifiers but name no series.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
             "or", "unless", "offset", "inf", "nan"}  # fmt: skip


def _sample_names(name: str, kind: str) -> set[str]:
    return {name + s for s in _SUFFIXES[kind]}


def _control_plane_names() -> set[str]:
    """What the control plane's /metrics renders: its instruments and the ledger's gauges."""
    names: set[str] = set()
    collected: list[Metric] = list(process_registry().collect())
    for family in collected:
        if family.name.startswith("tessera_"):
            names |= _sample_names(family.name, family.type)
    for ledger in read_ledger():
        names.add(ledger.name)
    return names


def _node_plugin_names() -> set[str]:
    names: set[str] = set()
    for d in FAMILIES.values():
        names |= _sample_names(d.name, d.kind)
    return names


def _queries(node: Any) -> Iterator[str]:
    """Every PromQL expression in the dashboard: panel targets and variable queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "definition" and isinstance(value, str):
                match = re.fullmatch(r"label_values\((.*),\s*\w+\)", value.strip())
                assert match, f"unexpected variable query {value!r}"
                yield match.group(1)
            else:
                yield from _queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from _queries(item)


def series_in(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: strings, label matchers, grouping
    clauses, ranges and dashboard variables removed; what is left and is not called (a
    function or an aggregation) nor a keyword is a series name."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\$\{?\w+\}?", "", text)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        word, called = m.group(1), m.group(2)
        if called or word.lower() in _KEYWORDS or re.fullmatch(r"\d+[smhdwy]", word):
            continue
        names.add(word)
    return names


def test_series_in_reads_promql() -> None:
    assert series_in(
        'sum by (node) (rate(a_total{node=~"$node", x="y{z}"}[5m])) / on (node) '
        "group_left (model) b > 0 or vector(0)"
    ) == {"a_total", "b"}
    assert series_in("histogram_quantile(0.99, sum by (le) (rate(c_bucket[5m])))") == {"c_bucket"}


@pytest.mark.django_db
def test_every_dashboard_query_names_an_exported_series() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = _control_plane_names() | _node_plugin_names()
    queries = list(_queries(dashboard))
    assert len(queries) > 20
    unknown = {
        (name, q) for q in queries for name in series_in(q) if name not in exported
    }  # fmt: skip
    assert not unknown, f"the dashboard queries series nobody exports: {sorted(unknown)}"
    used = {name for q in queries for name in series_in(q)}
    # the node plugin's figures are on the dashboard, each of them
    for name in (
        "tessera_card_gpu_utilization_percent",
        "tessera_card_memory_used_bytes",
        "tessera_card_memory_total_bytes",
        "tessera_card_temperature_celsius",
        "tessera_card_power_watts",
        "tessera_card_xid_errors_total",
        "tessera_card_nvml_read_errors_total",
        "tessera_container_gpu_memory_used_bytes",
        "tessera_container_gpu_memory_limit_bytes",
        "tessera_container_gpu_compute_share_percent",
        "tessera_container_gpu_sm_utilization_percent",
    ):
        assert name in used, name


@pytest.mark.django_db
def test_a_name_both_export_is_queried_as_one_of_them() -> None:
    """The control plane and the node plugin both export tessera_card_healthy (the ledger's
    view and the plugin's): a query must pick one by a label only that one has, or it counts
    every card twice."""
    plane = {f.name: set(f.labels) for f in read_ledger()}
    plugin = {d.name: set(d.labels) for d in FAMILIES.values() if d.kind == "gauge"}
    shared = plane.keys() & plugin.keys()
    assert "tessera_card_healthy" in shared
    queries = list(_queries(json.loads(DASHBOARD.read_text())))
    for name in shared:
        only_one = (plane[name] - plugin[name]) | (plugin[name] - plane[name])
        for q in queries:
            for selector in re.findall(rf"\b{name}(?:\{{([^}}]*)\}})?", q):
                picked = set(re.findall(r'(\w+)\s*!=\s*""', selector))
                assert picked & only_one, f"{q!r} mixes both exporters' {name}"


def test_dashboard_panels_have_unique_ids_and_sit_on_the_grid() -> None:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for p in panels:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]


def _monitor(*sets: str) -> dict[str, Any]:
    docs = render(
        sets=("metrics.serviceMonitor.enabled=true", *sets),
    )
    (monitor,) = [d for d in docs if d["kind"] == "ServiceMonitor"]
    return {"monitor": monitor, "docs": docs}


def test_service_monitor_scrapes_the_node_plugins_metrics_port() -> None:
    got = _monitor()
    monitor, docs = got["monitor"], got["docs"]
    endpoints = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    plugin = endpoints["metrics"]
    assert plugin["path"] == "/metrics"
    assert "authorization" not in plugin  # the plugin's port serves no secrets and checks none
    (service,) = [
        d
        for d in docs
        if d["kind"] == "Service" and d["metadata"]["name"] == f"{RELEASE}-nodeplugin-metrics"
    ]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    # the monitor selects the Service, the Service selects the plugin's pods and their port
    labels = service["metadata"]["labels"]
    for expr in monitor["spec"]["selector"]["matchExpressions"]:
        assert labels[expr["key"]] in expr["values"], expr
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    (port,) = service["spec"]["ports"]
    (plugin_container,) = [
        c for c in ds["spec"]["template"]["spec"]["containers"] if c["name"] == "nodeplugin"
    ]
    ports = {p["name"]: p["containerPort"] for p in plugin_container.get("ports", [])}
    assert port["targetPort"] == "metrics" and ports["metrics"] == port["port"]
    env = {e["name"]: e.get("value") for e in plugin_container["env"]}
    assert env["TESSERA_METRICS_PORT"] == str(port["port"])
    assert env["TESSERA_METRICS_INTERVAL_S"] == "10"


def test_no_node_plugin_endpoint_when_its_metrics_are_off() -> None:
    got = _monitor("nodeplugin.metricsPort=0")
    assert [e["port"] for e in got["monitor"]["spec"]["endpoints"]] == ["http"]
    assert not [d for d in got["docs"] if d["metadata"]["name"].endswith("nodeplugin-metrics")]


def test_metrics_interval_reaches_the_plugin() -> None:
    (ds,) = [
        d
        for d in render(sets=("nodeplugin.metricsIntervalSeconds=30",))
        if d["kind"] == "DaemonSet"
    ]
    env = {
        e["name"]: e.get("value") for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]
    }
    assert env["TESSERA_METRICS_INTERVAL_S"] == "30"


def test_host_proc_only_when_asked() -> None:
    """Per-container compute needs the host's pids: the host's /proc, read-only, on request."""

    def plugin(*sets: str) -> tuple[dict[str, Any], dict[str, Any]]:
        (ds,) = [d for d in render(sets=sets) if d["kind"] == "DaemonSet"]
        spec = ds["spec"]["template"]["spec"]
        return spec, spec["containers"][0]

    spec, c = plugin()
    assert "TESSERA_PROC_ROOT" not in {e["name"] for e in c["env"]}
    assert "host-proc" not in {v["name"] for v in spec["volumes"]}
    spec, c = plugin("nodeplugin.hostProc=true")
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["TESSERA_PROC_ROOT"] == "/host/proc"
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "host-proc"]
    assert mount == {"name": "host-proc", "mountPath": "/host/proc", "readOnly": True}
    (volume,) = [v for v in spec["volumes"] if v["name"] == "host-proc"]
    assert volume["hostPath"]["path"] == "/proc"
