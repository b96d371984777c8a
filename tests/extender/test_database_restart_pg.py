"""A PostgreSQL restart or failover ends every connection the control plane keeps open.

Django's connection pool keeps connections between requests; the request after the server
ended them must be served on a new connection, not answered 500 on a dead one: for the
webhook that 500 refuses a pod (failurePolicy Fail), for the extender it fails a scheduling
cycle, for people it is an error page. Requests go through controlplane.wsgi.application with
Django's request signals, as gunicorn and granian run them. The decision log's writer thread,
which serves no requests, takes its connections from the same pool and must not lose a batch on
a dead one either.
"""

from __future__ import annotations

import json
import time

import psycopg
import pytest
from django.conf import settings as django_settings
from django.db import close_old_connections, connection

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


def end_the_kept_connections() -> None:
    """What a restart does to the connections the control plane keeps between requests (its
    pool's): the server ends them all. From a connection of its own, outside the pool, so that
    every connection the pool holds is ended."""
    db = connection.settings_dict
    with psycopg.connect(
        dbname=db["NAME"], user=db["USER"], password=db["PASSWORD"], host=db["HOST"],
        port=db["PORT"] or None, autocommit=True,
    ) as other:  # fmt: skip
        ended = other.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchall()
    assert ended, "the request left no connection open"


def test_the_rest_api_answers_on_a_new_connection_after_the_server_ended_the_old_one() -> None:
    token = create_token("vera", Role.VIEWER)
    headers = {"AUTHORIZATION": f"Bearer {token}"}
    status, _, _ = call("/api/v1/pods/default/p/why", method="GET", headers=headers)
    assert status.startswith("404")  # served: no such pod
    end_the_kept_connections()
    status, _, body = call("/api/v1/pods/default/p/why", method="GET", headers=headers)
    assert status.startswith("404"), (status, body[:300])


def test_the_extender_answers_on_a_new_connection_after_the_server_ended_the_old_one() -> None:
    make_node("n1", cards=1, memory_mib=10000)
    status, _, body = call("/scheduler/filter", filter_args(gpu_pod("p"), ["n1"]))
    assert status.startswith("200") and json.loads(body)["NodeNames"] == ["n1"], body
    end_the_kept_connections()
    status, _, body = call("/scheduler/filter", filter_args(gpu_pod("q"), ["n1"]))
    assert status.startswith("200") and json.loads(body)["NodeNames"] == ["n1"], body


def test_a_pool_full_of_dead_connections_serves_the_next_request_within_seconds() -> None:
    # A burst grows the pool to its size; after a restart every one of them is dead. The check
    # that finds the first dead one drops the others with it, so the request waits out one
    # backoff step rather than one per dead connection (which ran past the pool's timeout: 500).
    pool = connection.pool
    assert pool is not None, "PostgreSQL runs with Django's connection pool"
    pool.open()
    size = django_settings.DATABASES["default"]["OPTIONS"]["pool"]["max_size"]
    held = [pool.getconn() for _ in range(size)]
    for conn in held:
        pool.putconn(conn)
    assert pool.get_stats()["pool_available"] == size
    end_the_kept_connections()
    began = time.monotonic()
    status, _, body = call("/readyz", method="GET")
    waited = time.monotonic() - began
    assert status.startswith("200"), (status, body[:300])
    assert waited < 5, f"the first request after the restart waited {waited:.1f} s"
    start = time.monotonic()
    assert call("/readyz", method="GET")[0].startswith("200")
    assert time.monotonic() - start < 1, "the second request met a dead connection too"


def unschedulable(name: str) -> DecisionRecord:
    return DecisionRecord(
        f"uid-{name}", "default", name, Outcome.UNSCHEDULABLE, "0 of 1 nodes can hold it.",
        [], {"n1": "no room"}, {"InsufficientMemory": 1}, 1,
    )  # fmt: skip


def test_the_decision_log_writes_its_next_batch_on_a_new_connection(settings) -> None:
    # Its own thread takes a connection from the pool for each batch; a batch that failed on a
    # dead one would be dropped, and the pods it named would have no "why" until filtered again
    # (minutes, for a pod the scheduler has set aside as unschedulable).
    settings.TESSERA = {**settings.TESSERA, "DECISION_LOG_ASYNC": True}
    try:
        decision_writer.record(unschedulable("before"))
        decision_writer.writer.flush()
        assert SchedulingDecision.objects.filter(name="before").exists()
        with connection.cursor() as cursor:  # the pool's others, the writer's among them
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
