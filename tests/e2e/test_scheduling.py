"""GPU pods through the real API server, webhook, kube-scheduler and Tessera's extender.

Written against DESIGN §3-§4 and docs/allocation.md: the webhook sets `schedulerName:
tessera-scheduler`; kube-scheduler asks the extender to filter, prioritize and bind; bind writes
`tessera.io/allocation` (+ signature) on the pod through the Binding subresource; kwok then runs
the pod. What cannot fit stays Pending and the control plane says why.
"""

from __future__ import annotations

import json
import re
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from e2e import objects
from e2e.cluster import Cluster
from tests.e2e.conftest import (
    CARD_MEMORY_MIB,
    NODES,
    RELEASE_NODE,
    SLOTS_PER_CARD,
)

ALLOCATION = "tessera.io/allocation"
SIGNATURE = "tessera.io/allocation-signature"

pytestmark = pytest.mark.usefixtures("gpu_nodes")


def _pod(core: Any, namespace: str, name: str) -> Any:
    return core.read_namespaced_pod(name, namespace)


def _allocation(pod: Any) -> dict[str, Any]:
    annotations = pod.metadata.annotations or {}
    assert ALLOCATION in annotations, f"no {ALLOCATION} on {pod.metadata.name}: {annotations}"
    assert annotations.get(SIGNATURE, "").startswith("v1:"), annotations
    return dict(json.loads(annotations[ALLOCATION]))


def _devices(allocation: dict[str, Any]) -> list[dict[str, Any]]:
    return [d for c in allocation["containers"] for d in c["devices"]]


def _unschedulable(core: Any, namespace: str, name: str) -> Any:
    pod = _pod(core, namespace, name)
    for condition in pod.status.conditions or []:
        if condition.type == "PodScheduled" and condition.status == "False":
            return condition
    return None


def test_a_slice_pod_is_admitted_scheduled_bound_and_runs(
    core: Any,
    namespace: str,
    tessera: objects.Tessera,
    node_tokens: dict[str, str],
    cluster: Cluster,
) -> None:
    core.create_namespaced_pod(namespace, objects.gpu_pod("trainer", gpumem=10000, gpucores=30))
    pod = objects.wait_running(core, namespace, "trainer")

    # Set by the admission webhook: tessera-scheduler, or the chart's scheduler.name.
    assert pod.spec.scheduler_name == cluster.scheduler_name
    allocation = _allocation(pod)
    assert allocation["v"] == 1
    assert allocation["node"] == pod.spec.node_name in NODES
    assert (allocation["namespace"], allocation["name"]) == (namespace, "trainer")
    assert allocation["pod_uid"] == pod.metadata.uid
    [container] = allocation["containers"]
    assert (container["name"], container["index"], container["init"]) == ("app", 0, False)
    [device] = container["devices"]
    assert device["memory_mib"] == 10000 and device["cores"] == 30
    assert device["uuid"].startswith(f"GPU-{pod.spec.node_name}-")

    # `kubectl describe pod` tells what the pod got: an event from the extender's bind.
    def allocated() -> list[Any]:
        listed = core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.uid={pod.metadata.uid}"
        ).items
        return [e for e in listed if e.reason == "Allocated"]

    [event] = objects.wait_for(allocated, timeout=30, what="the pod's Allocated event")
    assert (event.type, event.source.component) == ("Normal", "tessera-extender")
    assert event.involved_object.kind == "Pod" and event.involved_object.name == "trainer"
    said = re.fullmatch(r"node (\S+): app: card \d+ (\S+) 10000 MiB 30% compute", event.message)
    assert said and said.groups() == (pod.spec.node_name, device["uuid"]), event.message

    # The node plugin's view of the same record, with the node's own identity.
    node_api = tessera.with_token(node_tokens[pod.spec.node_name])
    answer = node_api.allocation(namespace, "trainer")
    assert answer.status_code == 200, answer.text
    assert answer.json() == allocation
    # Another node may not read it.
    other = next(n for n in NODES if n != pod.spec.node_name)
    assert (
        tessera.with_token(node_tokens[other]).allocation(namespace, "trainer").status_code == 403
    )


def test_a_pod_asking_two_slices_gets_two_different_cards(core: Any, namespace: str) -> None:
    core.create_namespaced_pod(namespace, objects.gpu_pod("pair", gpus=2, gpumem=4000))
    devices = _devices(_allocation(objects.wait_running(core, namespace, "pair")))
    assert len(devices) == 2
    assert len({d["uuid"] for d in devices}) == 2


def test_a_pod_that_cannot_fit_stays_pending_and_the_why_answer_names_the_reason(
    core: Any, namespace: str, tessera: objects.Tessera
) -> None:
    card = f"GPU-{NODES[0]}-7"
    pin = {"nvidia.com/use-gpuuuid": card}
    core.create_namespaced_pod(namespace, objects.gpu_pod("holder", gpumem=50000, annotations=pin))
    assert _devices(_allocation(objects.wait_running(core, namespace, "holder")))[0]["uuid"] == card

    # The same card has 81920 - 50000 MiB left: a 40000 MiB slice pinned to it must wait.
    core.create_namespaced_pod(namespace, objects.gpu_pod("waiter", gpumem=40000, annotations=pin))
    condition = objects.wait_for(
        lambda: _unschedulable(core, namespace, "waiter"),
        timeout=30,
        what="kube-scheduler to mark the waiter unschedulable",
    )
    assert condition.reason == "Unschedulable"
    time.sleep(3)  # still pending after more scheduling attempts
    pod = _pod(core, namespace, "waiter")
    assert pod.status.phase == "Pending" and not pod.spec.node_name

    why = tessera.why(namespace, "waiter")
    assert why.status_code == 200, why.text
    text = json.dumps(why.json()).lower()
    assert "memory" in text or "mib" in text, why.json()


