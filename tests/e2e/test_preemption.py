"""Preemption for GPU room on the real cluster (docs/preemption.md).

Two nodes of their own (pool "preempt"), each with one 80 GiB card; four low-priority pods of
40,000 MiB fill both cards. A high-priority pod of 60,000 MiB fits only where both pods of one
card go: Tessera evicts exactly those two through the Eviction API, holds the room, and the pod
is bound within 30 s of its creation, on that card, while the other card's pods run on untouched
and no card is ever over-allocated. A PodDisruptionBudget over every low pod, or
`preemptionPolicy: Never`, leaves the pod pending with a why that says so.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from e2e import objects
from tests.e2e.conftest import CARD_MEMORY_MIB

POOL = "preempt"
NODES = ("gpu-e2e-preempt-0", "gpu-e2e-preempt-1")
LOW, HIGH = "tessera-e2e-low", "tessera-e2e-high"
POLITE = "tessera-e2e-high-never"  # high, with preemptionPolicy Never (set by its class)
ALLOCATION = "tessera.io/allocation"

pytestmark = pytest.mark.usefixtures("gpu_nodes")


@pytest.fixture(scope="module")
def preempt_nodes(cluster: Any, core: Any, kube: Any, tessera: objects.Tessera) -> None:
    from kubernetes import client

    scheduling = client.SchedulingV1Api(kube)
    for name, value, policy in (
        (LOW, 10, "PreemptLowerPriority"),
        (HIGH, 100000, "PreemptLowerPriority"),
        (POLITE, 100000, "Never"),
    ):
        scheduling.create_priority_class(
            {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
             "metadata": {"name": name}, "value": value, "preemptionPolicy": policy}
        )  # fmt: skip
    for node in NODES:
        token = cluster.manage("createtoken", node, "--role", "node", "--label", "e2e").strip()
        core.create_node(objects.gpu_node(node, cards=1, slots=10, pool=POOL))
        answer = tessera.with_token(token).report_inventory(
            node, objects.inventory(node, cards=1, memory_mib=CARD_MEMORY_MIB)
        )
        assert answer.status_code == 201, answer.text

    def ready() -> bool:
        return all(
            any(c.type == "Ready" and c.status == "True" for c in
                core.read_node(n).status.conditions or [])
            for n in NODES
        )  # fmt: skip

    objects.wait_for(ready, timeout=60, what="kwok to report the preemption nodes Ready")
    # Let the extender's snapshot see the new nodes: a pod filtered before would find one "not
    # registered with Tessera", which kube-scheduler does not retry until some later event.
    time.sleep(1.5)


def _pod(name: str, mem: int, priority_class: str, **spec: Any) -> dict[str, Any]:
    pod = objects.gpu_pod(name, gpumem=mem, pool=POOL, labels={"tier": priority_class})
    pod["spec"]["priorityClassName"] = priority_class
    pod["spec"].update(spec)
    return pod


def _fill(core: Any, namespace: str) -> dict[str, tuple[str, str]]:
    """Four low pods, two per card; name -> (uid, node)."""
    for i in range(4):
        core.create_namespaced_pod(namespace, _pod(f"low-{i}", 40000, LOW))
    placed = {}
    for i in range(4):
        pod = objects.wait_running(core, namespace, f"low-{i}")
        placed[pod.metadata.name] = (pod.metadata.uid, pod.spec.node_name)
    per_node = sorted(n for _, n in placed.values())
    assert per_node == sorted([*NODES, *NODES]), placed
    return placed


class OverAllocation(threading.Thread):
    """Samples the cards' allocation through the REST API until stopped."""

    def __init__(self, tessera: objects.Tessera) -> None:
        super().__init__(daemon=True)
        self.tessera, self.stop, self.seen, self.samples = tessera, threading.Event(), [], 0

    def run(self) -> None:
        while not self.stop.is_set():
            for node in NODES:
                for card in self.tessera.get("/api/v1/cards/", params={"node": node}).json()[
                    "results"
                ]:
                    if card["memory_allocated_mib"] > card["memory_mib"]:
                        self.seen.append(card)
            self.samples += 1
            time.sleep(0.2)


