"""The decision log's background writer: filter answers first, the log follows in order."""

from __future__ import annotations

import time

import pytest

from controlplane.access.roles import Role
from controlplane.extender import decision_writer
from controlplane.ledger.models import SchedulingDecision
from controlplane.ledger.services.decisions import DecisionRecord, Outcome
from tests.builders import make_node, token_client
from tests.extender.builders import bind_args, filter_args
from tests.extender.conftest import post
from tests.pods import gpu_pod


@pytest.mark.django_db(transaction=True)
def test_async_writer_writes_every_outcome_in_order(client, settings) -> None:
    settings.TESSERA = {**settings.TESSERA, "DECISION_LOG_ASYNC": True}
    make_node("n1", cards=1, memory_mib=10000)
    for mem in (20000, 1000):  # first unschedulable, then feasible: the later one must win
        response = post(client, "/scheduler/filter", filter_args(gpu_pod("p", mem=mem), ["n1"]))
        assert response.status_code == 200
    decision_writer.record_bind("uid-default-p", "default", "p", "bind_failed", "refused: gone")
    for i in range(50):
        post(client, "/scheduler/filter", filter_args(gpu_pod(f"q{i}"), ["n1"]))
    decision_writer.writer.flush()
    row = SchedulingDecision.objects.get(pod_uid="uid-default-p")
    assert (row.outcome, row.summary) == ("bind_failed", "refused: gone")
    assert row.reason_counts == {} and row.feasible_nodes == ["n1"]  # from the 2nd filter
    assert SchedulingDecision.objects.count() == 51
    assert decision_writer.writer.dropped == 0
    decision_writer.writer.stop()
    thread = decision_writer.writer.worker.thread
    assert thread is not None and not thread.is_alive()


@pytest.fixture
def async_log(settings):
    settings.TESSERA = {**settings.TESSERA, "DECISION_LOG_ASYNC": True}
    yield
    decision_writer.writer.stop()


@pytest.mark.django_db(transaction=True)
def test_a_pod_bound_at_once_leaves_no_feasible_row_and_why_answers_from_the_binding(
    client, async_log, fake_kube
) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod("p"))
    assert post(client, "/scheduler/filter", filter_args(pod, ["n1"])).json()["NodeNames"] == ["n1"]
    assert post(client, "/scheduler/bind", bind_args(pod, "n1")).json() == {"Error": ""}
    decision_writer.writer.flush()
    assert not SchedulingDecision.objects.filter(pod_uid="uid-default-p").exists()
    body = token_client("vera", Role.VIEWER).get("/api/v1/pods/default/p/why").json()
    assert body["outcome"] == "bound" and body["summary"] == "bound on node n1, cards GPU-n1-0."
    assert body["binding"] == {"phase": "bound", "node": "n1", "pod_uid": "uid-default-p"}
    assert body["nodes_considered"] is None and body["reason_counts"] == {}


@pytest.mark.django_db(transaction=True)
def test_a_feasible_pod_left_unbound_is_written_when_its_hold_ends(
    client, async_log, monkeypatch
) -> None:
    monkeypatch.setattr(decision_writer, "HOLD_S", 0.3)
    make_node("n1", cards=1, memory_mib=10000)
    post(client, "/scheduler/filter", filter_args(gpu_pod("waits"), ["n1"]))
    time.sleep(0.1)
    assert not SchedulingDecision.objects.filter(pod_uid="uid-default-waits").exists()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # no flush: the hold's end alone writes it
        row = SchedulingDecision.objects.filter(pod_uid="uid-default-waits").first()
        if row is not None:
            break
        time.sleep(0.05)
    assert row is not None and row.outcome == "feasible" and row.feasible_nodes == ["n1"]


@pytest.mark.django_db(transaction=True)
def test_an_unschedulable_row_says_bound_once_the_pod_binds(client, async_log, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod("late", mem=20000))
    assert post(client, "/scheduler/filter", filter_args(pod, ["n1"])).json()["NodeNames"] == []
    decision_writer.writer.flush()
    assert SchedulingDecision.objects.get(pod_uid="uid-default-late").outcome == "unschedulable"
    fits = fake_kube.add(gpu_pod("late", mem=4000))  # room now (same UID: the builder's)
    assert post(client, "/scheduler/filter", filter_args(fits, ["n1"])).json()["NodeNames"]
    assert post(client, "/scheduler/bind", bind_args(fits, "n1")).json() == {"Error": ""}
    decision_writer.writer.flush()
    row = SchedulingDecision.objects.get(pod_uid="uid-default-late")
    # no longer counted as unschedulable (the dashboard's count), even after the pod ends
    assert row.outcome == "bound" and "20000" in row.summary
    body = token_client("vera", Role.VIEWER).get("/api/v1/pods/default/late/why").json()
    assert body["outcome"] == "bound" and body["summary"].startswith(
        "bound on node n1, cards GPU-n1-0. Before that: 0 of 1 node"
    )


@pytest.mark.django_db(transaction=True)
def test_a_failed_bind_writes_the_held_decision_then_the_failure(client, async_log) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    post(client, "/scheduler/filter", filter_args(gpu_pod("f"), ["n1"]))
    decision_writer.record_bind("uid-default-f", "default", "f", "bind_failed", "refused: gone")
    decision_writer.writer.flush()
    row = SchedulingDecision.objects.get(pod_uid="uid-default-f")
    assert (row.outcome, row.summary, row.feasible_nodes) == (
        "bind_failed",
        "refused: gone",
        ["n1"],
    )


@pytest.mark.django_db(transaction=True)
def test_entries_arriving_in_the_batch_window_do_not_wake_the_writer_one_by_one(
    async_log, monkeypatch
) -> None:
    # the batch ends at the flush
    monkeypatch.setattr(decision_writer.writer.worker, "window_s", 5.0)
    woken_before = decision_writer.writer.worker.submit_wakeups
    for i in range(50):
        record = DecisionRecord(f"u{i}", "default", f"p{i}", Outcome.UNSCHEDULABLE, "no room",
                                (), {}, {}, 1)  # fmt: skip
        decision_writer.record(record)
    decision_writer.writer.flush()
    # At most the first entry (when the thread was idle): not one per entry.
    assert decision_writer.writer.worker.submit_wakeups - woken_before <= 1
    assert SchedulingDecision.objects.count() == 50
    assert decision_writer.writer.dropped == 0
