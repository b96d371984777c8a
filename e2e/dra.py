"""DRA mode in the harness (docs/dra.md, docs/e2e.md *DRA mode*): the gates, the claim
controller, and ResourceSlices for kwok nodes.

- :data:`FEATURE_GATES`: set on kube-apiserver and kube-scheduler by every harness run (and on
  the controller-manager and kubelet of DRA mode). Both are on by default in v1.37; set
  explicitly so that a pin where a default differs fails at start, rather than the API server
  silently storing Tessera's shared cards as exclusive devices.
- :func:`start_claim_controller`: kube-controller-manager with the ResourceClaim controller
  alone, which makes a pod's claims from its ResourceClaimTemplates and reserves them; the
  harness runs no controller-manager otherwise.
- :func:`kwok_slices` / :func:`publish_kwok_slices`: the ResourceSlices the node plugin would
  publish for a kwok node's cards, built by the plugin's own builder
  (:func:`nodeplugin.dra_slices.build_slices`), written in parallel (the benchmark publishes
  1,000 nodes x 8 cards).
- :func:`register_claim_webhook`: the chart's claim webhook (quotas on claims), pointed at the
  harness's control plane.
- :func:`apply_device_classes`, :func:`shared_claim_template`, :func:`with_claim_template`: the
  chart's DeviceClasses, and a pod asking a shared card's share through a template, as DRA
  users write it (the benchmark's set-up (e)).
- :func:`device_capacities` / :func:`over_allocated_claims`: the devices as the API server holds
  the published slices, and the devices that kube-scheduler's allocations (the claims'
  ``consumedCapacity``) put over their memory, compute or slots.
"""

from __future__ import annotations

import base64
import copy
import math
import secrets
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubernetes.utils import parse_quantity

from e2e.harness import build_binaries
from e2e.ports import free_port
from e2e.processes import http_ok, probe_context
from nodeplugin.cards import Card
from nodeplugin.dra_slices import DRIVER, build_slices

if TYPE_CHECKING:
    from e2e.cluster import Cluster
    from e2e.objects import Api

FEATURE_GATES = {"DRAConsumableCapacity": True, "DRAPartitionableDevices": True}
CLAIM_CONTROLLER = "resourceclaim-controller"
RESOURCE_API = "/apis/resource.k8s.io/v1"
WEBHOOK_API = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
KWOK_MODEL = "NVIDIA A100-SXM4-80GB"


def feature_gates_flag() -> str:
    """The command-line form (kube-apiserver, kube-scheduler, kube-controller-manager); the
    kubelet takes :data:`FEATURE_GATES` as its configuration's ``featureGates``."""
    gates = ",".join(f"{k}={str(v).lower()}" for k, v in FEATURE_GATES.items())
    return f"--feature-gates={gates}"


def start_claim_controller(
    cluster: Cluster, binary: Path | None = None, api_qps: int | None = None
) -> None:
    """kube-controller-manager running the ResourceClaim controller only (component
    ``resourceclaim-controller``), as the admin; stopped with the cluster.

    ``api_qps``: its client's requests per second (burst twice that); None keeps
    kube-controller-manager's own default (20/s, burst 30), which the controller's two requests
    per pod (the claim, the pod's claim status) turn into about 10 pods/s."""
    if binary is None:
        binary = build_binaries(("kube-controller-manager",))["kube-controller-manager"]
    kubeconfig = cluster.kubeconfig
    port = free_port(set(cluster.ports.values()))
    url = f"https://127.0.0.1:{port}/healthz"
    insecure = probe_context()  # its self-signed serving certificate
    cluster.start_component(
        CLAIM_CONTROLLER,
        [
            str(binary),
            f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            f"--controllers={CLAIM_CONTROLLER}",
            feature_gates_flag(),
            "--leader-elect=false",
            "--bind-address=127.0.0.1",
            f"--secure-port={port}",
            "--v=1",
            *(
                [f"--kube-api-qps={api_qps}", f"--kube-api-burst={2 * api_qps}"]
                if api_qps is not None
                else []
            ),
        ],
        probe=lambda: http_ok(url, insecure, lambda b: b"ok" in b),
        what=f"GET {url}",
    )


