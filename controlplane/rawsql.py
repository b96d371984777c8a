"""Small helpers for the few hand-written SQL statements on the hot paths.

Where (and why) the project writes SQL by hand: `controlplane/ledger/sql.py` (bind's critical
section, snapshot reads) and the embedded API-server stand-in in `controlplane/kube.py`. The
ORM costs 0.3-1 ms of CPU to compile a statement; these paths run several per scheduled pod in
one process. Statements are assembled from the models' own table and column names (nothing is
typed twice), every value is a parameter, and they run through Django's connection, so
transactions, query counting and both database backends behave as for ORM queries.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from django.db import connection
from django.db.models import Model

M = TypeVar("M", bound=Model)


def table(model: type[Model]) -> str:
    return connection.ops.quote_name(model._meta.db_table)


def column(model: type[Model], field: str, alias: str = "") -> str:
    name = connection.ops.quote_name(model._meta.get_field(field).column)
    return f"{alias}.{name}" if alias else name


def columns(model: type[Model], fields: Sequence[str], alias: str = "") -> str:
    return ", ".join(column(model, f, alias) for f in fields)


def placeholders(n: int) -> str:
    return "(" + ", ".join(["%s"] * n) + ")"


def for_update() -> str:
    """Row lock suffix. SQLite has no row locks: its transactions take the database's write
    lock at BEGIN (IMMEDIATE, see settings), which serialises writers just the same."""
    return " FOR UPDATE" if connection.features.has_select_for_update else ""


def per_vendor(build: Callable[[], dict[str, str]]) -> Callable[[], dict[str, str]]:
    """Build a module's statements once per database vendor (quoting and locking differ)."""
    cached = functools.cache(lambda vendor: build())
    return lambda: cached(connection.vendor)


def fetch(sql: str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
    """The statement's rows (none for a write without RETURNING)."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return _rows(cursor)


def _rows(cursor: Any) -> list[tuple[Any, ...]]:
    """All rows of the cursor's result; [] for a statement that returns none. On PostgreSQL
    this asks the result's status: psycopg's `description` builds a column object per column
    on every access (a quarter of bind's locked read went there)."""
    result = getattr(cursor, "pgresult", None)
    if result is not None:
        return cursor.fetchall() if result.status == _TUPLES_OK else []
    return cursor.fetchall() if cursor.description else []


def fetch_in_order(
    statements: Sequence[tuple[str, Sequence[Any]]], *, commit: bool = False
) -> list[list[tuple[Any, ...]]]:
    """Run several statements one after another; the rows of each (none for a write without
    RETURNING).

    On PostgreSQL they travel in one round trip (a libpq pipeline): the server still runs them
    in order, each on a snapshot taken when it starts, so a row lock taken by one statement is
    held, and what committed before it was granted is seen, by the next. An error in any of them
    is raised once all were answered, as Django's exception (`IntegrityError`, ...). On other
    databases (and a libpq without pipelines) they run as separate queries.

    `commit`: these are the last statements of the outermost `atomic` block, and its COMMIT
    goes in the same round trip (PostgreSQL only; Django's own commit at the block's end then
    finds the transaction done). Inside a nested block (a savepoint) the commit is left to the
    outer block, as always. Nothing may run in the block after them.

    Unless Django logs queries (DEBUG, the tests' query counters), the statements go through
    psycopg's own cursors: Django's cursor wrapper costs more CPU than the statement's round
    trip on this path.
    """
    if connection.vendor != "postgresql" or not _pipelines_supported():
        return [fetch(sql, params) for sql, params in statements]
    connection.ensure_connection()
    conn = connection.connection
    early_commit = (
        commit
        and len(connection.atomic_blocks) == 1
        and not connection.savepoint_ids
        and not connection.needs_rollback
    )
    cursors = []
    try:
        with connection.wrap_database_errors:
            with conn.pipeline():
                for sql, params in statements:
                    cursor = connection.cursor() if connection.queries_logged else conn.cursor()
                    cursors.append(cursor)
                    cursor.execute(sql, params)
                if early_commit:
                    conn.commit()
            return [_rows(cursor) for cursor in cursors]
    finally:
        for cursor in cursors:
            cursor.close()


try:
    from psycopg.pq import ExecStatus

    _TUPLES_OK = ExecStatus.TUPLES_OK
except ImportError:  # pragma: no cover - SQLite-only installs
    _TUPLES_OK = None


@functools.cache
def _pipelines_supported() -> bool:
    import psycopg

    return bool(psycopg.Pipeline.is_supported())


def execute(sql: str, params: Sequence[Any]) -> int:
    """Run a write; the number of rows it changed."""
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return int(cursor.rowcount)


def insert_returning_id(sql: str, params: Sequence[Any], id_column: str) -> int:
    """Run an INSERT of one row; its new id."""
    with connection.cursor() as cursor:
        if connection.features.can_return_columns_from_insert:
            cursor.execute(f"{sql} RETURNING {id_column}", params)
            return int(cursor.fetchone()[0])
        cursor.execute(sql, params)
        return int(cursor.lastrowid)


def db_value(model: type[Model], field: str, value: Any) -> Any:
    """A Python value as the field would send it to this database (datetimes, JSON, FKs)."""
    return model._meta.get_field(field).get_db_prep_save(value, connection)


def loaded(instance: M) -> M:
    """Mark a model instance built from values just written as a row in the database (so a
    later `save()` updates it)."""
    instance._state.adding, instance._state.db = False, connection.alias
    return instance
