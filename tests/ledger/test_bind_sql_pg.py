"""Bind's SQL on PostgreSQL: the hot statements are prepared once per connection, and the
locked reads travel in one pipeline (psycopg's, through Django's cursors) yet still run in lock
order."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from controlplane import rawsql
from controlplane.ledger import sql
from controlplane.ledger.services import bindings
from controlplane.scheduling import parse_pod
from tests.builders import make_node, using_postgres
from tests.pods import gpu_container, pod_json

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


def _prepared(prefix: str = "") -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT statement FROM pg_prepared_statements WHERE name LIKE %s", (f"{prefix}%",)
        )
        return [row[0] for row in cursor.fetchall()]


def test_reservations_prepare_their_statements_after_a_few_runs() -> None:
    make_node("n1", cards=1, memory_mib=80000)
    for i in range(8):
        bindings.bind_pod(_request(f"pod-{i}"), "n1")

    # prepared by psycopg past its prepare_threshold (server-side binding, settings.py)
    prepared = _prepared("_pg3_")
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
                locked = sql.lock_and_read("default", "n1", "nobody")
                holder_locked.set()
                release.wait(10)
                now = timezone.now()
                values = {
                    "pod_uid": "first", "namespace": "default", "name": "first",
                    "node": locked.node.pk, "phase": "reserved", "reason": "", "request": {},
                    "deadline": None, "reserved_at": now, "created_at": now, "updated_at": now,
                }  # fmt: skip
                slices = [
                    sql.NewSlice(locked.cards[0].pk, "main", 0, False, 1000, 0, False, None, "",
                                 None, None)
                ]  # fmt: skip
                sql.insert_binding(values, slices)  # writes under the lock
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
    time.sleep(0.6)  # the reader is now blocked on the node's row lock (a loaded machine may
    release.set()  # start it late: the wait it measures is then shorter than this sleep)
    for thread in threads:
        thread.join(20)

    assert seen["waited"] >= 0.25  # it waited for the lock ...
    assert seen["slices"] == 1 and seen["binding"] is not None  # ... and read after it


def test_an_error_inside_the_pipeline_is_djangos_and_leaves_the_connection_usable() -> None:
    from django.db import IntegrityError

    make_node("n1", cards=1, memory_mib=80000)
    bindings.bind_pod(_request("twin"), "n1")
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


def test_a_failed_statement_in_the_pipeline_commits_nothing() -> None:
    from django.db import IntegrityError

    rawsql.fetch_in_order([_insert("twin")])
    with pytest.raises(IntegrityError), transaction.atomic():
        rawsql.fetch_in_order([_insert("other"), _insert("twin")])
    assert not _seen_elsewhere("other")
    assert rawsql.fetch("SELECT 2", ()) == [(2,)]


def test_a_reservation_writes_its_binding_and_slices_in_one_statement() -> None:
    make_node("n1", cards=2, memory_mib=80000)
    pod = pod_json("two", containers=[gpu_container("main", mem=1000, gpus=2)])
    pod["metadata"]["uid"] = "two"
    reservation = bindings.bind_pod(parse_pod(pod), "n1")
    rows = rawsql.fetch(
        "SELECT binding_id, container_name, memory_mib, active FROM ledger_slice ORDER BY id", ()
    )
    binding_id = reservation.binding_id
    assert rows == [(binding_id, "main", 1000, True), (binding_id, "main", 1000, True)]


def test_the_pipeline_returns_what_a_cursor_returns() -> None:
    """Types as psycopg's cursor loads them (Django's adapters), NULLs, no rows, and values
    of every width."""
    statements = [
        ("SELECT %s::int, %s::bigint, %s, %s::bool, %s::timestamptz, %s::jsonb, NULL::text",
         (7, 2**40, "täxt", True, "2026-12-02T01:02:03+00:00", '{"a": [1, 2]}')),
        ("SELECT 1 WHERE false", ()),
        ("SELECT g, g * 2 FROM generate_series(1, %s) AS g", (3,)),
    ]  # fmt: skip
    expected = [rawsql.fetch(sql, params) for sql, params in statements]
    for _ in range(2):
        with transaction.atomic():
            assert rawsql.fetch_in_order(statements) == expected
    assert expected[2] == [(1, 2), (2, 4), (3, 6)]


def test_a_bad_statement_in_the_pipeline_is_djangos_error_and_the_next_call_works() -> None:
    from django.db import ProgrammingError

    for _ in range(2):
        with pytest.raises(ProgrammingError, match="no_such_table"), transaction.atomic():
            rawsql.fetch_in_order([("SELECT 1", ()), ("SELECT * FROM no_such_table", ())])
    with transaction.atomic():
        assert rawsql.fetch_in_order([("SELECT %s::int", (5,))]) == [[(5,)]]


def test_the_pipelines_statements_are_seen_by_djangos_query_log_and_wrappers() -> None:
    """The same branch in tests and in production: what runs in the pipeline goes through
    Django's cursors, so an execute wrapper (the tests' ledger guard) and the query log see it."""
    from django.test.utils import CaptureQueriesContext

    seen: list[str] = []

    def wrapper(execute, sql, params, many, context):  # type: ignore[no-untyped-def]
        seen.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(wrapper), transaction.atomic():
        rawsql.fetch_in_order([("SELECT %s::int", (1,)), ("SELECT %s::int + 1", (1,))])
    assert seen == ["SELECT %s::int", "SELECT %s::int + 1"]
    with CaptureQueriesContext(connection) as queries, transaction.atomic():
        assert rawsql.fetch_in_order([("SELECT %s::int", (7,))]) == [[(7,)]]
    assert any("SELECT 7::int" in q["sql"] or "SELECT %s::int" in q["sql"] for q in queries)
