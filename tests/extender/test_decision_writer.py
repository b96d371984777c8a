"""The decision log's background writer: filter answers first, the log follows in order."""

from __future__ import annotations

import pytest

from controlplane.extender import decisions
from controlplane.ledger.models import SchedulingDecision
from tests.builders import make_node
from tests.extender.builders import filter_args, gpu_pod
from tests.extender.conftest import post


@pytest.mark.django_db(transaction=True)
def test_async_writer_writes_every_outcome_in_order(client, settings) -> None:
    settings.TESSERA = {**settings.TESSERA, "DECISION_LOG_ASYNC": True}
    make_node("n1", cards=1, memory_mib=10000)
    for mem in (20000, 1000):  # first unschedulable, then feasible: the later one must win
        response = post(client, "/scheduler/filter", filter_args(gpu_pod("p", mem=mem), ["n1"]))
        assert response.status_code == 200
    decisions.record_bind("uid-default-p", "default", "p", "bind_failed", "refused: gone")
    for i in range(50):
        post(client, "/scheduler/filter", filter_args(gpu_pod(f"q{i}"), ["n1"]))
    decisions.writer.flush()
    row = SchedulingDecision.objects.get(pod_uid="uid-default-p")
    assert (row.outcome, row.summary) == ("bind_failed", "refused: gone")
    assert row.reason_counts == {} and row.feasible_nodes == ["n1"]  # from the 2nd filter
    assert SchedulingDecision.objects.count() == 51
    assert decisions.writer.dropped == 0
    decisions.writer.stop()
    assert decisions.writer._thread is not None and not decisions.writer._thread.is_alive()