def _allocated(tessera: objects.Tessera) -> int:
    return sum(
        card["memory_allocated_mib"]
        for node in NODES
        for card in tessera.get("/api/v1/cards/", params={"node": node}).json()["results"]
    )


def _cleanup(core: Any, namespace: str, tessera: objects.Tessera) -> None:
    """Delete the test's pods and wait until Tessera has freed their slices, so that the next
    test's pods find the cards empty (kube-scheduler would not retry a pod turned away for
    want of room until some later cluster event)."""
    for pod in core.list_namespaced_pod(namespace).items:
        core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
    objects.wait_for(
        lambda: _allocated(tessera) == 0,
        timeout=90,
        what="the preemption nodes to be empty",
        every=1,
    )
    time.sleep(1.5)  # the filter's snapshot


def test_a_high_priority_pod_evicts_exactly_the_fewest_low_ones(
    core: Any, namespace: str, tessera: objects.Tessera, preempt_nodes: None
) -> None:
    placed = _fill(core, namespace)
    sampler = OverAllocation(tessera)
    sampler.start()
    try:
        created = time.monotonic()
        core.create_namespaced_pod(namespace, _pod("urgent", 60000, HIGH))
        urgent = objects.wait_running(core, namespace, "urgent", timeout=60)
        took = time.monotonic() - created
    finally:
        sampler.stop.set()
        sampler.join()
    node = urgent.spec.node_name
    victims = {name for name, (_, where) in placed.items() if where == node}
    survivors = set(placed) - victims
    left = {p.metadata.name: p.metadata.uid for p in core.list_namespaced_pod(namespace).items}
    assert victims.isdisjoint(left), (victims, left)
    for name in survivors:
        assert left.get(name) == placed[name][0], f"{name} was disturbed"
    assert took <= 30, f"bound {took:.1f} s after creation"
    assert sampler.samples > 0 and not sampler.seen, sampler.seen[:3]
    events = core.list_namespaced_event(namespace).items
    preempted = {e.involved_object.name for e in events if e.reason == "Preempted"}
    assert preempted == victims
    _cleanup(core, namespace, tessera)


def test_preemption_policy_never_evicts_nothing(
    core: Any, namespace: str, tessera: objects.Tessera, preempt_nodes: None
) -> None:
    placed = _fill(core, namespace)
    core.create_namespaced_pod(namespace, _pod("polite", 60000, POLITE))
    time.sleep(10)
    left = {p.metadata.name: p.metadata.uid for p in core.list_namespaced_pod(namespace).items}
    assert all(left.get(n) == uid for n, (uid, _) in placed.items()), left
    assert not core.read_namespaced_pod("polite", namespace).spec.node_name
    _cleanup(core, namespace, tessera)


def test_a_disruption_budget_that_forbids_it_leaves_the_pod_pending_and_says_why(
    core: Any, kube: Any, namespace: str, tessera: objects.Tessera, preempt_nodes: None
) -> None:
    from kubernetes import client

    placed = _fill(core, namespace)
    client.PolicyV1Api(kube).create_namespaced_pod_disruption_budget(
        namespace,
        {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
         "metadata": {"name": "keep-low"},
         "spec": {"maxUnavailable": 0, "selector": {"matchLabels": {"tier": LOW}}}},
    )  # fmt: skip
    core.create_namespaced_pod(namespace, _pod("blocked", 60000, HIGH))

    def said() -> str | None:
        answer = tessera.why(namespace, "blocked")
        text = answer.json().get("summary", "") if answer.status_code == 200 else ""
        return text if "PodDisruptionBudget" in text else None

    text = objects.wait_for(said, timeout=60, what="why to name the disruption budget", every=1)
    assert f"{namespace}/keep-low" in text
    left = {p.metadata.name: p.metadata.uid for p in core.list_namespaced_pod(namespace).items}
    assert all(left.get(n) == uid for n, (uid, _) in placed.items()), left
    _cleanup(core, namespace, tessera)
