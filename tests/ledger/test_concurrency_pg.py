"""64 concurrent reservations against one node on real PostgreSQL connections.

Lock -> recompute -> commit must never over-allocate a card and must not lose a reservation
that fits. Each thread has its own database connection, so the row locks are real.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
from django.db import connection
from django.db.models import Count, Q, Sum

from controlplane.ledger import errors
from controlplane.ledger.models import Card, PodBinding, Slice
from controlplane.ledger.services import bindings
from controlplane.scheduling import parse_pod
from tests.builders import make_node, run_at_once, using_postgres
from tests.pods import gpu_container, pod_json

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not using_postgres(), reason="needs DATABASE_URL=postgres://... (make test runs it)"
    ),
]

THREADS = 64


def reserving(request) -> Callable[[], str]:
    def job() -> str:
        try:
            bindings.bind_pod(request, "n1")
        except errors.AllocationRefused:
            return "refused"
        except Exception as exc:  # recorded and asserted on, never swallowed
            return f"error: {type(exc).__name__}: {exc}"
        return "reserved"

    return job


def test_64_concurrent_reservations_never_over_allocate_and_lose_none() -> None:
    assert connection.vendor == "postgresql"
    # 2 cards x 10,000 MiB; each pod asks 1,000 MiB: exactly 20 fit (slots 10 per card too).
    make_node("n1", cards=2, memory_mib=10000)
    requests = [
        parse_pod(pod_json(f"p{i}", containers=[gpu_container(mem=1000)])) for i in range(THREADS)
    ]
    outcomes = run_at_once([reserving(r) for r in requests])
    assert outcomes == Counter({"reserved": 20, "refused": 44}), outcomes
    per_card = dict(
        Slice.objects.filter(active=True)
        .values_list("card__uuid")
        .annotate(mem=Sum("memory_mib"))
        .values_list("card__uuid", "mem")
    )
    assert per_card == {"GPU-n1-0": 10000, "GPU-n1-1": 10000}
    assert PodBinding.objects.count() == 20


def test_mixed_sizes_and_repeated_uids_under_contention() -> None:
    assert connection.vendor == "postgresql"
    make_node("n1", cards=4, memory_mib=24000)
    sizes = (1000, 3000, 7000, 12000)
    pods = [(f"p{j}-{sizes[j % 4]}", sizes[j % 4]) for j in range(THREADS // 2)]
    jobs = []
    for name, mem in pods:
        req = parse_pod(pod_json(name, containers=[gpu_container(mem=mem)]))
        # every pod is submitted twice at once: a retried bind must not double-book
        jobs += [reserving(req)] * 2
    outcomes = run_at_once(jobs)
    assert not [k for k in outcomes if k.startswith("error")], outcomes
    cards = list(
        Card.objects.annotate(
            used=Sum("slices__memory_mib", filter=Q(slices__active=True)), n=Count("slices")
        )
    )
    for card in cards:
        assert (card.used or 0) <= card.memory_mib, (card.uuid, card.used)
        assert card.n <= card.slots
    assert all(b.slices.count() == 1 for b in PodBinding.objects.all())
    assert outcomes["reserved"] == 2 * PodBinding.objects.count()
    # nothing that fits was lost: free room only shrinks, so a refused size must not fit now
    largest_free = max(c.memory_mib - (c.used or 0) for c in cards)
    for mem in sizes:
        placed = PodBinding.objects.filter(name__endswith=f"-{mem}").count()
        if placed < len(pods) // 4:
            assert largest_free < mem, (mem, largest_free)
