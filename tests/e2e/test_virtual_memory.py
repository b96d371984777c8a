"""Virtual device memory on the real cluster (docs/virtual-memory.md).

One kwok node of its own (pool "vmem") with one 10,000 MiB card. Its simulated node plugin reports
a host spill reserve of 10,000 MiB (of 64,000 MiB); an operator sets the card's factor to 2
through the REST API. Pods go through the real webhook, kube-scheduler and the extender; what each
got is read from the signed allocation record on the pod.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from e2e import objects
from e2e.cluster import Cluster

ALLOCATION = "tessera.io/allocation"
OPT_IN = "tessera.io/memory-oversubscription"
NODE = "gpu-e2e-vmem"
POOL = "vmem"
CARD = f"GPU-{NODE}-0"
CARD_MIB = 10000
SLOTS = 10

pytestmark = pytest.mark.usefixtures("gpu_nodes")


@pytest.fixture(scope="module")
def vmem_node(cluster: Cluster, core: Any, tessera: objects.Tessera) -> objects.Tessera:
    """The node, its card in the ledger with factor 2 and the node's spill reserve."""
    token = cluster.manage("createtoken", NODE, "--role", "node", "--label", "e2e").strip()
    node_api = tessera.with_token(token)
    core.create_node(objects.gpu_node(NODE, cards=1, slots=SLOTS, pool=POOL))
    report = objects.inventory(NODE, cards=1, memory_mib=CARD_MIB)
    # A reserve above the node's memory is refused and registers nothing.
    refused = node_api.report_inventory(
        NODE, {**report, "spill_reserve_mib": 70000, "host_memory_mib": 64000}
    )
    assert refused.status_code == 400 and "spill_reserve_mib" in refused.text, refused.text
    report.update(spill_reserve_mib=10000, host_memory_mib=64000)
    answer = node_api.report_inventory(NODE, report)
    assert answer.status_code == 201, answer.text
    set_factor = tessera.post(
        f"/api/v1/cards/{CARD}/memory-oversubscription", {"factor": "2", "reason": "e2e"}
    )
    assert set_factor.status_code == 200, set_factor.text
    assert set_factor.json()["memory_virtual_mib"] == 2 * CARD_MIB

    def ready() -> bool:
        node = core.read_node(NODE)
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

    objects.wait_for(ready, timeout=60, what=f"kwok to report {NODE} Ready")
    time.sleep(1.5)  # the extender's snapshot sees the card's factor before the first filter
    return node_api


def _device(pod: Any) -> dict[str, Any]:
    """The one device of the pod's one container, from the signed record bind wrote on it."""
    record = json.loads((pod.metadata.annotations or {})[ALLOCATION])
    return dict(record["containers"][0]["devices"][0])


def _pod(name: str, gpumem: int, opted: bool) -> dict[str, Any]:
    annotations = {OPT_IN: "true"} if opted else {}
    return objects.gpu_pod(name, pool=POOL, gpumem=gpumem, annotations=annotations)


def _why_not_here(tessera: objects.Tessera, namespace: str, name: str) -> str:
    """The filter's sentence for this test's node, once the pod's decision names it."""

    def reason() -> str | None:
        answer = tessera.why(namespace, name)
        body = answer.json() if answer.status_code == 200 else {}
        return (body.get("node_reasons") or {}).get(NODE)

    return str(objects.wait_for(reason, timeout=60, what=f"why {name} is not on {NODE}", every=1))


def test_opted_in_pods_share_a_card_past_its_memory_and_the_others_keep_theirs(
    core: Any, namespace: str, tessera: objects.Tessera, vmem_node: objects.Tessera
) -> None:
    names = ["over-0", "over-1", "over-2"]
    for name in names:  # 60 % of the card each
        core.create_namespaced_pod(namespace, _pod(name, 6000, opted=True))
    for name in names:
        device = _device(objects.wait_running(core, namespace, name, timeout=90))
        assert device == {"cores": 0, "memory_mib": 6000, "resident_mib": 3000, "uuid": CARD}

    card = tessera.get(f"/api/v1/cards/{CARD}/").json()
    assert (card["memory_allocated_mib"], card["memory_resident_allocated_mib"]) == (18000, 9000)

    # 50 % of the card without the opt-in: resident in full, and only 1,000 MiB of the card's
    # memory is not held by the resident parts.
    core.create_namespaced_pod(namespace, _pod("plain", 5000, opted=False))
    why = _why_not_here(tessera, namespace, "plain")
    assert "5000 MiB of resident memory" in why and "1000 MiB free" in why, why
    assert not core.read_namespaced_pod("plain", namespace).spec.node_name

    # Lowering the factor below what is bound is refused, with the figures, and changes nothing.
    lowered = tessera.post(f"/api/v1/cards/{CARD}/memory-oversubscription", {"factor": "1.5"})
    assert lowered.status_code == 409, lowered.text
    assert "18000 MiB" in lowered.text and "15000 MiB" in lowered.text, lowered.text
    after = tessera.get(f"/api/v1/cards/{CARD}/").json()
    assert (after["memory_oversubscription"], after["memory_oversubscription_own"]) == ("2", "2")
    assert after["memory_virtual_mib"] == 2 * CARD_MIB
    for name in names:
        assert _device(core.read_namespaced_pod(name, namespace))["resident_mib"] == 3000
    assert not core.read_namespaced_pod("plain", namespace).spec.node_name
