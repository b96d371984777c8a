"""The reconciler against the real API server (its Celery worker runs in the harness).

A reservation whose Binding never reached the API server is released after its deadline; a pod
that is bound with a signed allocation the ledger lacks (a restored database) is adopted; one
whose allocation was tampered with is not. The pods live in a namespace the webhook skips, with
a scheduler name nobody serves, so only these tests decide where (and whether) they are bound.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
from typing import Any

import pytest

from e2e import objects
from e2e.cluster import Cluster
from tests.e2e.conftest import NODES

pytestmark = pytest.mark.usefixtures("gpu_nodes")


def pending_pod(core: Any, namespace: str, name: str, gpumem: int) -> str:
    pod = objects.gpu_pod(name, gpumem=gpumem, scheduler_name="nobody-schedules-this")
    return str(core.create_namespaced_pod(namespace, pod).metadata.uid)


def signed(cluster: Cluster, record: dict[str, Any]) -> dict[str, str]:
    """The two annotations, signed as docs/allocation.md says, with the harness's key."""
    value = json.dumps(record, separators=(",", ":"), sort_keys=True)
    key = cluster.state["allocation_key"].strip().encode()
    mac = hmac.new(key, value.encode(), hashlib.sha256).digest()
    signature = "v1:" + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
    return {"tessera.io/allocation": value, "tessera.io/allocation-signature": signature}


def bind(core: Any, namespace: str, name: str, node: str, annotations: dict[str, str]) -> None:
    body = {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {"name": name, "namespace": namespace, "annotations": annotations},
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }
    # The Binding answers with a Status the generated client cannot read: take it raw.
    core.create_namespaced_pod_binding(name, namespace, body, _preload_content=False)


def test_a_reservation_whose_binding_never_came_is_released_after_its_deadline(
    cluster: Cluster,
    core: Any,
    unmanaged: str,
    tessera: objects.Tessera,
    node_tokens: dict[str, str],
) -> None:
    node = NODES[0]
    uid = pending_pod(core, unmanaged, "stranded", 1000)
    # A bind that reserved and then died before calling the API server, written into the
    # ledger as the extender would have, with a deadline a few seconds away.
    cluster.manage("shell", "--no-startup", "--command", (
        "from datetime import timedelta\n"
        "from django.utils import timezone\n"
        "from controlplane.kube.adapter import get_kube\n"
        "from controlplane.ledger import selectors\n"
        "from controlplane.ledger.services import bindings\n"
        "from controlplane.ledger.models import PodBinding\n"
        "from controlplane.scheduling import parse_pod\n"
        f"pod = get_kube().get_pod({unmanaged!r}, 'stranded')\n"
        "request = parse_pod(pod, selectors.scheduling_config())\n"
        f"bindings.bind_pod(request, {node!r})\n"
        "PodBinding.objects.filter(pod_uid=request.uid).update(\n"
        "    deadline=timezone.now() + timedelta(seconds=5))\n"
    ))  # fmt: skip
    api = tessera.with_token(node_tokens[node])
    held = api.allocation(unmanaged, "stranded")
    assert held.status_code == 200 and held.json()["pod_uid"] == uid, held.text
    objects.wait_for(
        lambda: api.allocation(unmanaged, "stranded").status_code == 404,
        timeout=120, what="the reconciler to release the expired reservation", every=1,
    )  # fmt: skip
    assert core.read_namespaced_pod("stranded", unmanaged).spec.node_name is None


