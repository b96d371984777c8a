"""Small helpers for the few hand-written SQL statements on the hot paths.

Where (and why) the project writes SQL by hand: `controlplane/ledger/sql.py` (bind's critical
section, snapshot reads) and the embedded API-server stand-in, `controlplane/kube/embedded.py`.
The ORM costs 0.3-1 ms of CPU to compile a statement; these paths run several per scheduled pod
in one process. Statements are assembled from the models' own table and column names (nothing is
typed twice), every value is a parameter, and they run through Django's connection and cursors,
so transactions, query counting and both database backends behave as for ORM queries. Only the
public APIs of Django and psycopg are used.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

from django.db import DEFAULT_DB_ALIAS, connection
from django.db.models import Model, QuerySet


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


def fetch_in_order(statements: Sequence[tuple[str, Sequence[Any]]]) -> list[list[tuple[Any, ...]]]:
    """Run several statements one after another; the rows of each (none for a write without
    RETURNING).

    On PostgreSQL they travel in one round trip, on psycopg's pipeline through Django's own
    cursors (so query logging, execute wrappers and errors are Django's, in tests as in
    production): the server still runs them in order, each on a snapshot taken when it starts,
    so a row lock taken by one statement is held, and what committed before it was granted is
    seen, by the next. An error in any of them is raised once all were answered, as Django's
    exception (`IntegrityError`, ...). On other databases (and a libpq without pipelines) they
    run as separate queries.
    """
    if connection.vendor != "postgresql" or not _pipelines_supported():
        return [fetch(sql, params) for sql, params in statements]
    connection.ensure_connection()
    cursors = [connection.cursor() for _ in statements]
    try:
        with connection.wrap_database_errors, connection.connection.pipeline():
            for cursor, (sql, params) in zip(cursors, statements, strict=True):
                cursor.execute(sql, params)
        return [_rows(cursor) for cursor in cursors]
    finally:
        for cursor in cursors:
            cursor.close()


try:
    from psycopg import Pipeline
    from psycopg.pq import ExecStatus

    _TUPLES_OK = ExecStatus.TUPLES_OK
except ImportError:  # pragma: no cover - SQLite-only installs
    Pipeline, _TUPLES_OK = None, None


@functools.cache
def _pipelines_supported() -> bool:
    return Pipeline is not None and bool(Pipeline.is_supported())


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


def rows_of(qs: QuerySet[Any]) -> list[tuple[Any, ...]]:
    """Rows of a `values_list` queryset, fetched without Django's per-value converters.

    At cluster scale (8,000 cards, 20,000 slices) the converters cost more than the query. Only
    for columns whose database values are already what the caller needs: integers, text, and
    booleans used as truth values (SQLite gives 0/1). The SQL is still built by the ORM, and the
    query still goes through Django's cursor (so query counting sees it). The SQL comes from
    the query's public `sql_with_params()`, which compiles it for the default database: the
    only one the control plane has, which the assertion keeps true.
    """
    assert qs.db == DEFAULT_DB_ALIAS, f"rows_of compiles for {DEFAULT_DB_ALIAS!r}, not {qs.db!r}"
    sql, params = qs.query.sql_with_params()
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()
