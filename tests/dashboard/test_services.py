"""Dashboard services: allocation samples and the chart drawn from them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.dashboard import selectors, services
from controlplane.dashboard.models import AllocationSample
from tests.dashboard.builders import make_node, pod
from tests.pods import gpu_container

pytestmark = pytest.mark.django_db


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
