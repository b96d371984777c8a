"""Bind's SQL on PostgreSQL: the hot statements are prepared once per connection, and the
locked reads travel in one pipeline yet still run in lock order."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction

from controlplane import rawsql
from controlplane.ledger import services, sql
from controlplane.scheduling import parse_pod
from tests.builders import gpu_container, make_node, pod_json, using_postgres

pytestmark = [
    pytest.mark.postgres,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        not using_postgres(), reason="needs DATABASE_URL=postgres://... (make test runs it)"
    ),
]


def _request(uid: str):
    pod = pod_json(uid, containers=[gpu_container("main", mem=1000)])
    pod["metadata"]["uid"] = uid
    return parse_pod(pod)


def _prepared() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT statement FROM pg_prepared_statements")
        return [row[0] for row in cursor.fetchall()]


def test_reservations_prepare_their_statements_after_a_few_runs() -> None:
    make_node("n1", cards=1, memory_mib=80000)
    for i in range(8):
        services.reserve_binding(_request(f"pod-{i}"), "n1")

    prepared = _prepared()
    assert any("FOR UPDATE" in text and "ledger_node" in text for text in prepared), prepared
    # the binding and its slices: one statement
    assert any(
        text.startswith("WITH b AS (INSERT INTO") and "ledger_slice" in text for text in prepared
    ), prepared


def test_the_pipelined_reads_wait_for_the_node_lock_and_see_what_its_holder_wrote() -> None:
    make_node("n1", cards=1, memory_mib=80000)
    holder_locked, release = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def holder() -> None:
        try:
            with transaction.atomic():
                sql.lock_and_read("default", "n1", "nobody")
                holder_locked.set()
                release.wait(10)
                services.reserve_binding(_request("first"), "n1")  # writes under the lock
        finally:
            connections.close_all()

    def reader() -> None:
        try:
            holder_locked.wait(10)
            with transaction.atomic():
                started = time.monotonic()
                locked = sql.lock_and_read("default", "n1", "first")
                seen["waited"] = time.monotonic() - started
                seen["slices"], seen["binding"] = len(locked.slices), locked.binding_id
        finally:
            connections.close_all()

    threads = [threading.Thread(target=holder), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    holder_locked.wait(10)
    time.sleep(0.3)  # the reader is now blocked on the node's row lock
    release.set()
    for thread in threads:
        thread.join(20)

    assert seen["waited"] >= 0.25  # it waited for the lock ...
    assert seen["slices"] == 1 and seen["binding"] is not None  # ... and read after it


def test_an_error_inside_the_pipeline_is_djangos_and_leaves_the_connection_usable() -> None:
    from django.db import IntegrityError

    make_node("n1", cards=1, memory_mib=80000)
    services.reserve_binding(_request("twin"), "n1")
    with pytest.raises(IntegrityError), transaction.atomic():
        rawsql.fetch_in_order(
            [("SELECT 1", ()), ("INSERT INTO ledger_podbinding (pod_uid) VALUES ('twin')", ())]
        )
    assert rawsql.fetch("SELECT 2", ()) == [(2,)]


def _seen_elsewhere(pod_uid: str) -> bool:
    """Whether another connection sees the pod's binding (committed)."""
    seen: list[bool] = []

    def look() -> None:
        try:
            seen.append(bool(rawsql.fetch(
                "SELECT 1 FROM ledger_podbinding WHERE pod_uid = %s", (pod_uid,)
            )))  # fmt: skip
        finally:
            connections.close_all()

    thread = threading.Thread(target=look)
    thread.start()
    thread.join(10)
    return seen[0]


def _insert(uid: str) -> tuple[str, tuple[str, ...]]:
    return ("INSERT INTO ledger_podbinding (pod_uid, namespace, name, phase, reason, request, "
            "created_at, updated_at) VALUES (%s, 'default', %s, 'reserved', '', '{}', now(), "
            "now())", (uid, uid))  # fmt: skip


def test_the_last_statements_of_the_outermost_block_carry_its_commit() -> None:
    with transaction.atomic():
        rawsql.fetch_in_order([_insert("early")], commit=True)
        assert _seen_elsewhere("early")  # committed before the block ends
    with transaction.atomic(), transaction.atomic():  # nested: the outer block commits
        rawsql.fetch_in_order([_insert("nested")], commit=True)
        assert not _seen_elsewhere("nested")
    assert _seen_elsewhere("nested")
    with transaction.atomic():
        rawsql.fetch_in_order([_insert("plain")])
        assert not _seen_elsewhere("plain")
    assert rawsql.fetch("SELECT 2", ()) == [(2,)]


def test_a_failed_statement_before_the_commit_commits_nothing() -> None:
    from django.db import IntegrityError

    rawsql.fetch_in_order([_insert("twin")])
    with pytest.raises(IntegrityError), transaction.atomic():
        rawsql.fetch_in_order([_insert("other"), _insert("twin")], commit=True)
    assert not _seen_elsewhere("other")
    assert rawsql.fetch("SELECT 2", ()) == [(2,)]


def test_a_reservation_writes_its_binding_and_slices_in_one_statement() -> None:
    make_node("n1", cards=2, memory_mib=80000)
    pod = pod_json("two", containers=[gpu_container("main", mem=1000, gpus=2)])
    pod["metadata"]["uid"] = "two"
    binding = services.reserve_binding(parse_pod(pod), "n1")
    rows = rawsql.fetch(
        "SELECT binding_id, container_name, memory_mib, active FROM ledger_slice ORDER BY id", ()
    )
    assert rows == [(binding.pk, "main", 1000, True), (binding.pk, "main", 1000, True)]
