"""Card modes on the real cluster: MIG, MPS and exclusive cards next to shared ones.

One kwok node of its own (pool "modes"), four A100-80GB cards that its simulated node plugin
reports MIG-capable: card 0 stays shared, card 1 is put in MIG mode, card 2 in MPS mode, card 3
exclusive, each through the REST API as an operator would (docs/card-modes.md). Pods go through
the real webhook, kube-scheduler and the extender; what each got is read from the signed
allocation record on the pod.
"""

from __future__ import annotations

import itertools
import json
import time
from typing import Any

import pytest

from e2e import objects
from e2e.cluster import Cluster
from tests.e2e.conftest import CARD_MEMORY_MIB

ALLOCATION = "tessera.io/allocation"
NODE = "gpu-e2e-modes"
POOL = "modes"
CARDS = 4
SLOTS = 10
MIG_1G_10GB_PLACEMENTS = 7  # an A100-80GB holds seven 1g.10gb instances (starts 0..6)

pytestmark = pytest.mark.usefixtures("gpu_nodes")


def _card(i: int) -> str:
    return f"GPU-{NODE}-{i}"


def _report(mig_enabled: bool) -> dict[str, Any]:
    report = objects.inventory(NODE, cards=CARDS, memory_mib=CARD_MEMORY_MIB)
    for card in report["cards"]:
        card["mig"] = {
            "capable": True,
            "enabled": mig_enabled and card["index"] == 1,
            "instances": [],
        }
    return report


@pytest.fixture(scope="module")
def modes_node(cluster: Cluster, core: Any, tessera: objects.Tessera) -> objects.Tessera:
    """The node, its cards in the ledger and in their modes; its own node identity's client."""
    token = cluster.manage("createtoken", NODE, "--role", "node", "--label", "e2e").strip()
    node_api = tessera.with_token(token)
    core.create_node(objects.gpu_node(NODE, cards=CARDS, slots=SLOTS, pool=POOL))
    answer = node_api.report_inventory(NODE, _report(mig_enabled=False))
    assert answer.status_code == 201, answer.text
    for index, mode in ((1, "mig"), (2, "mps"), (3, "exclusive")):
        changed = tessera.post(
            f"/api/v1/cards/{_card(index)}/mode", {"mode": mode, "reason": "e2e"}
        )
        assert changed.status_code == 200, changed.text
        assert changed.json()["mode"] == mode, changed.json()
    # The plugin turns MIG on once it hears the mode; its next report says so.
    answer = node_api.report_inventory(NODE, _report(mig_enabled=True))
    assert answer.status_code == 200, answer.text
    assert answer.json()["modes"] == {
        _card(0): "shared",
        _card(1): "mig",
        _card(2): "mps",
        _card(3): "exclusive",
    }

    def ready() -> bool:
        node = core.read_node(NODE)
        return any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])

    objects.wait_for(ready, timeout=60, what=f"kwok to report {NODE} Ready")
    # Let the extender's snapshot see the modes before the first pod is filtered.
    time.sleep(1.5)
    return node_api


def _device(pod: Any) -> dict[str, Any]:
    record = json.loads((pod.metadata.annotations or {})[ALLOCATION])
    [container] = record["containers"]
    [device] = container["devices"]
    return dict(device)


def _pod(name: str, *, mode: str | None = None, **kwargs: Any) -> dict[str, Any]:
    annotations = {"nvidia.com/vgpu-mode": mode} if mode else {}
    return objects.gpu_pod(name, pool=POOL, annotations=annotations, **kwargs)


def _pending_why(tessera: objects.Tessera, namespace: str, name: str) -> str:
    def answered() -> str | None:
        why = tessera.why(namespace, name)
        if why.status_code != 200:
            return None
        body = why.json()
        return None if body.get("outcome") != "unschedulable" else json.dumps(body)

    return str(objects.wait_for(answered, timeout=60, what=f"why {name} is pending", every=1))