def test_a_bound_pod_missing_from_the_ledger_is_adopted_and_a_forged_one_is_not(
    cluster: Cluster,
    core: Any,
    unmanaged: str,
    tessera: objects.Tessera,
    node_tokens: dict[str, str],
) -> None:
    node = NODES[1]
    api = tessera.with_token(node_tokens[node])
    records = {}
    for name in ("restored", "forged"):
        uid = pending_pod(core, unmanaged, name, 2000)
        records[name] = {
            "containers": [{
                "devices": [{"cores": 0, "memory_mib": 2000, "uuid": f"GPU-{node}-7"}],
                "index": 0, "init": False, "name": "app",
            }],
            "name": name, "namespace": unmanaged, "node": node, "pod_uid": uid, "v": 1,
        }  # fmt: skip
    bind(core, unmanaged, "restored", node, signed(cluster, records["restored"]))
    forged = signed(cluster, records["forged"])
    # The pod's owner raises its memory after signing: the signature no longer matches.
    forged["tessera.io/allocation"] = forged["tessera.io/allocation"].replace("2000", "80000")
    bind(core, unmanaged, "forged", node, forged)

    objects.wait_for(
        lambda: api.allocation(unmanaged, "restored").status_code == 200,
        timeout=120, what="the reconciler to adopt the bound pod", every=1,
    )  # fmt: skip
    assert api.allocation(unmanaged, "restored").json() == records["restored"]
    assert api.allocation(unmanaged, "forged").status_code == 404

    core.delete_namespaced_pod("restored", unmanaged, grace_period_seconds=0)
    core.delete_namespaced_pod("forged", unmanaged, grace_period_seconds=0)
    objects.wait_for(
        lambda: api.allocation(unmanaged, "restored").status_code == 404,
        timeout=120, what="the adopted pod's slices to be released", every=1,
    )  # fmt: skip


@pytest.mark.django_db
def test_a_resume_point_ahead_of_the_api_server_means_a_full_relist(cluster: Cluster) -> None:
    """etcd restored from a backup: the saved resourceVersion is ahead of the API server, which
    then watches from it in silence (no error, no events) until it gets there. The reconciler
    compares it with the API server's current version and relists instead."""
    import time

    from controlplane.kube.real import RealClusterSource, RealKube
    from controlplane.reconciler.tasks import (
        LAST_FULL_KEY,
        RESUME_KEY,
        LocalState,
        resume_point,
        run_reconcile,
    )

    source = RealClusterSource(RealKube("kubeconfig", str(cluster.kubeconfig)))
    _, listed = source.list_pods()
    current = source.current_resource_version()
    assert int(current) >= int(listed)
    ahead = str(int(current) + 10_000_000)
    started = time.monotonic()
    assert list(source.watch_pods(ahead, 3)) == []  # what the check is for: silence
    assert time.monotonic() - started >= 2.5

    here = source.cluster_identity()
    state = LocalState({RESUME_KEY: resume_point(here, ahead), LAST_FULL_KEY: str(time.time())})
    run = run_reconcile(source, state, full=False)
    assert run.mode == "full" and run.drift.get("resume_point_ahead") == 1
    saved = json.loads(state[RESUME_KEY])
    assert saved["cluster"] == here
    assert int(saved["rv"]) <= int(source.current_resource_version())


@pytest.mark.django_db
def test_a_resume_point_of_another_cluster_means_a_full_relist(cluster: Cluster, core: Any) -> None:
    """Redis outlived the cluster: the saved version is another etcd's counter, possibly behind
    this API server's, where the ahead check cannot see it. The resume point carries the UID of
    the cluster's kube-system namespace; another UID means a relist, and the new point is this
    cluster's."""
    import time

    from controlplane.kube.real import RealClusterSource, RealKube
    from controlplane.reconciler.tasks import (
        LAST_FULL_KEY,
        RESUME_KEY,
        LocalState,
        resume_point,
        run_reconcile,
    )

    source = RealClusterSource(RealKube("kubeconfig", str(cluster.kubeconfig)))
    here = source.cluster_identity()
    assert here and here == core.read_namespace("kube-system").metadata.uid
    behind = source.current_resource_version()  # a version this API server has: no "ahead"
    other = LocalState({RESUME_KEY: resume_point("uid-of-another-cluster", behind),
                        LAST_FULL_KEY: str(time.time())})  # fmt: skip
    run = run_reconcile(source, other, full=False)
    assert run.mode == "full" and run.drift.get("resume_point_other_cluster") == 1
    assert json.loads(other[RESUME_KEY])["cluster"] == here
    again = run_reconcile(source, other, full=False)  # its own resume point now: a watch
    assert again.mode == "watch" and "resume_point_other_cluster" not in again.drift
