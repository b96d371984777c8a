"""Tessera under Kueue on the real cluster (docs/kueue.md).

A real Kueue (the pinned version, built by e2e/build.sh, run by e2e/kueue.py) with its pod
integration: its own mutating webhook gates every pod that names a LocalQueue, its controller
admits the pod's Workload against a ClusterQueue's quota and lifts the gate, and only then do
kube-scheduler and Tessera's extender place and bind the pod. The ClusterQueue's quota is
Tessera's resources: 4 GPUs and 60,000 MiB of GPU memory.

- A queued pod within quota is gated at creation, admitted by Kueue, then bound by Tessera,
  which holds its slice.
- A second queued pod that would take the queue past its memory quota stays gated (never bound,
  nothing held by Tessera) while the first runs; Kueue admits it, and Tessera binds it, once the
  first is deleted.
- A pod in the same namespace without the queue label is Tessera's alone: no gate, no Workload,
  scheduled at once, even where Kueue's quota could never admit it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from e2e import kueue as kueue_
from e2e import objects
from e2e.cluster import Cluster
from e2e.harness import HarnessError
from tests.e2e.conftest import chart_values

pytestmark = [
    pytest.mark.usefixtures("gpu_nodes"),
    # Kueue meets Tessera only through the API server (gates, Workloads, pod resources), the
    # same in both passes of `make test`: it runs once, in the chart-mode pass on PostgreSQL,
    # the set-up closest to production. `make e2e-chart` runs it.
    pytest.mark.skipif(
        not chart_values(),
        reason="runs in the chart-mode pass only (TESSERA_E2E_CHART_VALUES; make e2e-chart)",
    ),
]

ALLOCATION = "tessera.io/allocation"
FLAVOR = "tessera-gpu"
CLUSTER_QUEUE = "tessera-e2e"
LOCAL_QUEUE = "gpus"
GPU_QUOTA, MEMORY_QUOTA_MIB = 4, 60000
SLICE_MIB = 40000  # one fits the memory quota, two do not


@pytest.fixture(scope="module")
def kueue(cluster: Cluster) -> Iterator[kueue_.Kueue]:
    """Kueue running against the session's cluster for this module; stopped, and its webhooks
    removed, at the end whatever happened, so later tests never meet it."""
    try:
        running = kueue_.Kueue(cluster, kueue_.binaries())
        running.start()
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def custom(kube: Any) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(kube)


@pytest.fixture(scope="module")
def cluster_queue(kueue: kueue_.Kueue, custom: Any) -> str:
    """A ResourceFlavor and a ClusterQueue over Tessera's GPU count and memory."""
    names = objects.resources()
    quota = {names.gpu: str(GPU_QUOTA), names.gpumem: str(MEMORY_QUOTA_MIB)}
    group, version = kueue_.GROUP, kueue_.VERSION
    custom.create_cluster_custom_object(
        group, version, "resourceflavors", kueue_.resource_flavor(FLAVOR)
    )
    custom.create_cluster_custom_object(
        group, version, "clusterqueues", kueue_.cluster_queue(CLUSTER_QUEUE, FLAVOR, quota)
    )

    def active() -> bool:
        queue = custom.get_cluster_custom_object(group, version, "clusterqueues", CLUSTER_QUEUE)
        return _condition(queue, "Active") == "True"

    objects.wait_for(active, timeout=30, what="the ClusterQueue to be Active")
    return CLUSTER_QUEUE


@pytest.fixture
def queued(core: Any, custom: Any, cluster_queue: str, request: pytest.FixtureRequest) -> str:
    """A fresh namespace Kueue's webhooks see, with a LocalQueue onto the ClusterQueue."""
    name = objects.unique(request.node.name.replace("_", "-")[:40].strip("-").lower())
    objects.create_namespace(core, name, labels={kueue_.NAMESPACE_LABEL: "true"})
    custom.create_namespaced_custom_object(
        kueue_.GROUP,
        kueue_.VERSION,
        name,
        "localqueues",
        kueue_.local_queue(LOCAL_QUEUE, cluster_queue),
    )
    return name


def _condition(obj: dict[str, Any], kind: str) -> str | None:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition["type"] == kind:
            return str(condition["status"])
    return None


def _workload(custom: Any, namespace: str, pod: str) -> dict[str, Any] | None:
    """The Workload Kueue made for `pod` (its owner), if any."""
    listed = custom.list_namespaced_custom_object(
        kueue_.GROUP, kueue_.VERSION, namespace, "workloads"
    )["items"]
    for workload in listed:
        owners = workload["metadata"].get("ownerReferences") or []
        if any(o["kind"] == "Pod" and o["name"] == pod for o in owners):
            return dict(workload)
    return None


def _queued_pod(name: str, gpumem: int) -> dict[str, Any]:
    return objects.gpu_pod(name, gpumem=gpumem, labels={kueue_.QUEUE_LABEL: LOCAL_QUEUE})


def _gates(pod: Any) -> list[str]:
    return [g.name for g in pod.spec.scheduling_gates or []]