def test_each_mode_takes_only_its_own_pods(
    core: Any, namespace: str, tessera: objects.Tessera, modes_node: objects.Tessera
) -> None:
    core.create_namespaced_pod(namespace, _pod("plain", gpumem=10000, gpucores=30))
    core.create_namespaced_pod(namespace, _pod("mig", mode="mig", gpumem=8000))
    core.create_namespaced_pod(namespace, _pod("mps", mode="mps", gpumem=4000, gpucores=25))

    plain = _device(objects.wait_running(core, namespace, "plain", timeout=90))
    assert plain["uuid"] == _card(0) and "mode" not in plain, plain

    mig = _device(objects.wait_running(core, namespace, "mig", timeout=90))
    assert (mig["uuid"], mig["mode"], mig["mig"]["profile"]) == (_card(1), "mig", "1g.10gb"), mig

    mps = _device(objects.wait_running(core, namespace, "mps", timeout=90))
    assert (mps["uuid"], mps["mode"], mps["memory_mib"], mps["cores"]) == (
        _card(2),
        "mps",
        4000,
        25,
    ), mps

    # The whole-card pod comes once the shared card holds a slice: only the exclusive card is
    # left for it.
    # No memory size: the whole card's (HAMi's default), and all of its compute.
    core.create_namespaced_pod(namespace, _pod("whole", gpucores=100))
    whole = _device(objects.wait_running(core, namespace, "whole", timeout=90))
    assert (whole["uuid"], whole["mode"]) == (_card(3), "exclusive"), whole


def _mig_placements(core: Any) -> list[tuple[int, int]]:
    """(start, size) of every MIG instance the node's pods hold, sorted."""
    found = []
    for pod in core.list_pod_for_all_namespaces().items:
        if pod.spec.node_name == NODE and (pod.metadata.annotations or {}).get(ALLOCATION):
            device = _device(pod)
            if device.get("mode") == "mig":
                found.append((device["mig"]["start"], device["mig"]["size"]))
    return sorted(found)


def test_mig_instances_never_overlap_and_a_full_card_says_why(
    core: Any, namespace: str, tessera: objects.Tessera, modes_node: objects.Tessera
) -> None:
    # The first test's MIG pod may still hold one placement: fill what is left.
    names = [f"mig-{i}" for i in range(MIG_1G_10GB_PLACEMENTS - len(_mig_placements(core)))]
    for name in names:
        core.create_namespaced_pod(namespace, _pod(name, mode="mig", gpumem=9000))
    for name in names:
        objects.wait_running(core, namespace, name, timeout=90)
    placements = _mig_placements(core)
    assert len(placements) == MIG_1G_10GB_PLACEMENTS, placements
    for (a, size), (b, _) in itertools.pairwise(placements):
        assert a + size <= b, f"overlapping MIG placements: {placements}"

    core.create_namespaced_pod(namespace, _pod("one-too-many", mode="mig", gpumem=9000))
    why = _pending_why(tessera, namespace, "one-too-many")
    assert "MIG" in why, why
    assert not core.read_namespaced_pod("one-too-many", namespace).spec.node_name


def test_a_mode_change_waits_for_the_card_to_drain(
    core: Any, namespace: str, tessera: objects.Tessera, modes_node: objects.Tessera
) -> None:
    card = _card(2)
    core.create_namespaced_pod(namespace, _pod("holder", mode="mps", gpumem=2000, gpucores=10))
    assert _device(objects.wait_running(core, namespace, "holder", timeout=90))["uuid"] == card

    asked = tessera.post(f"/api/v1/cards/{card}/mode", {"mode": "shared", "reason": "e2e drain"})
    assert asked.status_code == 200, asked.text
    body = asked.json()
    assert (body["mode"], body["pending_mode"]) == ("mps", "shared"), body

    # Draining: no new MPS slice goes there.
    time.sleep(1.5)
    core.create_namespaced_pod(namespace, _pod("late", mode="mps", gpumem=2000, gpucores=10))
    assert "drain" in _pending_why(tessera, namespace, "late")

    # Every MPS pod on the card ends (the first test's too): the change applies.
    for pod in core.list_pod_for_all_namespaces().items:
        held = pod.spec.node_name == NODE and (pod.metadata.annotations or {}).get(ALLOCATION)
        if held and _device(pod)["uuid"] == card:
            core.delete_namespaced_pod(
                pod.metadata.name, pod.metadata.namespace, grace_period_seconds=0
            )

    def applied() -> dict[str, Any] | None:
        got = tessera.get(f"/api/v1/cards/{card}/").json()
        return got if got["mode"] == "shared" and not got["pending_mode"] else None

    objects.wait_for(applied, timeout=150, what="the drained card to become shared", every=1)
    core.delete_namespaced_pod("late", namespace, grace_period_seconds=0)
