"""The mutating admission webhook's decision for one pod (DESIGN §4), as data.

A pod that names another scheduler than Tessera's or one Tessera adopts (`default-scheduler` by
default) belongs to that scheduler (Volcano, KAI, ...) and passes untouched, unread, as HAMi
leaves it: with `failurePolicy: Fail` a refusal here would break every batch scheduler that runs
beside Tessera. The rest that ask for a managed resource get `schedulerName: tessera-scheduler`
(configurable) and `nvidia.com/gpu: 1` where a container gave only memory or cores. What can
never run is refused with a sentence naming the field: a GPU request `parse_pod` refuses,
privileged GPU containers (they see every GPU of the node, past any slice), a preset
`spec.nodeName` (it skips the scheduler, so no slice would be reserved), and asks larger than
any registered card or node. Everything else passes untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from controlplane.ledger.selectors import InventoryLimits
from controlplane.scheduling import (
    MIG_RESOURCE_PREFIX,
    PodRequest,
    RequestError,
    SchedulingConfig,
    parse_pod,
)

DEFAULT_SCHEDULER = "default-scheduler"
ADOPTED_BY_DEFAULT = (DEFAULT_SCHEDULER,)


@dataclass(frozen=True, slots=True)
class Admission:
    allowed: bool
    message: str = ""
    patch: list[dict[str, Any]] = field(default_factory=list)
    # Shown to whoever created the pod (kubectl prints them): what was accepted but not applied.
    warnings: tuple[str, ...] = ()


def _pointer(*parts: str | int) -> str:
    """A JSON Pointer (RFC 6901): '~' and '/' inside a key are escaped."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def deny(field_path: str, message: str) -> Admission:
    return Admission(False, f"{field_path}: {message}" if field_path else message)


def _containers(spec: Mapping[str, Any], init: bool) -> list[Any]:
    raw = spec.get("initContainers" if init else "containers")
    return raw if isinstance(raw, list) else []


@dataclass(frozen=True, slots=True)
class Reviewed:
    """A pod read for admission: its GPU ask, or the verdict that ends the review (a pod that is
    not Tessera's or asks for no GPU passes; one that could never run is denied)."""

    request: PodRequest | None
    verdict: Admission | None


def read_pod(
    pod: Mapping[str, Any],
    config: SchedulingConfig,
    scheduler_name: str,
    inventory: Callable[[], InventoryLimits],
    adopted: tuple[str, ...] = ADOPTED_BY_DEFAULT,
) -> Reviewed:
    """What both modes' webhooks first decide about a pod (see module docstring)."""
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    assert isinstance(spec, Mapping)
    chosen = spec.get("schedulerName")
    if chosen not in (None, "", scheduler_name) and chosen not in adopted:
        return Reviewed(None, Admission(True))
    try:
        request = parse_pod(pod, config)
    except RequestError as exc:
        return Reviewed(None, deny(exc.field, exc.message))
    if request is None:
        return Reviewed(None, Admission(True))
    return Reviewed(request, check_pod(pod, request, config, inventory))


def review_pod(
    pod: Mapping[str, Any],
    config: SchedulingConfig,
    scheduler_name: str,
    inventory: Callable[[], InventoryLimits],
    adopted: tuple[str, ...] = ADOPTED_BY_DEFAULT,
) -> Admission:
    """Allow, allow with a JSONPatch, or deny with the reason (see module docstring)."""
    reviewed = read_pod(pod, config, scheduler_name, inventory, adopted)
    if reviewed.verdict is not None or reviewed.request is None:
        return reviewed.verdict or Admission(True)
    spec = pod["spec"]
    patch: list[dict[str, Any]] = [
        {
            "op": "replace" if "schedulerName" in spec else "add",
            "path": "/spec/schedulerName",
            "value": scheduler_name,
        }
    ]
    patch += _default_gpu_count(spec, reviewed.request, config)
    return Admission(True, patch=patch)


