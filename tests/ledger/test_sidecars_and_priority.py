"""Sidecar GPU init containers and task priorities through the ledger: bind, the rows it
writes, usage and quota arithmetic, the allocation record (docs/allocation.md), a repeated bind,
adopting a signed record, and "why pending"."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.ledger import allocation, errors, selectors, sql, usage, why
from controlplane.ledger.models import Card, NamespaceQuota, PodBinding, Slice
from controlplane.ledger.services import bindings
from controlplane.scheduling import QuotaUsage, claims_per_card, parse_pod, usage_of
from tests.builders import make_node
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db

PRIORITY = "nvidia.com/priority"


def sidecar_pod(name: str, namespace: str = "default", side_mem: int = 4000, init_mem: int = 6000):
    """A proxy sidecar (priority 0) started before an ordinary init container, then the app."""
    side = gpu_container("proxy", mem=side_mem, cores=10)
    side["restartPolicy"] = "Always"
    side["resources"]["limits"][PRIORITY] = 0
    body = pod_json(name, namespace, containers=[gpu_container("server", mem=5000, cores=20)])
    body["spec"]["initContainers"] = [side, gpu_container("convert", mem=init_mem, cores=50)]
    request = parse_pod(body)
    assert request is not None
    return request


def test_a_sidecar_is_written_marked_and_recorded_as_an_init_container() -> None:
    make_node("n1", cards=1, memory_mib=20000)
    reservation = bindings.bind_pod(sidecar_pod("p"), "n1")
    rows = sorted(
        Slice.objects.values_list("container_name", "init_container", "sidecar", "priority")
    )
    assert rows == [
        ("convert", True, False, None),
        ("proxy", True, True, 0),
        ("server", False, False, None),
    ]
    record = reservation.allocation()
    assert [{k: v for k, v in c.items() if k != "devices"} for c in record["containers"]] == [
        {"index": 0, "init": True, "name": "proxy", "priority": 0, "sidecar": True},
        {"index": 1, "init": True, "name": "convert"},
        {"index": 0, "init": False, "name": "server"},
    ]
    # The REST read of the same binding and a repeated bind give the same record.
    binding = PodBinding.objects.select_related("node").get(pk=reservation.binding_id)
    assert selectors.allocation_of(binding) == record
    again = bindings.bind_pod(sidecar_pod("p"), "n1")
    assert again.repeat and again.allocation() == record


def test_a_pod_that_asks_for_neither_keeps_the_old_record() -> None:
    make_node("n1", cards=1)
    body = pod_json("plain", containers=[gpu_container("a", mem=1000)])
    request = parse_pod(body)
    assert request is not None
    record = bindings.bind_pod(request, "n1").allocation()
    assert set(record["containers"][0]) == {"devices", "index", "init", "name"}


def test_priority_is_recorded_only_for_the_containers_that_asked() -> None:
    make_node("n1", cards=2)
    high = gpu_container("high", mem=1000)
    high["resources"]["limits"][PRIORITY] = 0
    low = gpu_container("low", mem=1000)
    low["resources"]["requests"] = {PRIORITY: "1"}
    request = parse_pod(pod_json("p", containers=[high, low, gpu_container("none", mem=1000)]))
    assert request is not None
    record = bindings.bind_pod(request, "n1").allocation()
    assert [c.get("priority") for c in record["containers"]] == [0, 1, None]
    assert ["priority" in c for c in record["containers"]] == [True, True, False]


def test_usage_holds_a_sidecar_beside_the_later_containers() -> None:
    # One 20000 MiB card: proxy 4000 runs beside convert 6000 (10000), then beside server
    # 5000 (9000): the pod holds 10000 MiB at its peak, the snapshot and the sums agree.
    make_node("n1", cards=1, memory_mib=20000)
    reservation = bindings.bind_pod(sidecar_pod("p", "team-a"), "n1")
    [card_id] = Card.objects.values_list("id", flat=True)
    held = usage.card_usage()
    assert (held[card_id].memory_mib, held[card_id].cores, held[card_id].slots) == (10000, 60, 2)
    assert usage.claims_of(sql.active_slices()) == held
    [card] = selectors.cluster_snapshot().nodes[0].cards
    assert (card.used_memory_mib, card.used_compute, card.used_slots) == (10000, 60, 2)
    expected = usage_of(reservation.claims())
    assert usage.quota_usage("team-a") == expected == QuotaUsage(10000, 60, 2)
    assert usage_of(claims_per_card(a.to_claim() for a in reservation.assignments)) == expected


def test_the_sidecars_peak_decides_whether_the_pod_fits() -> None:
    # 16000 MiB: the init container (11000) runs beside the sidecar started before it, so
    # 4000 + 11000 fits and 6000 + 11000 does not, though either sidecar fits beside the app.
    make_node("n1", cards=1, memory_mib=16000)
    bindings.bind_pod(sidecar_pod("fits", init_mem=11000), "n1")
    make_node("n2", cards=1, memory_mib=16000)
    with pytest.raises(errors.AllocationRefused, match="init container 'convert'"):
        bindings.bind_pod(sidecar_pod("big", side_mem=6000, init_mem=11000), "n2")


def test_quota_counts_the_sidecar_at_the_pods_peak() -> None:
    make_node("n1", cards=1, memory_mib=20000)
    NamespaceQuota.objects.create(namespace="team-a", gpumem_mib=9999)
    with pytest.raises(errors.AllocationRefused, match="10000 MiB requested > 9999 MiB limit"):
        bindings.bind_pod(sidecar_pod("p", "team-a"), "n1")


def _signed(containers: list[allocation.ContainerAllocation]) -> Any:
    record = allocation.allocation_record("uid-adopted", "default", "adopted", "n1", containers)
    return allocation.verify_allocation(allocation.annotations(record)), record


def test_adopting_a_signed_record_keeps_sidecar_and_priority() -> None:
    make_node("n1", cards=1)
    verified, record = _signed(
        [
            allocation.ContainerAllocation(
                "proxy", 0, True, (allocation.Device("GPU-n1-0", 0, 3000, 10),), True, 1
            ),
            allocation.ContainerAllocation(
                "app", 0, False, (allocation.Device("GPU-n1-0", 0, 2000, 0),)
            ),
        ]
    )
    assert [(c.sidecar, c.priority) for c in verified.containers] == [(True, 1), (False, None)]
    adopted = bindings.adopt_binding(verified, "test")
    assert (adopted.node, adopted.phase) == ("n1", "bound")
    binding = PodBinding.objects.select_related("node").get(pk=adopted.binding_id)
    assert selectors.allocation_of(binding) == record
    # held beside the app container: 3000 + 2000
    assert usage.quota_usage("default").memory_mib == 5000


def test_why_counts_what_the_pod_holds_while_it_runs() -> None:
    make_node("n1", cards=1, memory_mib=20000)
    bindings.bind_pod(sidecar_pod("p"), "n1")
    facts = why.binding_facts("default", "p")
    assert facts is not None
    assert (facts.memory_mib, facts.cores) == (4000 + 5000, 10 + 20)
