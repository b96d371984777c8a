"""A PostgreSQL restart or failover ends every connection the control plane keeps open.

Django keeps a connection per thread between requests (CONN_MAX_AGE); the request after the
server ended it must be served on a new connection, not answered 500 on the dead one: for the
webhook that 500 refuses a pod (failurePolicy Fail), for the extender it fails a scheduling
cycle, for people it is an error page. Requests go through controlplane.wsgi.application with
Django's request signals, as gunicorn and granian run them. The decision log's writer thread,
which serves no requests, keeps a connection of its own and must not lose a batch on it either.
"""

from __future__ import annotations

import json

import pytest
from django.db import close_old_connections, connection, connections

from controlplane.access.roles import Role
from controlplane.access.services import create_token
from controlplane.extender import decision_writer
from controlplane.ledger.models import SchedulingDecision
from controlplane.ledger.services.decisions import DecisionRecord, Outcome
from tests.builders import make_node, using_postgres
from tests.extender.builders import filter_args
from tests.extender.test_fastpath import call
from tests.pods import gpu_pod

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not using_postgres(), reason="needs DATABASE_URL=postgres://... (make test runs it)"
    ),
]


@pytest.fixture(autouse=True)
def _fresh_connection():
    """Each test starts and ends with this thread's connection closed as a server leaves it."""
    close_old_connections()
    yield
    connection.close()


def end_this_threads_connection() -> None:
    """What a restart does to the connection this thread keeps: the server ends it. (Its pid
    is read from the driver: a query through Django would be this thread's next use of it.)"""
    assert connection.connection is not None, "the request left no connection open"
    pid = connection.connection.info.backend_pid
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
    finally:
        other.close()


def test_the_rest_api_answers_on_a_new_connection_after_the_server_ended_the_old_one() -> None:
    token = create_token("vera", Role.VIEWER)
    headers = {"AUTHORIZATION": f"Bearer {token}"}
    status, _, _ = call("/api/v1/pods/default/p/why", method="GET", headers=headers)
    assert status.startswith("404")  # served: no such pod
    end_this_threads_connection()
    status, _, body = call("/api/v1/pods/default/p/why", method="GET", headers=headers)
    assert status.startswith("404"), (status, body[:300])


def test_the_extender_answers_on_a_new_connection_after_the_server_ended_the_old_one() -> None:
    make_node("n1", cards=1, memory_mib=10000)
    status, _, body = call("/scheduler/filter", filter_args(gpu_pod("p"), ["n1"]))
    assert status.startswith("200") and json.loads(body)["NodeNames"] == ["n1"], body
    end_this_threads_connection()
    status, _, body = call("/scheduler/filter", filter_args(gpu_pod("q"), ["n1"]))
    assert status.startswith("200") and json.loads(body)["NodeNames"] == ["n1"], body


def unschedulable(name: str) -> DecisionRecord:
    return DecisionRecord(
        f"uid-{name}", "default", name, Outcome.UNSCHEDULABLE, "0 of 1 nodes can hold it.",
        [], {"n1": "no room"}, {"InsufficientMemory": 1}, 1,
    )  # fmt: skip


def test_the_decision_log_writes_its_next_batch_on_a_new_connection(settings) -> None:
    # Its own thread keeps its own connection between batches; a batch that failed on a dead
    # one would be dropped, and the pods it named would have no "why" until filtered again
    # (minutes, for a pod the scheduler has set aside as unschedulable).
    settings.TESSERA = {**settings.TESSERA, "DECISION_LOG_ASYNC": True}
    try:
        decision_writer.record(unschedulable("before"))
        decision_writer.writer.flush()
        assert SchedulingDecision.objects.filter(name="before").exists()
        with connection.cursor() as cursor:  # the writer's connection: the other one here
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            assert cursor.fetchall(), "the writer holds no connection of its own"
        decision_writer.record(unschedulable("after"))
        decision_writer.writer.flush()
        assert SchedulingDecision.objects.filter(name="after").exists()
    finally:
        decision_writer.writer.stop()