def check_pod(
    pod: Mapping[str, Any],
    request: PodRequest,
    config: SchedulingConfig,
    inventory: Callable[[], InventoryLimits],
) -> Admission | None:
    """The denial of a GPU pod that could never run (in either mode), or None."""
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    assert isinstance(spec, Mapping)
    node_name = spec.get("nodeName")
    if node_name:
        return deny(
            "spec.nodeName",
            f"is preset to {node_name!r} on a pod that asks for GPU slices; the scheduler must "
            "choose the node and the cards. Remove spec.nodeName (use a nodeSelector or node "
            "affinity to constrain where it runs).",
        )
    denial = _check_containers(pod, spec, request, config)
    if denial is not None:
        return denial
    return _check_inventory(request, inventory())


def _check_containers(
    pod: Mapping[str, Any], spec: Mapping[str, Any], request: PodRequest, config: SchedulingConfig
) -> Admission | None:
    for c in request.containers:
        key = "initContainers" if c.init else "containers"
        raw = _containers(spec, c.init)[c.index]
        security = raw.get("securityContext") if isinstance(raw, Mapping) else None
        if isinstance(security, Mapping) and security.get("privileged") is True:
            return deny(
                f"spec.{key}[{c.index}].securityContext.privileged",
                f"container {c.name!r} asks for GPU slices and is privileged; a privileged "
                "container sees every GPU of the node, past its slice. Drop privileged: true.",
            )
    return None


def _check_inventory(request: PodRequest, limits: InventoryLimits) -> Admission | None:
    if limits.cards == 0:
        return None  # no node has reported yet: nothing to judge against; the pod waits
    for c in request.containers:
        key = "initContainers" if c.init else "containers"
        where = f"spec.{key}[{c.index}].resources"
        most = limits.max_card_memory_mib
        if request.memory_oversubscription:
            most = max(most, limits.max_oversubscribed_mib)
        if c.memory_mib is not None and c.memory_mib > most:
            spilling = (
                f", and {limits.max_oversubscribed_mib} MiB for a slice that may spill to the "
                "host (its factor x its memory, within its node's spill reserve)"
                if request.memory_oversubscription and limits.max_oversubscribed_mib
                else ""
            )
            return deny(
                where,
                f"container {c.name!r} asks for {c.memory_mib} MiB per GPU; the largest "
                f"registered card has {limits.max_card_memory_mib} MiB{spilling}, so it could "
                "never run. The value is in MiB per GPU.",
            )
        if c.gpus > limits.max_cards_per_node:
            return deny(
                where,
                f"container {c.name!r} asks for {c.gpus} GPUs; no node has more than "
                f"{limits.max_cards_per_node}, and a container's GPUs are on one node.",
            )
    return None


def _default_gpu_count(
    spec: Mapping[str, Any], request: PodRequest, config: SchedulingConfig
) -> list[dict[str, Any]]:
    """Add `<gpu resource>: "1"` to containers that gave only memory or cores, and `"N"` to one
    that asks for N instances of a MIG profile (`nvidia.com/mig-<profile>: N`, where Tessera
    serves those) so the kubelet asks Tessera's device plugin (limits, and requests when the
    container lists Tessera resources there, keeping requests == limits)."""
    gpu = config.resources.gpu
    managed = set(config.resources.all())
    ops: list[dict[str, Any]] = []
    for c in request.containers:
        key = "initContainers" if c.init else "containers"
        resources = _containers(spec, c.init)[c.index].get("resources") or {}
        limits = resources.get("limits") or {}
        requests = resources.get("requests") or {}
        if gpu in limits or gpu in requests:
            continue
        count = str(c.gpus)  # 1 unless the container named a MIG profile's count
        base = ("spec", key, c.index, "resources")
        if "resources" not in _containers(spec, c.init)[c.index]:
            ops.append({"op": "add", "path": _pointer(*base), "value": {}})
        for section, table in (("limits", limits), ("requests", requests)):
            asked = set(table)
            if section == "requests" and not (managed & asked or _mig_keys(asked)):
                continue
            if section in resources:
                ops.append({"op": "add", "path": _pointer(*base, section, gpu), "value": count})
            else:
                ops.append({"op": "add", "path": _pointer(*base, section), "value": {gpu: count}})
    return ops


def _mig_keys(names: set[str]) -> bool:
    return any(n.startswith(MIG_RESOURCE_PREFIX) for n in names)
