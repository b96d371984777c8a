"""Dashboard services: quotas, cordons and allocation samples, each audited and validated."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.dashboard import selectors, services
from controlplane.dashboard.models import AllocationSample
from controlplane.dashboard.services import QuotaLimitsInput
from controlplane.ledger.models import AuditEvent, Card, NamespaceQuota, Node
from controlplane.ledger.services import Conflict, NotFound, ServiceError
from tests.dashboard.builders import gpu_container, make_node, pod

pytestmark = pytest.mark.django_db


def test_set_quota_creates_then_replaces_and_audits() -> None:
    quota, created = services.set_quota("team-a", QuotaLimitsInput(gpumem_mib=100), "ann")
    assert created and (quota.gpumem_mib, quota.gpucores, quota.gpus) == (100, None, None)
    quota, created = services.set_quota("team-a", QuotaLimitsInput(gpus=0), "bob")
    assert not created and (quota.gpumem_mib, quota.gpus, quota.updated_by) == (None, 0, "bob")
    events = list(AuditEvent.objects.order_by("id"))
    assert [(e.actor, e.action, e.target) for e in events] == [
        ("ann", "quota-set", "team-a"),
        ("bob", "quota-set", "team-a"),
    ]
    assert events[1].details == {
        "before": {"gpumem_mib": 100, "gpucores": None, "gpus": None},
        "after": {"gpumem_mib": None, "gpucores": None, "gpus": 0},
    }


def test_set_quota_create_only_conflicts() -> None:
    services.set_quota("team-a", QuotaLimitsInput(gpus=1), "ann")
    with pytest.raises(Conflict) as err:
        services.set_quota("team-a", QuotaLimitsInput(gpus=2), "ann", create_only=True)
    assert err.value.field == "namespace"
    assert NamespaceQuota.objects.get().gpus == 1


@pytest.mark.parametrize(
    ("namespace", "limits", "field"),
    [
        ("Team-A", QuotaLimitsInput(), "namespace"),
        ("", QuotaLimitsInput(), "namespace"),
        ("ok", QuotaLimitsInput(gpumem_mib=-1), "gpumem_mib"),
        ("ok", QuotaLimitsInput(gpucores=10**12), "gpucores"),
        ("ok", QuotaLimitsInput(gpus=True), "gpus"),  # type: ignore[arg-type]
        ("ok", QuotaLimitsInput(gpus="3"), "gpus"),  # type: ignore[arg-type]
    ],
)
def test_set_quota_refuses_bad_input(namespace: str, limits: QuotaLimitsInput, field: str) -> None:
    with pytest.raises(ServiceError) as err:
        services.set_quota(namespace, limits, "ann")
    assert err.value.field == field
    assert not NamespaceQuota.objects.exists() and not AuditEvent.objects.exists()


def test_delete_quota() -> None:
    services.set_quota("team-a", QuotaLimitsInput(gpus=1), "ann")
    services.delete_quota("team-a", "bob")
    assert not NamespaceQuota.objects.exists()
    event = AuditEvent.objects.get(action="quota-delete")
    assert (event.actor, event.details["before"]["gpus"]) == ("bob", 1)
    with pytest.raises(NotFound):
        services.delete_quota("team-a", "bob")


def test_cordons_are_audited_only_when_they_change() -> None:
    make_node("n1", cards=1)
    services.set_node_cordon("n1", True, "ann", "drain")
    services.set_node_cordon("n1", True, "ann")
    services.set_card_cordon("GPU-n1-0", True, "bob")
    services.set_card_cordon("GPU-n1-0", False, "bob")
    assert Node.objects.get().cordoned and not Card.objects.get().cordoned
    events = list(
        AuditEvent.objects.filter(action__contains="cordon")
        .order_by("id")
        .values_list("actor", "action", "target")
    )
    assert events == [
        ("ann", "node-cordon", "n1"),
        ("bob", "card-cordon", "GPU-n1-0"),
        ("bob", "card-uncordon", "GPU-n1-0"),
    ]
    with pytest.raises(NotFound):
        services.set_node_cordon("n9", True, "ann")
    with pytest.raises(NotFound):
        services.set_card_cordon("GPU-none", True, "ann")


def test_allocation_sample_once_a_minute_and_pruned() -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod("a", "n1", gpu_container(mem=2500, cores=25))
    now = timezone.now().replace(second=10)
    stats = selectors.cluster_overview()
    first = services.record_allocation_sample(stats, now)
    again = services.record_allocation_sample(stats, now + timedelta(seconds=30))
    assert first.pk == again.pk and AllocationSample.objects.count() == 1
    assert (first.memory_total_mib, first.memory_allocated_mib) == (10000, 2500)
    assert (first.compute_allocated, first.slices) == (25, 1)
    assert not services.sample_due(first, now + timedelta(seconds=30))
    assert services.sample_due(first, now + timedelta(minutes=1))
    AllocationSample.objects.create(
        bucket=now - timedelta(days=8),
        cards=1,
        memory_total_mib=1,
        memory_allocated_mib=0,
        compute_total=100,
        compute_allocated=0,
        slices=0,
        pending_pods=0,
    )
    services.record_allocation_sample(stats, now + timedelta(minutes=1))
    buckets = list(AllocationSample.objects.order_by("bucket").values_list("bucket", flat=True))
    assert buckets == [
        now.replace(second=0, microsecond=0),
        now.replace(second=0, microsecond=0) + timedelta(minutes=1),
    ]


def test_record_allocation_sample_command() -> None:
    from io import StringIO

    from django.core.management import call_command

    make_node("n1", cards=2, memory_mib=10000)
    pod("a", "n1", gpu_container(mem=4000, cores=40))
    out = StringIO()
    call_command("record_allocation_sample", stdout=out)
    call_command("record_allocation_sample", stdout=StringIO())
    sample = AllocationSample.objects.get()
    assert (sample.memory_allocated_mib, sample.memory_total_mib) == (4000, 20000)
    assert "memory 4000/20000 MiB" in out.getvalue()


def test_allocation_chart_draws_one_line_per_dimension() -> None:
    from controlplane.dashboard.charts import allocation_chart

    start = timezone.now().replace(second=0, microsecond=0)
    samples = [
        AllocationSample(
            bucket=start + timedelta(minutes=k),
            cards=1,
            memory_total_mib=1000,
            memory_allocated_mib=500 * k,
            compute_total=100,
            compute_allocated=0,
            slices=0,
            pending_pods=0,
        )
        for k in range(3)
    ]
    svg = str(allocation_chart(samples))
    assert svg.count("<polyline") == 2
    # 0%, 50%, 100% memory: the line ends at the top gridline (y = TOP) and starts at the bottom
    memory = svg.split('class="line memory" points="')[1].split('"')[0].split()
    assert [p.split(",")[1] for p in memory] == ["178.0", "94.0", "10.0"]
    assert "Collecting samples" in str(allocation_chart(samples[:1]))
