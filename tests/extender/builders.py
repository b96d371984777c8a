"""Builders for extender payloads shaped like kube-scheduler's."""

from __future__ import annotations

from typing import Any

from tests.pods import pod_json


def plain_pod(name: str = "web", namespace: str = "default") -> dict[str, Any]:
    pod = pod_json(name, namespace, containers=[{"name": "web", "image": "nginx"}])
    pod["spec"]["containers"][0]["resources"] = {"limits": {"cpu": "1"}}
    return pod


def filter_args(pod: dict[str, Any], names: list[str]) -> dict[str, Any]:
    return {"Pod": pod, "Nodes": None, "NodeNames": names}


def bind_args(pod: dict[str, Any], node: str) -> dict[str, Any]:
    meta = pod["metadata"]
    return {
        "PodName": meta["name"],
        "PodNamespace": meta["namespace"],
        "PodUID": meta["uid"],
        "Node": node,
    }


def v1_node(name: str) -> dict[str, Any]:
    """A v1.Node as a scheduler without a node cache sends it (trimmed but real-shaped)."""
    return {
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"},
        },
        "spec": {"podCIDR": "10.244.1.0/24"},
        "status": {
            "capacity": {"cpu": "64", "memory": "528Gi", "nvidia.com/gpu": "80"},
            "allocatable": {"cpu": "63", "memory": "520Gi", "nvidia.com/gpu": "80"},
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