def kwok_cards(node: str, cards: int, memory_mib: int = 81920) -> list[Card]:
    """The cards of a kwok node, with UUIDs unique in the cluster."""
    return [
        Card(
            uuid=f"GPU-{node}-{i}",
            index=i,
            model=KWOK_MODEL,
            memory_mib=memory_mib,
            minor=i,
            numa_node=i * 2 // cards,
            pci_bus_id=f"00000000:{0x10 + i:02x}:00.0",
        )
        for i in range(cards)
    ]


def kwok_slices(
    node: str,
    *,
    cards: int = 8,
    memory_mib: int = 81920,
    slots: int = 10,
    modes: Mapping[str, str] | None = None,
    generation: int = 1,
) -> list[dict[str, object]]:
    """What the node plugin in DRA mode publishes for these cards (``modes`` by card index:
    ``shared`` when not named)."""
    card_list = kwok_cards(node, cards, memory_mib)
    by_uuid = {c.uuid: (modes or {}).get(str(c.index), "shared") for c in card_list}
    return build_slices(
        node, card_list, modes=by_uuid, health={}, slots=slots, generation=generation
    )


def publish_kwok_slices(
    api: Api,
    nodes: Iterable[str],
    *,
    cards: int = 8,
    memory_mib: int = 81920,
    slots: int = 10,
    workers: int = 16,
) -> int:
    """Create the slices of every node (``workers`` requests at once); returns how many."""
    bodies = [
        s
        for node in nodes
        for s in kwok_slices(node, cards=cards, memory_mib=memory_mib, slots=slots)
    ]

    def create(body: dict[str, object]) -> Any:
        return api.post(f"{RESOURCE_API}/resourceslices", body)

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(create, bodies))
    return len(bodies)


# --- what a DRA user writes, and what kube-scheduler allocated -------------------------------

CLAIM_REQUEST = "gpu"  # the request's name in the benchmark's templates (a container's claim)


def apply_device_classes(api: Api, docs: Iterable[Mapping[str, Any]]) -> list[str]:
    """Create the DeviceClasses among ``docs`` (the chart rendered with ``mode=dra``); returns
    their names. None among them is an error: DRA-mode claims name a class, and a cluster
    without Tessera's would leave every claim pending with no word from the harness."""
    names = []
    for doc in docs:
        if doc.get("kind") == "DeviceClass":
            api.post(f"{RESOURCE_API}/deviceclasses", dict(doc))
            names.append(str(doc["metadata"]["name"]))
    if not names:
        raise ValueError("the rendered chart has no DeviceClass: was it rendered with mode=dra?")
    return names


def register_claim_webhook(cluster: Cluster, api: Api, docs: Iterable[Mapping[str, Any]]) -> str:
    """Register the ValidatingWebhookConfiguration among ``docs`` (the chart rendered with
    ``mode=dra``: Tessera's quotas on claims and on pods naming claim templates), pointed at the
    harness's webhook listener instead of the chart's Service; returns its name, unique per call
    (delete it with :func:`unregister_claim_webhook`)."""
    configs = [d for d in docs if d.get("kind") == "ValidatingWebhookConfiguration"]
    if len(configs) != 1:
        raise ValueError(
            f"the rendered chart has {len(configs)} ValidatingWebhookConfigurations, not one: "
            "was it rendered with mode=dra?"
        )
    config = copy.deepcopy(dict(configs[0]))
    ca_bundle = base64.b64encode((cluster.pki / "ca.crt").read_bytes()).decode()
    for hook in config["webhooks"]:
        path = hook["clientConfig"]["service"]["path"]
        hook["clientConfig"] = {"url": cluster.webhook_url + path, "caBundle": ca_bundle}
    name = f"tessera-claims-{secrets.token_hex(4)}"
    config["metadata"] = {"name": name}
    api.post(WEBHOOK_API, config)
    return name


def unregister_claim_webhook(api: Api, name: str) -> None:
    api.delete(f"{WEBHOOK_API}/{name}")


