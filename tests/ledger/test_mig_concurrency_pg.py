"""Concurrent binds on one MIG card on real PostgreSQL connections: bind recomputes under the
node's row lock on the committed placements, so no two instances ever share a memory slice."""

from __future__ import annotations

from collections import Counter

import pytest
from django.db import connection
from django.utils import timezone

from controlplane.ledger.models import Card, Slice
from controlplane.scheduling import parse_pod
from tests.builders import make_node, run_at_once, using_postgres
from tests.ledger.test_concurrency_pg import reserving
from tests.pods import gpu_container, pod_json

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not using_postgres(), reason="needs DATABASE_URL=postgres://... (make test runs it)"
    ),
]


def test_sixteen_racing_binds_take_seven_disjoint_instances() -> None:
    assert connection.vendor == "postgresql"
    make_node("n1", cards=1)
    Card.objects.update(mode="mig", mig_capable=True, mig_enabled=True, updated_at=timezone.now())
    mig = {"nvidia.com/vgpu-mode": "mig"}
    asks = [pod_json(f"p{i}", containers=[gpu_container(mem=8000)], annotations=mig)
            for i in range(16)]  # fmt: skip
    requests = [parse_pod(ask) for ask in asks]
    outcomes = run_at_once([reserving(r) for r in requests])
    assert outcomes == Counter({"reserved": 7, "refused": 9}), outcomes
    starts = sorted(
        Slice.objects.filter(active=True).values_list("mig_profile", "mig_start", "mig_size")
    )
    assert starts == [("1g.10gb", s, 1) for s in range(7)]
