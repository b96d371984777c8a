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
import itertools
import select
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from django.conf import settings
from django.db import connection, connections
from django.db.models import Model, QuerySet

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


def fetch_in_order(statements: Sequence[tuple[str, Sequence[Any]]]) -> list[list[tuple[Any, ...]]]:
    """Run several statements one after another; the rows of each (none for a write without
    RETURNING).

    On PostgreSQL they travel in one round trip (a pipeline): the server still runs them in
    order, each on a snapshot taken when it starts, so a row lock taken by one statement is
    held, and what committed before it was granted is seen, by the next. An error in any of them
    is raised once all were answered, as Django's exception (`IntegrityError`, ...). On other
    databases (and a libpq without pipelines) they run as separate queries.

    `TESSERA["DB_LIBPQ_PIPELINE"]` picks, inside an atomic block, libpq's pipeline driven from
    its C calls (`_libpq_pipeline`, below) over psycopg's own pipeline through Django's cursors.
    """
    if connection.vendor != "postgresql" or not _pipelines_supported():
        return [fetch(sql, params) for sql, params in statements]
    connection.ensure_connection()
    conn = connection.connection
    if (
        settings.TESSERA.get("DB_LIBPQ_PIPELINE", True)
        and connection.in_atomic_block
        and not connection.queries_logged
        and conn.prepare_threshold is not None
        and hasattr(conn, "_deallocate")  # see _prepared_names
    ):
        queries = [_numbered(sql) for sql, _ in statements]
        if all(q is not None for q in queries):
            with connection.wrap_database_errors:
                return _libpq_pipeline(
                    conn,
                    [(q, params) for q, (_, params) in zip(queries, statements, strict=True)],
                    False,
                )
    cursors = [connection.cursor() for _ in statements]
    try:
        with connection.wrap_database_errors, conn.pipeline():
            for cursor, (sql, params) in zip(cursors, statements, strict=True):
                cursor.execute(sql, params)
        return [_rows(cursor) for cursor in cursors]
    finally:
        for cursor in cursors:
            cursor.close()


# --- bind's round trips on libpq's own pipeline ------------------------------------------------
#
# psycopg's pipeline and cursor machinery is Python: in the scheduler's sidecar it took a fifth
# of the GIL's time, more than the fit and the JSON together, for bind's two round trips. The
# path below drives the same libpq pipeline from its C calls (psycopg's `pq` wrapper), with
# psycopg's own Transformer to dump parameters and load rows (so values come back exactly as a
# cursor gives them) and its error classes: a quarter of the client CPU of the same statements
# through cursors. It runs inside an atomic block only (it sends BEGIN when the transaction has
# not started, as psycopg would), prepares each statement once per connection (as psycopg does
# after `prepare_threshold` runs; a pooler that cannot keep prepared statements turns both off),
# and holds the connection's lock while it talks, as psycopg does.

_PREPARED_MAX = 128  # distinct statements prepared per connection; more run unprepared
_NAMES = itertools.count()


@functools.lru_cache(maxsize=512)
def _numbered(sql: str) -> bytes | None:
    """The statement with `%s` as `$1, $2, ...` (libpq's placeholders); None for a statement
    with other `%` sequences (left to psycopg)."""
    parts = sql.split("%s")
    if any("%" in part for part in parts):
        return None
    out = [parts[0]]
    for i, part in enumerate(parts[1:], 1):
        out.append(f"${i}{part}")
    return "".join(out).encode()


