"""Where the reconciler gets the cluster's pods and how it checks their allocations."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from controlplane.extender import signing
from controlplane.kube import adapter
from controlplane.kube.sources import ClusterSource
from controlplane.reconciler.services import (
    AllocatedContainer,
    AllocatedDevice,
    Allocation,
    InvalidAllocation,
)


def default_source() -> ClusterSource:
    """The cluster as the one Kubernetes adapter sees it (real API server or the stand-in)."""
    return adapter.cluster_source()


def verify_allocation(annotations: Mapping[str, str]) -> Allocation:
    """Parse a pod's allocation annotation after checking the control plane's signature.

    Raises InvalidAllocation naming what is wrong; a pod owner can write annotations but cannot
    sign them, so an unsigned or altered record is never adopted.
    """
    value = annotations.get(signing.ANNOTATION, "")
    signature = annotations.get(signing.SIGNATURE_ANNOTATION, "")
    if not signature:
        raise InvalidAllocation("the allocation carries no signature")
    if not signing.verify(value, signature):
        raise InvalidAllocation("the allocation's signature does not verify")
    try:
        record: dict[str, Any] = json.loads(value)
        if record.get("v") != signing.VERSION:
            raise InvalidAllocation(f"allocation version {record.get('v')!r} is not supported")
        return Allocation(
            pod_uid=str(record["pod_uid"]),
            namespace=str(record["namespace"]),
            name=str(record["name"]),
            node=str(record["node"]),
            containers=tuple(
                AllocatedContainer(
                    name=str(c["name"]),
                    index=int(c["index"]),
                    init=bool(c["init"]),
                    devices=tuple(
                        AllocatedDevice(str(d["uuid"]), int(d["memory_mib"]), int(d["cores"]))
                        for d in c["devices"]
                    ),
                )
                for c in record["containers"]
            ),
        )
    except (ValueError, KeyError, TypeError) as exc:
        if isinstance(exc, InvalidAllocation):
            raise
        raise InvalidAllocation(f"the allocation is malformed: {exc!r}") from None


def default_verifier():  # type: ignore[no-untyped-def]
    return verify_allocation