def _held_mib(tessera: objects.Tessera, namespace: str, name: str) -> int | None:
    """The GPU memory Tessera's ledger holds for the pod (None: no allocation at all)."""
    answer = tessera.allocation(namespace, name)
    if answer.status_code == 404:
        return None
    assert answer.status_code == 200, answer.text
    return sum(d["memory_mib"] for c in answer.json()["containers"] for d in c["devices"])


def _bound_with_slice(core: Any, tessera: objects.Tessera, namespace: str, name: str) -> Any:
    """The pod running on a GPU node with a `SLICE_MIB` slice in Tessera's ledger, the same as
    the allocation annotation Tessera's bind wrote on it."""
    pod = objects.wait_running(core, namespace, name)
    assert not _gates(pod), pod.spec.scheduling_gates
    assert pod.spec.node_name.startswith("gpu-e2e-"), pod.spec.node_name
    annotation = json.loads((pod.metadata.annotations or {})[ALLOCATION])
    assert annotation["node"] == pod.spec.node_name
    assert annotation["pod_uid"] == pod.metadata.uid
    assert _held_mib(tessera, namespace, name) == SLICE_MIB
    return pod


def test_kueue_admits_within_quota_holds_the_rest_and_tessera_binds_what_it_admits(
    core: Any, custom: Any, queued: str, tessera: objects.Tessera
) -> None:
    # Kueue's webhook gates the pod and marks it as Kueue's at creation.
    created = core.create_namespaced_pod(queued, _queued_pod("first", SLICE_MIB))
    assert kueue_.ADMISSION_GATE in _gates(created), created.spec.scheduling_gates
    assert created.metadata.labels.get(kueue_.MANAGED_LABEL) == "true"
    assert created.spec.node_name is None

    # Kueue admits its Workload within the quota and lifts the gate; Tessera binds it.
    first = _bound_with_slice(core, tessera, queued, "first")
    workload = _workload(custom, queued, "first")
    assert workload is not None and _condition(workload, "Admitted") == "True", workload
    assert workload["status"]["admission"]["clusterQueue"] == CLUSTER_QUEUE

    # The second would take the queue to 80,000 of 60,000 MiB: Kueue keeps it gated.
    created = core.create_namespaced_pod(queued, _queued_pod("second", SLICE_MIB))
    assert kueue_.ADMISSION_GATE in _gates(created), created.spec.scheduling_gates
    gpumem = objects.resources().gpumem

    def turned_away() -> str | None:
        workload = _workload(custom, queued, "second")
        if workload is None or _condition(workload, "QuotaReserved") != "False":
            return None
        [reserved] = [c for c in workload["status"]["conditions"] if c["type"] == "QuotaReserved"]
        return str(reserved["message"]) if gpumem in reserved["message"] else None

    said = objects.wait_for(
        turned_away, timeout=30, what="Kueue to refuse the second pod its quota"
    )
    assert "insufficient" in said, said
    time.sleep(3)  # time enough for a bind, were the pod free to be scheduled
    second = core.read_namespaced_pod("second", queued)
    assert kueue_.ADMISSION_GATE in _gates(second), second.spec.scheduling_gates
    assert second.spec.node_name is None
    scheduled = [c for c in second.status.conditions or [] if c.type == "PodScheduled"]
    assert [(c.status, c.reason) for c in scheduled] == [("False", "SchedulingGated")], scheduled
    assert _held_mib(tessera, queued, "second") is None
    assert _held_mib(tessera, queued, "first") == SLICE_MIB  # the first runs on, untouched
    assert core.read_namespaced_pod("first", queued).metadata.uid == first.metadata.uid

    # The first pod goes: Kueue frees its quota and admits the second, Tessera binds it.
    core.delete_namespaced_pod("first", queued, grace_period_seconds=0)
    _bound_with_slice(core, tessera, queued, "second")
    workload = _workload(custom, queued, "second")
    assert workload is not None and _condition(workload, "Admitted") == "True", workload
    objects.wait_for(
        lambda: _held_mib(tessera, queued, "first") is None,
        timeout=30,
        what="Tessera to release the first pod's slice",
    )
    core.delete_namespaced_pod("second", queued, grace_period_seconds=0)


def test_a_pod_without_a_queue_name_is_scheduled_by_tessera_alone(
    core: Any, custom: Any, queued: str, tessera: objects.Tessera
) -> None:
    # More GPU memory than the ClusterQueue holds: Kueue could never admit it, so its running
    # shows Kueue left it alone.
    mib = MEMORY_QUOTA_MIB + 10000
    created = core.create_namespaced_pod(queued, objects.gpu_pod("unqueued", gpumem=mib))
    assert not _gates(created), created.spec.scheduling_gates
    assert kueue_.MANAGED_LABEL not in (created.metadata.labels or {})
    pod = objects.wait_running(core, queued, "unqueued", timeout=30)
    assert pod.spec.node_name.startswith("gpu-e2e-")
    assert _held_mib(tessera, queued, "unqueued") == mib
    assert _workload(custom, queued, "unqueued") is None
    core.delete_namespaced_pod("unqueued", queued, grace_period_seconds=0)
