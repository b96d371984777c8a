"""Plain builders of resource.k8s.io/v1 objects as the API server serves them (DRA mode)."""

from __future__ import annotations

from typing import Any

from controlplane.scheduling.claim_demand import SHARED_CLASS
from nodeplugin.cards import Card
from nodeplugin.dra_slices import build_slices


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


def published(node: str, memories: list[int], *, slots: int = 4, **kw: Any) -> list[dict[str, Any]]:
    """The node plugin's own ResourceSlices (nodeplugin.dra_slices) for cards of these MiB."""
    cards = [
        Card(uuid=f"GPU-{node}-{i}", index=i, model="NVIDIA L4", memory_mib=m, minor=i)
        for i, m in enumerate(memories)
    ]
    return build_slices(
        node, cards, modes=kw.get("modes", {}), health=kw.get("health", {}), slots=slots,
        generation=1,
    )  # fmt: skip


def allocated(
    name: str, namespace: str, node: str, device: str, memory_mib: int, compute: int
) -> dict[str, Any]:
    """A claim kube-scheduler allocated on a shared card: its result's consumed capacity."""
    body = claim(name, namespace, device_request(memory=f"{memory_mib}Mi", compute=str(compute)),
                 uid=f"uid-{name}")  # fmt: skip
    body["status"] = {
        "allocation": {
            "devices": {
                "results": [{
                    "request": "gpu", "driver": "gpu.tessera.io", "pool": node, "device": device,
                    "consumedCapacity": {"memory": f"{memory_mib}Mi", "compute": str(compute),
                                         "slots": "1"},
                    "shareID": f"share-{name}",
                }]
            }
        }
    }  # fmt: skip
    return body
