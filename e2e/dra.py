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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from e2e.harness import build_binaries
from e2e.ports import free_port
from e2e.processes import http_ok, probe_context
from nodeplugin.cards import Card
from nodeplugin.dra_slices import build_slices

if TYPE_CHECKING:
    from e2e.cluster import Cluster
    from e2e.objects import Api

FEATURE_GATES = {"DRAConsumableCapacity": True, "DRAPartitionableDevices": True}
CLAIM_CONTROLLER = "resourceclaim-controller"
RESOURCE_API = "/apis/resource.k8s.io/v1"
KWOK_MODEL = "NVIDIA A100-SXM4-80GB"


def feature_gates_flag() -> str:
    """The command-line form (kube-apiserver, kube-scheduler, kube-controller-manager); the
    kubelet takes :data:`FEATURE_GATES` as its configuration's ``featureGates``."""
    gates = ",".join(f"{k}={str(v).lower()}" for k, v in FEATURE_GATES.items())
    return f"--feature-gates={gates}"


def start_claim_controller(cluster: Cluster, binary: Path | None = None) -> None:
    """kube-controller-manager running the ResourceClaim controller only (component
    ``resourceclaim-controller``), as the admin; stopped with the cluster."""
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
