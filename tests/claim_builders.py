"""Plain builders of resource.k8s.io/v1 objects as the API server serves them (DRA mode)."""

from __future__ import annotations

from typing import Any

from controlplane.scheduling.claim_demand import SHARED_CLASS


def device_request(
    name: str = "gpu",
    device_class: str = SHARED_CLASS,
    *,
    count: int | None = None,
    memory: str | None = None,
    compute: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    exactly: dict[str, Any] = {"deviceClassName": device_class, **extra}
    if count is not None:
        exactly["count"] = count
    capacity = {k: v for k, v in (("memory", memory), ("compute", compute)) if v is not None}
    if capacity:
        exactly["capacity"] = {"requests": capacity}
    return {"name": name, "exactly": exactly}


def claim_spec(*requests: dict[str, Any]) -> dict[str, Any]:
    return {"devices": {"requests": list(requests) or [device_request()]}}


def claim(
    name: str,
    namespace: str = "default",
    *requests: dict[str, Any],
    uid: str | None = None,
    **meta: Any,
) -> dict[str, Any]:
    metadata = {"name": name, "namespace": namespace, **meta}
    if uid is not None:
        metadata["uid"] = uid
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": metadata,
        "spec": claim_spec(*requests),
    }


def template(name: str, namespace: str = "default", *requests: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"spec": claim_spec(*requests)},
    }