def test_a_namespace_over_its_quota_is_refused(
    core: Any, namespace: str, tessera: objects.Tessera, cluster: Any
) -> None:
    from kubernetes.client.exceptions import ApiException

    cluster.set_quota(namespace, gpus=1)
    core.create_namespaced_pod(namespace, objects.gpu_pod("first", gpumem=2000))
    objects.wait_running(core, namespace, "first")

    try:
        core.create_namespaced_pod(namespace, objects.gpu_pod("second", gpumem=2000))
    except ApiException as refused:  # refused at admission: the message names the quota
        assert "quota" in str(refused.body).lower(), refused.body
        return
    # ...or admitted and held back by the extender, with the quota as the reason.
    objects.wait_for(
        lambda: _unschedulable(core, namespace, "second"),
        timeout=30,
        what="the over-quota pod to be marked unschedulable",
    )
    assert not _pod(core, namespace, "second").spec.node_name
    why = tessera.why(namespace, "second")
    assert why.status_code == 200, why.text
    assert "quota" in json.dumps(why.json()).lower(), why.json()


def test_the_webhook_refuses_what_can_never_run(core: Any, namespace: str) -> None:
    from kubernetes.client.exceptions import ApiException

    privileged = objects.gpu_pod("privileged", gpumem=1000)
    privileged["spec"]["containers"][0]["securityContext"] = {"privileged": True}
    preset = objects.gpu_pod("preset", gpumem=1000)
    preset["spec"]["nodeName"] = NODES[0]
    huge = objects.gpu_pod("huge", gpumem=10 * CARD_MEMORY_MIB)
    cases = (
        (privileged, ("privileged",)),
        (preset, ("nodename",)),
        (huge, ("memory", "mib")),
    )
    for body, words in cases:
        with pytest.raises(ApiException) as refused:
            core.create_namespaced_pod(namespace, body)
        assert refused.value.status in (400, 403), refused.value
        message = str(refused.value.body).lower()
        assert any(word in message for word in words), refused.value.body


def test_a_burst_of_200_pods_lands_on_8_nodes_with_no_card_over_allocated(
    core: Any, namespace: str
) -> None:
    # 200 x 20000 MiB is three quarters of the 64 cards' memory and at most four such slices
    # fit on a card: a race in bind would show up as a card holding five.
    names = [f"burst-{i:03d}" for i in range(200)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(
            pool.map(
                lambda n: core.create_namespaced_pod(
                    namespace, objects.gpu_pod(n, gpumem=20000, gpucores=10)
                ),
                names,
            )
        )

    def all_running() -> bool:
        pods = core.list_namespaced_pod(namespace).items
        return len(pods) == 200 and all(p.status.phase == "Running" for p in pods)

    objects.wait_for(all_running, timeout=300, what="all 200 burst pods to run", every=2)
    # Every allocated slice on the whole cluster (earlier tests' pods included).
    memory: dict[str, int] = defaultdict(int)
    cores: dict[str, int] = defaultdict(int)
    slices: dict[str, int] = defaultdict(int)
    burst_nodes = set()
    for pod in core.list_pod_for_all_namespaces().items:
        annotations = pod.metadata.annotations or {}
        if ALLOCATION not in annotations:
            continue
        allocation = json.loads(annotations[ALLOCATION])
        assert allocation["node"] == pod.spec.node_name
        if pod.metadata.namespace == namespace:
            burst_nodes.add(pod.spec.node_name)
        for device in _devices(allocation):
            assert device["uuid"].startswith(f"GPU-{pod.spec.node_name}-")
            memory[device["uuid"]] += device["memory_mib"]
            cores[device["uuid"]] += device["cores"]
            slices[device["uuid"]] += 1
    assert sum(slices.values()) >= 200
    over = {
        uuid: (memory[uuid], cores[uuid], slices[uuid])
        for uuid in memory
        if memory[uuid] > CARD_MEMORY_MIB or cores[uuid] > 100 or slices[uuid] > SLOTS_PER_CARD
    }
    assert over == {}, f"over-allocated cards (memory MiB, cores %, slices): {over}"
    assert burst_nodes <= set(NODES)


def test_deleting_a_pod_frees_its_slices(
    core: Any, namespace: str, tessera: objects.Tessera, node_tokens: dict[str, str]
) -> None:
    # A node of its own (one card), so no other test's pods share the card.
    node = RELEASE_NODE
    node_api = tessera.with_token(node_tokens[node])
    card = f"GPU-{node}-0"
    big = objects.gpu_pod("big", gpumem=70000, pool="release")
    core.create_namespaced_pod(namespace, big)
    assert _devices(_allocation(objects.wait_running(core, namespace, "big")))[0]["uuid"] == card
    core.delete_namespaced_pod("big", namespace, grace_period_seconds=0)
    objects.wait_for(
        lambda: node_api.allocation(namespace, "big").status_code == 404,
        timeout=120,
        what="the reconciler to release the deleted pod's binding",
        every=1,
    )
    # The card's room is back: another 70000 MiB slice on it now fits. (Wait out the filter's
    # snapshot, at most a few hundred ms old: a pod the extender turns away is retried by
    # kube-scheduler only on a later cluster event, which could take minutes here.)
    time.sleep(1.5)
    core.create_namespaced_pod(namespace, objects.gpu_pod("next", gpumem=70000, pool="release"))
    assert (
        _devices(_allocation(objects.wait_running(core, namespace, "next", timeout=120)))[0]["uuid"]
        == card
    )
