"""A pod written for HAMi, as DRA mode runs it: ResourceClaimTemplates and the pod's patch.

Pure: no database, no API server. The admission webhook (`dra_admission`) calls
:func:`translate` in DRA mode (`TESSERA_MODE=dra`) with the pod and its parsed
:class:`~controlplane.scheduling.PodRequest`, creates the templates, and sends the patch.

What it builds (docs/dra.md, *HAMi pods in DRA mode*):

- one ResourceClaimTemplate per GPU container, with one request named after the container:
  `count` devices of Tessera's class for the pod's card modes, `capacity.requests` memory
  (MiB) and compute (percent) for shared and MPS cards, CEL selectors for the card type and
  UUID annotations, `distinctAttribute` on the card UUID for several GPUs and `matchAttribute`
  on the NUMA node for `nvidia.com/numa-bind`. A memory percentage becomes one alternative
  (`firstAvailable`) per size of the cluster's shared cards, that percent of the size in MiB
  on cards of exactly that size. One claim per container, not one per pod: the
  node plugin refuses two results of one claim on the same card (a container sees each card
  once), while two containers of a HAMi pod may share a card; two claims may.
- the template's name is a digest of its spec (`tessera-hami-<digest>`), so every pod of the
  same shape in a namespace shares it and the same name always means the same spec: the
  webhook checks a template it finds against the spec it expects (:func:`same_spec`).
- the patch: the HAMi resources removed from the container's limits and requests, a
  `spec.resourceClaims` entry per container pointing at its template (the claim controller
  then makes each pod its own claims, owned by the pod: a pod's UID is not known at mutating
  admission, so the webhook cannot make them itself), and the container's
  `resources.claims` naming its request.

What a claim cannot say is refused with a sentence naming the field (:class:`RequestError`);
what only orders the placements a pod may take (binpack/spread, the NUMA sort key,
topology-aware) is accepted and answered as a warning: kube-scheduler scores DRA allocations
itself.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controlplane.scheduling import PodRequest, RequestError, SchedulingConfig
from controlplane.scheduling.config import MUTEX, NUMA
from controlplane.scheduling.quantity import parse_quantity
from controlplane.scheduling.request import (
    ANN_GPU_POLICY,
    ANN_HAMI_GPU_POLICY,
    ANN_HAMI_NODE_POLICY,
    ANN_MEMORY_OVERSUBSCRIPTION,
    ANN_NODE_POLICY,
    ContainerRequest,
)

#: The DRA driver of Tessera's node plugin (nodeplugin/dra_slices.py, `DRIVER`).
DRIVER = "gpu.tessera.io"
#: HAMi's card mode (`nvidia.com/vgpu-mode`) -> the chart's DeviceClass serving it.
DEVICE_CLASSES: dict[str, str] = {
    "hami-core": DRIVER,
    "mps": f"mps.{DRIVER}",
    "mig": f"mig.{DRIVER}",
}
TEMPLATE_PREFIX = "tessera-hami-"
#: Prefix of the pod's `spec.resourceClaims` entries the webhook adds.
POD_CLAIM_PREFIX = "tessera-gpu-"
RESOURCE_API = "resource.k8s.io/v1"
TOPOLOGY_AWARE = "topology-aware"

_ATTR = f'device.attributes["{DRIVER}"]'
_CAPACITY = f'device.capacity["{DRIVER}"]'
_NUMA_ATTRIBUTE = "resource.kubernetes.io/numaNode"


@dataclass(frozen=True, slots=True)
class ClaimTemplate:
    """One ResourceClaimTemplate the pod needs: its name and its `spec` (the template's
    `spec`, whose own `spec` is the claim's)."""

    name: str
    spec: dict[str, Any]

    def manifest(self, namespace: str) -> dict[str, Any]:
        return {
            "apiVersion": RESOURCE_API,
            "kind": "ResourceClaimTemplate",
            "metadata": {
                "name": self.name,
                "namespace": namespace,
                "labels": {"app.kubernetes.io/managed-by": "tessera"},
            },
            "spec": copy.deepcopy(self.spec),
        }


@dataclass(frozen=True, slots=True)
class Translation:
    templates: tuple[ClaimTemplate, ...]
    patch: list[dict[str, Any]]
    warnings: tuple[str, ...]


def pointer(*parts: str | int) -> str:
    """A JSON Pointer (RFC 6901): '~' and '/' inside a key are escaped."""
    return "".join("/" + str(p).replace("~", "~0").replace("/", "~1") for p in parts)


def _cel_list(values: tuple[str, ...] | frozenset[str]) -> str:
    # A JSON string is a valid CEL string literal (same quotes and escapes).
    return "[" + ", ".join(json.dumps(v) for v in sorted(values)) + "]"


def _selectors(request: PodRequest, whole: bool, mode: str) -> list[dict[str, Any]]:
    """CEL selectors for the pod's card annotations (the same matching as the extender:
    case-insensitive substring of the model, exact UUID in any case), and for a slice that is
    less than a card, shared cards only (an exclusive card takes only whole-card slices)."""
    expressions: list[str] = []
    model = f"{_ATTR}.model.lowerAscii()"
    if request.use_types:
        expressions.append(
            " || ".join(f"{model}.contains({json.dumps(t)})" for t in request.use_types)
        )
    if request.nouse_types:
        either = " || ".join(f"{model}.contains({json.dumps(t)})" for t in request.nouse_types)
        expressions.append(f"!({either})")
    uuid = f"{_ATTR}.uuid.lowerAscii()"
    if request.use_uuids:
        expressions.append(f"{uuid} in {_cel_list(request.use_uuids)}")
    if request.nouse_uuids:
        expressions.append(f"!({uuid} in {_cel_list(request.nouse_uuids)})")
    if mode == "hami-core" and not whole:
        expressions.append(f'{_ATTR}.mode == "shared"')
    return [{"cel": {"expression": e}} for e in expressions]


def _whole(c: ContainerRequest) -> bool:
    """The slice is the whole card's memory: nothing else fits beside it."""
    return c.memory_mib is None and c.memory_percent in (None, 100)


def _exact(
    c: ContainerRequest, request: PodRequest, mode: str, card_mib: int | None = None
) -> dict[str, Any]:
    """One mode's device request for container ``c`` (for a memory percentage: on cards of
    ``card_mib``), every default of the API server written out (so a stored template compares
    equal to it)."""
    exact: dict[str, Any] = {
        "deviceClassName": DEVICE_CLASSES[mode],
        "allocationMode": "ExactCount",
        "count": c.gpus,
    }
    selectors = _selectors(request, _whole(c), mode)
    if mode == "mig":
        # A MIG placement's memory is fixed and it is allocated whole: the ask picks the
        # placements large enough, never a share of one.
        if c.memory_mib is not None:
            at_least = f'{_CAPACITY}.memory.compareTo(quantity("{c.memory_mib}Mi")) >= 0'
            selectors.append({"cel": {"expression": at_least}})
    else:
        amounts: dict[str, str] = {}
        if c.memory_mib is not None:
            amounts["memory"] = f"{c.memory_mib}Mi"
        elif card_mib is not None and c.memory_percent is not None:
            # HAMi's rule: the percent of the chosen card, rounded down to whole MiB.
            amounts["memory"] = f"{max(1, card_mib * c.memory_percent // 100)}Mi"
            size = f'{_CAPACITY}.memory.compareTo(quantity("{card_mib}Mi")) == 0'
            selectors.append({"cel": {"expression": size}})
        if c.cores:
            amounts["compute"] = str(c.cores)
        if amounts:
            exact["capacity"] = {"requests": amounts}
    if selectors:
        exact["selectors"] = selectors
    return exact


#: Most subrequests of a `firstAvailable` list (resource.k8s.io/v1).
MAX_SUBREQUESTS = 8


def _refuse_container(
    c: ContainerRequest,
    path: str,
    config: SchedulingConfig,
    modes: tuple[str, ...],
    card_sizes: tuple[int, ...],
) -> None:
    names = config.resources
    where = f"{path}.resources"
    if c.mig_profile:
        raise RequestError(
            f"{where}.limits.nvidia.com/mig-{c.mig_profile}",
            "NVIDIA's per-profile MIG resources are served in extender mode only; in DRA mode "
            "ask for MIG with the annotation nvidia.com/vgpu-mode: mig and "
            f"{names.gpumem} (a placement at least that large), or write a claim of DeviceClass "
            f"{DEVICE_CLASSES['mig']}",
        )
    if c.memory_percent not in (None, 100):
        field_path = f"{where}.limits.{names.gpumem_percentage}"
        if "mig" in modes:
            raise RequestError(
                field_path,
                f"is {c.memory_percent} on a pod that accepts MIG cards; a MIG placement is "
                f"allocated whole, so ask {names.gpumem} in MiB (a placement at least that large)",
            )
        if not card_sizes:
            raise RequestError(
                field_path,
                f"is {c.memory_percent}, but no shared card is registered yet, and a claim asks "
                f"memory in bytes per card size. Ask {names.gpumem} in MiB, or create the pod "
                "once the nodes have reported their cards",
            )
        if len(card_sizes) * len(modes) > MAX_SUBREQUESTS:
            raise RequestError(
                field_path,
                f"is {c.memory_percent}: a claim turns a percentage into one alternative per "
                f"card size, at most {MAX_SUBREQUESTS}, and this cluster has "
                f"{len(card_sizes)} sizes of shared cards. Ask {names.gpumem} in MiB instead",
            )
    if c.priority is not None:
        raise RequestError(
            f"{where}.limits.{names.priority}",
            "a ResourceClaim carries no task priority, so the node plugin could not enforce it "
            "in DRA mode; remove it, or run Tessera in extender mode for task priorities",
        )


def _refuse_pod(request: PodRequest, annotations: Mapping[str, Any]) -> None:
    words = request.gpu_policy.split(",")
    if MUTEX in words:
        key = ANN_GPU_POLICY if ANN_GPU_POLICY in annotations else ANN_HAMI_GPU_POLICY
        raise RequestError(
            f"metadata.annotations.{key}",
            "asks for mutex (only cards no other pod holds a slice on); a ResourceClaim cannot "
            "ask for a card nobody shares in DRA mode. Ask for the whole card (no "
            "nvidia.com/gpumem, or nvidia.com/gpumem-percentage: 100) or drop mutex",
        )
    if request.memory_oversubscription:
        raise RequestError(
            f"metadata.annotations.{ANN_MEMORY_OVERSUBSCRIPTION}",
            "is true, but virtual device memory is booked by the extender (a slice's resident "
            "part on the card, the node's spill reserve), which DRA mode does not run; remove "
            "the annotation or run Tessera in extender mode",
        )


def _warnings(request: PodRequest, annotations: Mapping[str, Any]) -> tuple[str, ...]:
    out: list[str] = []
    for key in (ANN_NODE_POLICY, ANN_HAMI_NODE_POLICY, ANN_GPU_POLICY, ANN_HAMI_GPU_POLICY):
        if key in annotations:
            out.append(
                f"{key}={annotations[key]!r} is not applied in DRA mode: kube-scheduler scores "
                "nodes and devices for ResourceClaims itself"
            )
    words = request.gpu_policy.split(",")
    if (NUMA in words or TOPOLOGY_AWARE in words) and not out:
        out.append("the GPU policy's NUMA and topology order is not applied in DRA mode")
    if any(c.init and not c.sidecar for c in request.containers):
        out.append(
            "an init container's GPU claim is held for the pod's whole life in DRA mode (a "
            "ResourceClaim is the pod's), not only during its own step"
        )
    return tuple(out)


def _digest(spec: Mapping[str, Any]) -> str:
    text = json.dumps(spec, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _modes(request: PodRequest) -> tuple[str, ...]:
    return request.vgpu_modes or ("hami-core",)


def claim_spec(
    c: ContainerRequest, request: PodRequest, card_sizes: tuple[int, ...] = ()
) -> dict[str, Any]:
    """The claim a template makes for container ``c``: one request named after the container
    (a DNS label, as a request name must be), of the first card mode the pod accepts that has
    a free card, and for a memory percentage of the first card size (``card_sizes``, MiB) that
    has room: `firstAvailable` when there is more than one such alternative."""
    options: list[tuple[str, dict[str, Any]]] = []
    for mode in _modes(request):
        label = "shared" if mode == "hami-core" else mode
        if c.memory_percent in (None, 100):
            options.append((label, _exact(c, request, mode)))
        else:
            options += [(f"{label}-{mib}mi", _exact(c, request, mode, mib)) for mib in card_sizes]
    if len(options) == 1:
        device_request: dict[str, Any] = {"name": c.name, "exactly": options[0][1]}
    else:
        device_request = {
            "name": c.name,
            "firstAvailable": [{"name": name, **exact} for name, exact in options],
        }
    constraints: list[dict[str, Any]] = []
    if c.gpus > 1:
        # A container sees each card once: its devices are distinct cards.
        constraints.append({"requests": [c.name], "distinctAttribute": f"{DRIVER}/uuid"})
        if request.numa_bind:
            constraints.append({"requests": [c.name], "matchAttribute": _NUMA_ATTRIBUTE})
    devices: dict[str, Any] = {"requests": [device_request]}
    if constraints:
        devices["constraints"] = constraints
    return {"spec": {"devices": devices}}


def template_for(
    c: ContainerRequest, request: PodRequest, card_sizes: tuple[int, ...] = ()
) -> ClaimTemplate:
    spec = claim_spec(c, request, card_sizes)
    return ClaimTemplate(f"{TEMPLATE_PREFIX}{_digest(spec)}", spec)


def pod_claim_name(c: ContainerRequest) -> str:
    """The pod's `spec.resourceClaims` entry for container ``c``: unique in the pod (an init
    and an app container may share an index)."""
    return f"{POD_CLAIM_PREFIX}{'init-' if c.init else ''}{c.index}"


def translate(
    pod: Mapping[str, Any],
    request: PodRequest,
    config: SchedulingConfig,
    card_sizes: tuple[int, ...] = (),
) -> Translation:
    """The templates and the JSON patch that make ``pod`` (parsed as ``request``) ask its GPUs
    through ResourceClaims; RequestError names the field a claim cannot carry. ``card_sizes``:
    the memory sizes (MiB) of the cluster's shared and MPS cards, for memory percentages."""
    metadata = pod.get("metadata") if isinstance(pod.get("metadata"), Mapping) else {}
    assert isinstance(metadata, Mapping)
    annotations = metadata.get("annotations") or {}
    spec = pod.get("spec") if isinstance(pod.get("spec"), Mapping) else {}
    assert isinstance(spec, Mapping)
    _refuse_pod(request, annotations)
    existing = spec.get("resourceClaims") or []
    if not isinstance(existing, list):
        raise RequestError("spec.resourceClaims", "must be a list")
    taken = {e.get("name") for e in existing if isinstance(e, Mapping)}

    managed = set(config.resources.all())
    templates: dict[str, ClaimTemplate] = {}
    patch: list[dict[str, Any]] = []
    entries: list[dict[str, Any]] = []
    for c in request.containers:
        key = "initContainers" if c.init else "containers"
        path = f"spec.{key}[{c.index}]"
        _refuse_container(c, path, config, _modes(request), card_sizes)
        name = pod_claim_name(c)
        if name in taken:
            raise RequestError(
                "spec.resourceClaims",
                f"already names a claim {name!r}, the name Tessera gives container {c.name!r}'s "
                "GPU claim; rename that entry",
            )
        template = template_for(c, request, card_sizes)
        templates[template.name] = template
        entries.append({"name": name, "resourceClaimTemplateName": template.name})
        raw = spec[key][c.index]
        resources = copy.deepcopy(raw.get("resources") or {})
        for section in ("limits", "requests"):
            table = {k: v for k, v in (resources.get(section) or {}).items() if k not in managed}
            if table:
                resources[section] = table
            else:
                resources.pop(section, None)
        resources["claims"] = [*(resources.get("claims") or []), {"name": name, "request": c.name}]
        op = "replace" if "resources" in raw else "add"
        patch.append(
            {"op": op, "path": pointer("spec", key, c.index, "resources"), "value": resources}
        )

    if existing:
        patch += [{"op": "add", "path": "/spec/resourceClaims/-", "value": e} for e in entries]
    else:
        patch.append({"op": "add", "path": "/spec/resourceClaims", "value": entries})
    return Translation(tuple(templates.values()), patch, _warnings(request, annotations))


# --------------------------------------------------------------------------- comparing


def _normal(value: Any, key: str = "") -> Any:
    """A template spec in a form two equal specs share: empty values dropped, the API server's
    defaults (`allocationMode: ExactCount`, `count: 1`) filled in, and capacity amounts as
    numbers (the API server writes `4096Mi` back as `4Gi`)."""
    if isinstance(value, Mapping):
        out = {k: _normal(v, k) for k, v in value.items() if v not in (None, {}, [], "")}
        if key in ("exactly",) or (key == "firstAvailable" and "deviceClassName" in out):
            out.setdefault("allocationMode", "ExactCount")
            if out["allocationMode"] == "ExactCount":
                out.setdefault("count", 1)
        if key == "requests" and all(isinstance(v, str | int) for v in out.values()):
            try:
                return {k: parse_quantity(v) for k, v in out.items()}
            except ValueError:
                return out
        return out
    if isinstance(value, list):
        return [_normal(v, key) for v in value]
    return value


def same_spec(stored: Mapping[str, Any], expected: Mapping[str, Any]) -> bool:
    """Whether a template found in the cluster has exactly the spec the webhook would write:
    anything more (another class, a toleration, admin access, looser selectors) is refused."""
    return bool(_normal(dict(stored)) == _normal(dict(expected)))