def shared_claim_template(name: str, memory_mib: int, compute: int) -> dict[str, Any]:
    """A ResourceClaimTemplate asking one device of Tessera's shared class with this memory
    and compute (docs/dra.md, *A ResourceClaimTemplate*), as a DRA user writes it."""
    capacity = {"memory": f"{memory_mib}Mi", "compute": str(compute)}
    request = {"deviceClassName": DRIVER, "capacity": {"requests": capacity}}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": name},
        "spec": {"spec": {"devices": {"requests": [{"name": CLAIM_REQUEST, "exactly": request}]}}},
    }


def with_claim_template(pod: dict[str, Any], template: str) -> dict[str, Any]:
    """``pod`` (one container, no GPU resources of its own) pointed at the claim template: the
    pod's claim is made from it by the claim controller, and its container uses it."""
    pod["spec"]["resourceClaims"] = [{"name": CLAIM_REQUEST, "resourceClaimTemplateName": template}]
    for container in pod["spec"]["containers"]:
        container["resources"] = {"claims": [{"name": CLAIM_REQUEST}]}
    return pod


@dataclass(frozen=True)
class DeviceCapacity:
    """One shared device of a published slice: its card and what it may give out in all."""

    uuid: str
    memory_mib: int
    compute: int
    slots: int


def _mib(quantity: object) -> int:
    """A memory quantity ("1000Mi", "8Gi", bytes) in MiB, rounded up as the request policy's
    1Mi step rounds it."""
    return math.ceil(parse_quantity(str(quantity)) / 2**20)


def device_capacities(slices: Iterable[Mapping[str, Any]]) -> dict[tuple[str, str], DeviceCapacity]:
    """(pool, device name) -> capacity, for the devices of Tessera's driver in these
    ResourceSlices (as the API server lists them)."""
    found = {}
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("driver") != DRIVER:
            continue
        pool = spec["pool"]["name"]
        for device in spec.get("devices") or []:
            capacity = {k: v["value"] for k, v in (device.get("capacity") or {}).items()}
            attributes = device.get("attributes") or {}
            # A device that takes one allocation only (an exclusive card, a MIG placement) has
            # one slot, whatever it publishes.
            slots = capacity.get("slots", 1) if device.get("allowMultipleAllocations") else 1
            found[(pool, device["name"])] = DeviceCapacity(
                uuid=str((attributes.get("uuid") or {}).get("string", device["name"])),
                memory_mib=_mib(capacity.get("memory", 0)),
                compute=int(parse_quantity(str(capacity.get("compute", 100)))),
                slots=int(parse_quantity(str(slots))),
            )
    return found


def over_allocated_claims(
    claims: Iterable[Mapping[str, Any]], devices: Mapping[tuple[str, str], DeviceCapacity]
) -> tuple[int, list[str]]:
    """From kube-scheduler's own record, the claims' ``status.allocation``: how many devices
    the claims were given, and each device given more memory, compute or slots in all than its
    slice offers (``consumedCapacity`` summed over every result naming it), or not published at
    all. The check over allocations that the extender's set-ups make over pods' annotations."""
    totals: dict[tuple[str, str], list[int]] = {}
    for claim in claims:
        allocation = (claim.get("status") or {}).get("allocation") or {}
        for result in (allocation.get("devices") or {}).get("results") or []:
            if result.get("driver") != DRIVER:
                continue
            consumed = result.get("consumedCapacity") or {}
            total = totals.setdefault((result["pool"], result["device"]), [0, 0, 0])
            total[0] += _mib(consumed.get("memory", 0))
            total[1] += int(parse_quantity(str(consumed.get("compute", 0))))
            total[2] += int(parse_quantity(str(consumed.get("slots", 1))))
    over = []
    for (pool, name), (memory, compute, slots) in sorted(totals.items()):
        card = devices.get((pool, name))
        if card is None:
            over.append(f"{pool}/{name}: allocated, and in no published slice")
        elif memory > card.memory_mib or compute > card.compute or slots > card.slots:
            over.append(
                f"{card.uuid} ({pool}/{name}): {memory} MiB of {card.memory_mib}, "
                f"{compute}% of {card.compute}, {slots} slots of {card.slots}"
            )
    return len(totals), over
