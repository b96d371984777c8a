"""HAMi's MIG example (corpus case h15: vgpu-mode mig, 2 GPUs x 8000 MiB) on a cluster whose
A100 node has its two cards in MIG mode, through the real endpoints as in
test_hami_corpus.py. The corpus' own expectation (no MIG card anywhere: infeasible) is
checked there; this is the same pod once the operator has MIG cards. HAMi's example says
"1g.10gb * 2 for A100-80GB"."""

from __future__ import annotations

import copy

import pytest
from django.utils import timezone

from controlplane.ledger.models import Card
from tests.compat.test_hami_corpus import CORPUS, Cluster, load

pytestmark = [
    pytest.mark.django_db,
    pytest.mark.skipif(CORPUS is None, reason="the HAMi corpus (shared/compat/hami) is absent"),
]


def mig_cluster() -> Cluster:
    cluster = Cluster(load("h15"))
    cluster.report_inventory()
    Card.objects.filter(node__name=cluster.node("a100")).update(
        mode="mig", mig_capable=True, mig_enabled=True, updated_at=timezone.now()
    )
    return cluster


def check_two_instances(record: dict, profile: str) -> None:
    [c] = record["containers"]
    devices = c["devices"]
    assert len({d["uuid"] for d in devices}) == 2
    for d in devices:
        assert d["mode"] == "mig" and d["mig"]["profile"] == profile and d["mig"]["size"] == 1


def test_h15_schedules_on_the_a100_in_mig_mode_with_1g_10gb_per_card() -> None:
    cluster = mig_cluster()
    cluster.admit("gpu-pod")
    assert cluster.admissions["gpu-pod"]["allowed"]
    result = cluster.filter("gpu-pod")
    assert result["NodeNames"] == [cluster.node("a100")]
    # The other nodes' cards are shared: each says so, for good.
    assert set(result["FailedAndUnresolvableNodes"]) == {
        cluster.node(n) for n in ("mixed", "h200", "rtx")
    }
    record = cluster.bind("gpu-pod", cluster.pods["gpu-pod"], cluster.node("a100"))
    check_two_instances(record, "1g.10gb")


def test_nvidias_mig_resource_names_work_when_tessera_serves_them(settings) -> None:
    settings.TESSERA = {**settings.TESSERA, "MIG_RESOURCES": True}
    cluster = mig_cluster()
    case = cluster.case
    entry = copy.deepcopy(case["pods"][0])
    for pod in (entry["admission_review"]["request"]["object"], entry["extender_args"]["Pod"]):
        pod["metadata"]["annotations"] = {}
        [c] = pod["spec"]["containers"]
        c["resources"] = {"limits": {"nvidia.com/mig-1g.10gb": "2"}}
    case["pods"] = [entry]
    cluster.admit("gpu-pod")
    answer = cluster.admissions["gpu-pod"]
    assert answer["allowed"]
    pod = cluster.pods["gpu-pod"]
    assert pod["spec"]["schedulerName"] == "tessera-scheduler"
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "2"
    result = cluster.filter("gpu-pod")
    assert result["NodeNames"] == [cluster.node("a100")]
    record = cluster.bind("gpu-pod", pod, cluster.node("a100"))
    check_two_instances(record, "1g.10gb")


def test_with_mig_resources_off_the_pod_is_not_tesseras() -> None:
    cluster = mig_cluster()
    entry = cluster.case["pods"][0]
    pod = entry["admission_review"]["request"]["object"]
    pod["metadata"]["annotations"] = {}
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/mig-1g.10gb": "2"}}
    cluster.admit("gpu-pod")
    answer = cluster.admissions["gpu-pod"]
    assert answer["allowed"] and "patch" not in answer
