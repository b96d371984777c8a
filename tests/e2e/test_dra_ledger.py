"""DRA mode, one ledger: a claim kube-scheduler allocated is in Tessera's ledger after a
reconcile, and every surface shows it (docs/dra.md, *One ledger for claims*).

Kwok nodes of their own carry the ResourceSlices the node plugin would publish (e2e/dra.py) and
their cards are in the ledger through the node plugin's inventory report (same UUIDs), as a DRA
node's plugin does both. kube-controller-manager's ResourceClaim controller makes each pod's
claim from its template, kube-scheduler allocates it, and a reconcile pass in DRA mode (the
task the worker runs, `run_reconcile`, in a `manage.py shell` of the control plane) mirrors it.
Then the allocations API, the dashboard's overview, grid and card pages over HTTP, and
`kubectl tessera inspect` run through kubectl show the claim on its card.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from html import unescape
from pathlib import Path
from typing import Any

import pytest
import requests

from e2e import objects
from e2e.cluster import Cluster
from e2e.dra import CLAIM_CONTROLLER, publish_kwok_slices, start_claim_controller
from e2e.harness import build_binaries
from nodeplugin.dra_slices import DRIVER
from tests.e2e.test_dra import claim_of, create, pod, template

POOL = "dra-ledger"
NODES = ["gpu-e2e-dral-0", "gpu-e2e-dral-1"]  # two cards each
VIEWER, PASSWORD = "e2e-dra-viewer", "dra-ledger-e2e-pw-7c1"


def reconcile(cluster: Cluster) -> dict[str, int]:
    """One full reconcile pass in DRA mode, as the worker runs it; its drift."""
    out = cluster.manage("shell", "--no-startup", "--command", (
        "import json\n"
        "from django.conf import settings\n"
        "settings.TESSERA = {**settings.TESSERA, 'MODE': 'dra'}\n"
        "from controlplane.kube import adapter\n"
        "from controlplane.reconciler.tasks import LocalState, run_reconcile\n"
        "run = run_reconcile(adapter.cluster_source(), LocalState(), full=True)\n"
        "print(json.dumps(run.drift))\n"
    ))  # fmt: skip
    drift: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    return drift


@pytest.fixture(scope="module")
def dra(cluster: Cluster, core: Any, kube: Any, tessera: objects.Tessera) -> Iterator[Any]:
    """The claim controller, the chart's DeviceClasses, and kwok nodes with both their slices
    and their cards in the ledger."""
    from kubernetes import client, dynamic

    from tests.deploy.chart import render

    start_claim_controller(cluster)
    classes = [d for d in render(sets=("mode=dra",)) if d["kind"] == "DeviceClass"]
    resources = dynamic.DynamicClient(kube).resources
    for doc in classes:
        api = resources.get(api_version=doc["apiVersion"], kind="DeviceClass")
        with contextlib.suppress(client.ApiException):  # another module made them
            api.create(body=doc)
    api = objects.Api(cluster)
    for name in NODES:
        core.create_node(objects.gpu_node(name, cards=2, pool=POOL))
        token = cluster.manage("createtoken", name, "--role", "node", "--label", "e2e").strip()
        report = tessera.with_token(token).report_inventory(name, objects.inventory(name, cards=2))
        assert report.status_code in (200, 201), report.text
    assert publish_kwok_slices(api, NODES, cards=2, slots=10) == len(NODES)
    try:
        yield api
    finally:
        cluster.stop_component(CLAIM_CONTROLLER)


@pytest.fixture(scope="module")
def dashboard(cluster: Cluster) -> requests.Session:
    """A viewer's signed-in session on the dashboard, as a person's browser has one."""
    cluster.manage("shell", "--no-startup", "--command", (
        "from controlplane.access.roles import Role\n"
        "from controlplane.access.services import grant_role\n"
        f"user = grant_role({VIEWER!r}, Role.VIEWER)\n"
        f"user.set_password({PASSWORD!r})\n"
        "user.save()\n"
    ))  # fmt: skip
    session = requests.Session()
    session.trust_env = False
    base = cluster.controlplane_url.rstrip("/")
    form = session.get(f"{base}/login/", timeout=30).text
    # The CSRF token lives in the session, so the form is where a browser reads it.
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', form)
    assert token is not None, form[-500:]
    signed = session.post(
        f"{base}/login/",
        data={"username": VIEWER, "password": PASSWORD, "csrfmiddlewaretoken": token.group(1)},
        headers={"Referer": f"{base}/login/"},
        timeout=30,
    )
    assert signed.status_code == 200 and "sessionid" in session.cookies, signed.text[-500:]
    return session


def page(cluster: Cluster, session: requests.Session, path: str) -> str:
    got = session.get(f"{cluster.controlplane_url.rstrip('/')}{path}", timeout=30)
    assert got.status_code == 200, f"{path}: {got.status_code}"
    return unescape(got.text)


def inspect(cluster: Cluster, node: str) -> str:
    """`kubectl tessera inspect <node>`, run as an operator runs it: kubectl finds the plugin on
    PATH and passes it the arguments."""
    kubectl = build_binaries(("kubectl",))["kubectl"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TESSERA_")}
    env.update(
        PATH=os.pathsep.join([str(kubectl.parent), str(Path(sys.executable).parent), os.defpath]),
        KUBECONFIG=str(cluster.kubeconfig),
        TESSERA_SERVER=cluster.controlplane_url,
        TESSERA_TOKEN=cluster.admin_token,
    )
    proc = subprocess.run(
        ["kubectl", "tessera", "inspect", node],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture
def namespace(core: Any) -> str:
    return objects.create_namespace(core, objects.unique("dral"), webhook=False)


def test_a_claim_allocated_by_kube_scheduler_is_in_the_ledger_and_on_every_surface(
    dra: Any,
    cluster: Cluster,
    core: Any,
    namespace: str,
    tessera: objects.Tessera,
    dashboard: requests.Session,
) -> None:
    create(dra, namespace, template("gpu-6gi-40", memory="6Gi", compute="40"))
    create(dra, namespace, pod("train", "gpu-6gi-40", pool=POOL))
    node = objects.wait_running(core, namespace, "train", timeout=60).spec.node_name
    claim = objects.wait_for(
        lambda: claim_of(dra, namespace, "train"), timeout=30, what="the claim's allocation"
    )
    name, uid = claim["metadata"]["name"], claim["metadata"]["uid"]
    (result,) = claim["status"]["allocation"]["devices"]["results"]
    assert (result["driver"], result["pool"]) == (DRIVER, node)
    card = f"GPU-{node}-{result['device'].removeprefix('gpu-')}"

    drift = reconcile(cluster)
    assert drift.get("claims_mirrored", 0) >= 1, drift

    # the allocations API: the claim's record, on its card, with what it consumes
    record = tessera.allocation(namespace, name)
    assert record.status_code == 200, record.text
    body = record.json()
    assert (body["pod_uid"], body["namespace"], body["node"]) == (uid, namespace, node)
    ((device,),) = [c["devices"] for c in body["containers"]]
    assert (device["uuid"], device["memory_mib"], device["cores"]) == (card, 6144, 40)
    rows = tessera.get(f"/api/v1/slices/?namespace={namespace}").json()["results"]
    assert [(r["pod"], r["card"], r["source"]) for r in rows] == [(name, card, "claim")]

    # the dashboard: the grid names the claim on its card, the card page lists its slice, the
    # overview counts it
    grid = page(cluster, dashboard, f"/grid/?namespace={namespace}")
    cell = re.search(rf'href="/cards/{card}/" title="([^"]*)"', grid)
    assert cell is not None and f"{namespace}/{name} (claim)" in cell.group(1), grid[-2000:]
    card_page = page(cluster, dashboard, f"/cards/{card}/")
    assert f"claim {namespace}/{name}" in card_page and "6 GiB" in card_page
    overview = page(cluster, dashboard, "/")
    slices = re.search(r'data-stat="slices">\s*(\d+)\s*<', overview)
    assert slices is not None and int(slices.group(1)) >= 1

    # kubectl tessera inspect: the claim under its card, with its request and slice
    table = inspect(cluster, node)
    lines = table.splitlines()
    row = next(i for i, line in enumerate(lines) if line.split()[:1] == [card])
    held = [line.split() for line in lines[row + 1 :] if line.startswith(" ") and "claim" in line]
    assert ["claim", f"{namespace}/{name}/gpu", "6144", "40", "bound"] in held, table

    # the pod ends: its claim goes (the claim controller deletes or deallocates it), and a
    # reconcile releases the row
    core.delete_namespaced_pod("train", namespace, grace_period_seconds=0)
    objects.wait_for(
        lambda: "released_claim" in json.dumps(reconcile(cluster)),
        timeout=90, what="a reconcile to release the claim's row", every=2,
    )  # fmt: skip
    assert tessera.allocation(namespace, name).status_code == 404
    assert tessera.get(f"/api/v1/slices/?namespace={namespace}").json()["results"] == []


def test_a_row_the_api_server_has_no_claim_for_is_released(
    dra: Any, cluster: Cluster, tessera: objects.Tessera, namespace: str
) -> None:
    node, card = NODES[1], f"GPU-{NODES[1]}-1"
    # A claim row whose claim is gone (deleted while no reconciler ran), written as the mirror
    # writes one.
    cluster.manage("shell", "--no-startup", "--command", (
        "from controlplane.ledger.services.claims import ClaimRecord, ClaimSlice, mirror_claim\n"
        f"slices = (ClaimSlice({card!r}, 'gpu', 0, 1024, 10),)\n"
        f"mirror_claim(ClaimRecord('uid-ghost-claim', {namespace!r}, 'ghost', {node!r}, slices),"
        " 'e2e')\n"
    ))  # fmt: skip
    assert tessera.allocation(namespace, "ghost").status_code == 200
    drift = reconcile(cluster)
    assert drift.get("released_claim_deleted", 0) >= 1, drift
    assert tessera.allocation(namespace, "ghost").status_code == 404


def test_the_real_adapter_lists_and_watches_claims_and_maps_devices_to_cards(
    dra: Any, cluster: Cluster, core: Any, namespace: str
) -> None:
    from controlplane.kube.real import RealClusterSource, RealKube

    source = RealClusterSource(RealKube("kubeconfig", str(cluster.kubeconfig)))
    devices = source.published_devices()
    for node in NODES:
        assert devices[(node, "gpu-0")].uuid == f"GPU-{node}-0"
        assert devices[(node, "gpu-1")].shared
    _, rv = source.list_claims()
    create(dra, namespace, template("gpu-2gi", memory="2Gi", compute="10"))
    create(dra, namespace, pod("watched", "gpu-2gi", pool=POOL))
    objects.wait_for(
        lambda: claim_of(dra, namespace, "watched"), timeout=30, what="the claim's allocation"
    )
    events = list(source.watch_claims(rv, 2))
    mine = [e.claim for e in events if e.claim.namespace == namespace]
    assert mine and mine[-1].allocated
    (result,) = mine[-1].results
    assert (result.driver, result.consumed["memory"]) == (DRIVER, "2Gi")
    assert source.last_claims_resource_version() not in ("", rv)