def _libpq_pipeline(
    conn: Any, statements: Sequence[tuple[bytes, Sequence[Any]]], commit: bool
) -> list[list[tuple[Any, ...]]]:
    status = pq.ExecStatus
    with conn.lock:
        pg = conn.pgconn
        cache = _prepared_names(conn)
        tx = Transformer(conn)
        sends = []
        for query, params in statements:
            values = tx.dump_sequence(params, [PyFormat.AUTO] * len(params))
            sends.append((query, values, tx.types, tx.formats))
        ops: list[tuple[str, Any]] = []  # ("begin" | "prepare" | "run" | "commit", key)
        pg.enter_pipeline_mode()
        try:
            if pg.transaction_status == pq.TransactionStatus.IDLE:
                pg.send_query_params(b"BEGIN", None)
                ops.append(("begin", None))
            for query, values, types, formats in sends:
                key = (query, types)
                name = cache.get(key)
                if name is None and len(cache) < _PREPARED_MAX:
                    name = f"_tessera_{next(_NAMES)}".encode()  # never one a server may hold
                    pg.send_prepare(name, query, param_types=types)
                    ops.append(("prepare", key))
                    cache[key] = name  # forgotten again below if the PREPARE failed
                if name is None:
                    pg.send_query_params(query, values, param_formats=formats, param_types=types)
                else:
                    pg.send_query_prepared(name, values, param_formats=formats)
                ops.append(("run", None))
            if commit:
                pg.send_query_params(b"COMMIT", None)
                ops.append(("commit", None))
            pg.pipeline_sync()
            results = _pipeline_results(pg, status.PIPELINE_SYNC)
        finally:
            if pg.pipeline_status != pq.PipelineStatus.OFF:
                try:
                    pg.exit_pipeline_mode()
                except errors.OperationalError:  # cut off with results pending: unusable now
                    conn.close()  # Django opens a new connection for the next request
        failure = None
        rows: list[list[tuple[Any, ...]]] = []
        for (kind, key), result in zip(ops, results, strict=True):
            if result.status in (status.FATAL_ERROR, status.PIPELINE_ABORTED):
                if kind == "prepare":
                    cache.pop(key, None)
                if failure is None and result.status == status.FATAL_ERROR:
                    failure = result
                continue
            if kind == "run":
                if result.status == status.TUPLES_OK:
                    tx.set_pgresult(result)
                    rows.append(tx.load_rows(0, result.ntuples, tuple))
                else:
                    rows.append([])
        if failure is not None:
            error = errors.error_from_result(failure, encoding=conn.info.encoding)
            if isinstance(error, errors.InvalidSqlStatementName):
                cache.clear()  # deallocated behind our back: prepare again next time
            raise error
        return rows


def _prepared_names(conn: Any) -> dict[tuple[bytes, Any], bytes]:
    """This connection's statements prepared by `_libpq_pipeline`, by (query, types).

    psycopg sends DEALLOCATE ALL after a rollback (and a DROP or ALTER) while it holds prepared
    statements of its own, which takes ours with them: its deallocation hook forgets ours too.
    """
    cache = getattr(conn, "_tessera_prepared", None)
    if cache is None:
        cache = conn._tessera_prepared = {}
        deallocate, owner = type(conn)._deallocate, weakref.ref(conn)  # no cycle through conn

        def deallocate_and_forget(name: bytes | None) -> Any:
            if name is None:
                cache.clear()
            return deallocate(owner(), name)

        conn._deallocate = deallocate_and_forget
    return cache


def _pipeline_results(pg: Any, sync: Any) -> list[Any]:
    """Every result up to the pipeline's sync, in order. Waits on the socket (outside the GIL)
    whenever libpq would block: `get_result` is only called when it will not."""
    poller = select.poll()
    poller.register(pg.socket, select.POLLIN)
    while pg.flush():  # non-blocking connection: what did not fit is sent as the socket drains
        writer = select.poll()
        writer.register(pg.socket, select.POLLOUT)
        writer.poll()
    results = []
    idle = 0  # one None ends each statement's results; two in a row: nothing more will come
    while True:
        while pg.is_busy():
            poller.poll()
            pg.consume_input()
        result = pg.get_result()
        if result is None:
            idle += 1
            if idle > 1:
                message = pg.get_error_message() or "no answer"
                raise errors.OperationalError(f"the pipeline ended early: {message}")
            continue
        idle = 0
        if result.status == sync:
            return results
        results.append(result)


try:
    from psycopg import errors, pq
    from psycopg.adapt import PyFormat, Transformer
    from psycopg.pq import ExecStatus

    _TUPLES_OK = ExecStatus.TUPLES_OK
except ImportError:  # pragma: no cover - SQLite-only installs
    _TUPLES_OK = None


@functools.cache
def _pipelines_supported() -> bool:
    import psycopg

    return bool(psycopg.Pipeline.is_supported())


def rows_of(qs: QuerySet[Any]) -> list[tuple[Any, ...]]:
    """Rows of a `values_list` queryset, fetched without Django's per-value converters.

    At cluster scale (8,000 cards, 20,000 slices) the converters cost more than the query. Only
    for columns whose database values are already what the caller needs: integers, text, and
    booleans used as truth values (SQLite gives 0/1). The SQL is still built by the ORM, and the
    query still goes through Django's cursor (so query counting sees it).
    """
    sql, params = qs.query.get_compiler(using=qs.db).as_sql()
    with connections[qs.db].cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.fetchall()


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
