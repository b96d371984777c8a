"""Hand-written SQL for the ledger's two hot paths: bind's critical section and snapshot reads.

Why not the ORM here (controlplane/rawsql.py): compiling a queryset costs 0.3-1 ms of CPU per
statement, a round trip to PostgreSQL on loopback about 40 µs. Bind runs its statements under
the node's row lock and the scheduler's binds are served by one process (one GIL), so that CPU
was most of a burst's time (docs/extender.md, "Performance"). Everything else keeps the ORM.
Only the ledger's own modules (selectors, usage, services) call these functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, NamedTuple, TypeVar

from django.db import connection
from django.utils import timezone

from controlplane import rawsql
from controlplane.ledger.models import (
    Card,
    NamespaceQuota,
    Node,
    Nomination,
    PodBinding,
    SchedulingDecision,
    Slice,
)
from controlplane.rawsql import column, columns, table
from controlplane.scheduling import QuotaLimits

R = TypeVar("R")


class NodeRow(NamedTuple):
    pk: int
    name: str
    ready: bool
    cordoned: bool
    memory_factor: int = 100  # the node's default oversubscription factor, hundredths
    spill_reserve_mib: int = 0  # host memory set aside for spilled slices


class CardRow(NamedTuple):
    """The columns of a card that the scheduling core needs (attribute names as on `Card`)."""

    pk: int
    node_id: int
    uuid: str
    index: int
    model: str
    memory_mib: int
    compute_units: int
    slots: int
    numa_node: int | None
    healthy: bool
    health_reason: str
    cordoned: bool
    present: bool
    mode: str
    pending_mode: str  # blank, or the mode a change waits for: the card is draining
    mig_enabled: bool
    memory_factor: int | None = None  # the operator's factor (hundredths); None: the node's


class SliceRow(NamedTuple):
    """An active slice as the core folds it (`LedgerSlice`)."""

    binding_id: int
    card_id: int
    container_index: int
    init: bool
    memory_mib: int
    cores: int
    sidecar: bool
    mig_start: int | None  # a MIG instance's placement; None for other slices
    mig_size: int | None
    resident_mib: int | None = None  # the part that stays on the card; None: all of it


class NewSlice(NamedTuple):
    """An active slice to insert for a binding (`insert_binding`, `insert_slices`). Its fields,
    in order, are the INSERT's columns after the binding's (`SLICE_VALUES`)."""

    card_id: int
    container_name: str
    container_index: int
    init: bool
    memory_mib: int
    cores: int
    sidecar: bool
    priority: int | None
    mig_profile: str
    mig_start: int | None  # NULL, as the size, for a slice that is no MIG instance
    mig_size: int | None
    resident_mib: int | None = None  # NULL: the slice stays on the card in full


# The Slice field each `NewSlice` field writes, where the names differ.
_NEW_SLICE_FIELDS = {"card_id": "card", "init": "init_container", "cores": "compute_percent"}
SLICE_VALUES = tuple(_NEW_SLICE_FIELDS.get(f, f) for f in NewSlice._fields)

_NODE = ("id", "name", "ready", "cordoned", "memory_factor", "spill_reserve_mib")
_CARD = ("id", "node", "uuid", "index", "model", "memory_mib", "compute_units", "slots",
         "numa_node", "healthy", "health_reason", "cordoned", "present", "mode", "pending_mode",
         "mig_enabled", "memory_factor")  # fmt: skip
_SLICE = ("binding", "card", "container_index", "init_container", "memory_mib", "compute_percent",
          "sidecar", "mig_start", "mig_size", "resident_mib")  # fmt: skip
BINDING_INSERT = ("pod_uid", "namespace", "name", "node", "phase", "reason", "request",
                  "deadline", "reserved_at", "created_at", "updated_at")  # fmt: skip
DECISION = ("pod_uid", "namespace", "name", "outcome", "summary", "feasible_nodes",
            "node_reasons", "reason_counts", "nodes_considered", "decided_at")  # fmt: skip
# The binding first, "active" and "created_at" last: the rest are a caller's `NewSlice`.
_SLICE_INSERT = ("binding", *SLICE_VALUES, "active", "created_at")


@rawsql.per_vendor
def _statements() -> dict[str, str]:
    node, card, slc, binding, quota = (
        table(Node), table(Card), table(Slice), table(PodBinding), table(NamespaceQuota)
    )  # fmt: skip
    card_node = f"{column(Card, 'node', 'c')} = {column(Node, 'id', 'n')}"
    slice_card = f"{column(Slice, 'card', 's')} = {column(Card, 'id', 'c')}"
    active = f"{column(Slice, 'active', 's')} = %s"
    by_uid = f"{column(PodBinding, 'pod_uid', 'b')} = %s"
    named = f"{column(Node, 'name', 'n')} IN {{names}}"  # filled in by _read
    lock = rawsql.for_update()
    return {
        "nodes": f"SELECT {columns(Node, _NODE, 'n')} FROM {node} n",
        "nodes_of": f"SELECT {columns(Node, _NODE, 'n')} FROM {node} n WHERE {named}",
        "cards": f"SELECT {columns(Card, _CARD, 'c')} FROM {card} c",
        "cards_of": (
            f"SELECT {columns(Card, _CARD, 'c')} FROM {card} c JOIN {node} n ON {card_node} "
            f"WHERE {named}"
        ),
        "slices": f"SELECT {columns(Slice, _SLICE, 's')} FROM {slc} s WHERE {active}",
        "slices_of": (
            f"SELECT {columns(Slice, _SLICE, 's')} FROM {slc} s JOIN {card} c ON {slice_card} "
            f"JOIN {node} n ON {card_node} WHERE {active} AND {named}"
        ),
        "node_cards_and_slices": (
            f"SELECT {columns(Card, _CARD, 'c')}, {columns(Slice, _SLICE, 's')}, "
            f"(SELECT {column(PodBinding, 'id', 'b')} FROM {binding} b WHERE {by_uid}) "
            f"FROM {card} c JOIN {node} n ON {card_node} "
            f"LEFT JOIN {slc} s ON {slice_card} AND {active} "
            f"WHERE {column(Node, 'name', 'n')} = %s"
        ),
        "lock_quota": (
            f"SELECT {columns(NamespaceQuota, ('gpumem_mib', 'gpucores', 'gpus'), 'q')} "
            f"FROM {quota} q WHERE {column(NamespaceQuota, 'namespace', 'q')} = %s{lock}"
        ),
        "lock_node": (
            f"SELECT {columns(Node, _NODE, 'n')} FROM {node} n "
            f"WHERE {column(Node, 'name', 'n')} = %s{lock}"
        ),
        "binding_id": f"SELECT {column(PodBinding, 'id', 'b')} FROM {binding} b WHERE {by_uid}",
        # Room held for pods whose preemption is under way: on one node (bind, which also
        # wants the binding pod's own nomination wherever it is), or on named nodes.
        "held_for_bind": (
            f"SELECT {column(Nomination, 'pod_uid', 'h')}, {column(Nomination, 'claims', 'h')} "
            f"FROM {table(Nomination)} h JOIN {node} n "
            f"ON {column(Nomination, 'node', 'h')} = {column(Node, 'id', 'n')} "
            f"WHERE ({column(Node, 'name', 'n')} = %s "
            f"OR {column(Nomination, 'pod_uid', 'h')} = %s) "
            f"AND {column(Nomination, 'deadline', 'h')} > %s"
        ),
        "held": (
            f"SELECT {column(Node, 'name', 'n')}, {column(Nomination, 'pod_uid', 'h')}, "
            f"{column(Nomination, 'claims', 'h')} FROM {table(Nomination)} h JOIN {node} n "
            f"ON {column(Nomination, 'node', 'h')} = {column(Node, 'id', 'n')} "
            f"WHERE {column(Nomination, 'deadline', 'h')} > %s"
        ),
        "held_of": (
            f"SELECT {column(Node, 'name', 'n')}, {column(Nomination, 'pod_uid', 'h')}, "
            f"{column(Nomination, 'claims', 'h')} FROM {table(Nomination)} h JOIN {node} n "
            f"ON {column(Nomination, 'node', 'h')} = {column(Node, 'id', 'n')} "
            f"WHERE {column(Nomination, 'deadline', 'h')} > %s AND {named}"
        ),
        "insert_binding": (
            f"INSERT INTO {binding} ({columns(PodBinding, BINDING_INSERT)}) "
            f"VALUES {rawsql.placeholders(len(BINDING_INSERT))}"
        ),
        "insert_slices": f"INSERT INTO {slc} ({columns(Slice, _SLICE_INSERT)}) VALUES ",
        # the binding's id by its pod UID: sent with the binding's INSERT, before its id is known
        "binding_of_uid": (
            f"(SELECT {column(PodBinding, 'id', 'b')} FROM {binding} b WHERE {by_uid})"
        ),
        "changed_since": (
            f"SELECT {column(Node, 'name', 'n')}, NULL, NULL FROM {node} n "
            f"WHERE {column(Node, 'updated_at', 'n')} >= %s "
            f"UNION ALL SELECT {column(Node, 'name', 'n')}, NULL, NULL "
            f"FROM {card} c JOIN {node} n ON {card_node} "
            f"WHERE {column(Card, 'updated_at', 'c')} >= %s "
            f"UNION ALL SELECT {column(Node, 'name', 'n')}, {column(PodBinding, 'pod_uid', 'b')}, "
            f"{column(PodBinding, 'phase', 'b')} FROM {binding} b JOIN {node} n "
            f"ON {column(PodBinding, 'node', 'b')} = {column(Node, 'id', 'n')} "
            f"WHERE {column(PodBinding, 'updated_at', 'b')} >= %s"
        ),
        "counts": f"SELECT (SELECT COUNT(*) FROM {node}), (SELECT COUNT(*) FROM {card})",
        "quotas": (
            f"SELECT {columns(NamespaceQuota, ('namespace', 'gpumem_mib', 'gpucores', 'gpus'))} "
            f"FROM {quota}"
        ),
        "upsert_decisions": (
            f"INSERT INTO {table(SchedulingDecision)} ({columns(SchedulingDecision, DECISION)}) "
            "VALUES {values} "
            f"ON CONFLICT ({column(SchedulingDecision, 'pod_uid')}) DO UPDATE SET "
            + ", ".join(
                f"{column(SchedulingDecision, f)} = EXCLUDED.{column(SchedulingDecision, f)}"
                for f in DECISION[1:]
            )
        ),
        "decisions_bound": (
            f"UPDATE {table(SchedulingDecision)} SET {column(SchedulingDecision, 'outcome')} = %s "
            f"WHERE {column(SchedulingDecision, 'pod_uid')} IN ({{uids}}) "
            f"AND {column(SchedulingDecision, 'outcome')} <> %s"
        ),
        # reserved -> bound for (pod UID, bound at) rows; VALUES' columns are column1, column2
        # in both PostgreSQL and SQLite. The change stamp is the write's time, not the bind's:
        # a confirmation retried after a failure lands later than its Binding.
        "confirm": (
            f"UPDATE {binding} SET {column(PodBinding, 'phase')} = %s, "
            f"{column(PodBinding, 'bound_at')} = v.column2, "
            f"{column(PodBinding, 'deadline')} = NULL, "
            f"{column(PodBinding, 'updated_at')} = %s "
            "FROM (VALUES {values}) AS v "
            f"WHERE {column(PodBinding, 'pod_uid')} = v.column1 "
            f"AND {column(PodBinding, 'phase')} = %s"
        ),
    }


def _sql(name: str) -> str:
    return _statements()[name]


def _node(row: Sequence[Any]) -> NodeRow:
    return NodeRow(row[0], row[1], bool(row[2]), bool(row[3]), row[4], row[5])


def _card(row: Sequence[Any]) -> CardRow:
    return CardRow(
        *row[:9], bool(row[9]), row[10], bool(row[11]), bool(row[12]), row[13], row[14],
        bool(row[15]), row[16],
    )  # fmt: skip


def _slice(row: Sequence[Any]) -> SliceRow:
    return SliceRow(
        row[0], row[1], row[2], bool(row[3]), row[4], row[5], bool(row[6]), row[7], row[8], row[9]
    )


# --- reads ---------------------------------------------------------------------------------------


def _read(
    kind: str,
    names: Sequence[str] | None,
    row: Callable[[Sequence[Any]], R],
    lead: tuple[Any, ...] = (),
) -> list[R]:
    """Rows of statement `kind` (all), or of `kind`_of for the named nodes; one query."""
    if names is None:
        return [row(r) for r in rawsql.fetch(_sql(kind), lead)]
    if not names:
        return []
    sql = _sql(f"{kind}_of").replace("{names}", rawsql.placeholders(len(names)))
    return [row(r) for r in rawsql.fetch(sql, [*lead, *names])]


def nodes(names: Sequence[str] | None = None) -> list[NodeRow]:
    """Nodes by name (all when `names` is None), one query."""
    return _read("nodes", names, _node)


def cards(names: Sequence[str] | None = None) -> list[CardRow]:
    """Cards of the named nodes (all when `names` is None), one query."""
    return _read("cards", names, _card)


def active_slices(names: Sequence[str] | None = None) -> list[SliceRow]:
    """Active slices on the named nodes' cards (all when `names` is None), one query."""
    return _read("slices", names, _slice, (True,))


def held(names: Sequence[str] | None = None) -> list[tuple[str, str, Any]]:
    """(node name, pod UID, claims JSON) of the unexpired nominations on the named nodes (all
    when `names` is None), one query."""
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    return _read("held", names, lambda r: (str(r[0]), str(r[1]), r[2]), (now,))


def changes_since(since: datetime) -> list[tuple[str, str | None, str | None]]:
    """(node name, pod UID, phase) for every binding row changed at or after `since`, and
    (node name, None, None) for every node or card row (one query: the snapshot cache's
    incremental refresh, several times a second)."""
    stamp = connection.ops.adapt_datetimefield_value(since)
    return [tuple(row) for row in rawsql.fetch(_sql("changed_since"), (stamp, stamp, stamp))]


def ledger_counts() -> tuple[int, int]:
    """(nodes, cards) in the ledger, one query."""
    nodes_n, cards_n = rawsql.fetch(_sql("counts"), ())[0]
    return int(nodes_n), int(cards_n)


def quota_limits() -> dict[str, QuotaLimits]:
    """Every namespace quota, one query."""
    return {row[0]: QuotaLimits(*row[1:]) for row in rawsql.fetch(_sql("quotas"), ())}


# --- bind's critical section (inside the caller's transaction) -----------------------------------


class Locked(NamedTuple):
    """What bind's critical section reads under its locks (`lock_and_read`)."""

    quota: QuotaLimits | None  # the namespace's limits (row locked), None without a quota
    node: NodeRow | None  # the node (row locked), None when it is not registered
    cards: list[CardRow]
    slices: list[SliceRow]  # the active slices on those cards
    binding_id: int | None  # the pod's binding row, active or not, if it has one
    # Unexpired nominations (pod UID, claims JSON) on the node, and the pod's own anywhere.
    held: list[tuple[str, Any]] = []


def lock_and_read(namespace: str, node_name: str, pod_uid: str) -> Locked:
    """Lock the namespace's quota row, then the node's row, then read the node's cards, their
    active slices and the pod's binding id, then the room nominations hold there: four
    statements in one round trip on PostgreSQL, run in that order (the lock order `bind_pod`
    documents), the reads after both locks are held (they must see a twin bind's reservation)."""
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    quota_rows, node_rows, card_rows, held_rows = rawsql.fetch_in_order(
        [
            (_sql("lock_quota"), (namespace,)),
            (_sql("lock_node"), (node_name,)),
            (_sql("node_cards_and_slices"), (pod_uid, True, node_name)),
            (_sql("held_for_bind"), (node_name, pod_uid, now)),
        ]
    )
    found: dict[int, CardRow] = {}
    slices: list[SliceRow] = []
    binding_id = None
    width, end = len(_CARD), len(_CARD) + len(_SLICE)
    for row in card_rows:
        if row[0] not in found:
            found[row[0]] = _card(row[:width])
        if row[width] is not None:
            slices.append(_slice(row[width:end]))
        binding_id = row[end]
    if not found:  # a node without cards (or none at all): no row carried the binding's id
        rows = rawsql.fetch(_sql("binding_id"), (pod_uid,))
        binding_id = rows[0][0] if rows else None
    return Locked(
        QuotaLimits(*quota_rows[0]) if quota_rows else None,
        _node(node_rows[0]) if node_rows else None,
        list(found.values()),
        slices,
        binding_id,
        [(str(uid), claims) for uid, claims in held_rows],
    )


def insert_binding(values: dict[str, Any], slices: Sequence[NewSlice]) -> int:
    """INSERT one binding row (`BINDING_INSERT` fields, Python values) and its active slices;
    the binding's new id.

    On PostgreSQL one statement: the slices take their binding's id from the binding INSERT's
    RETURNING, in a CTE."""
    params = [rawsql.db_value(PodBinding, f, values[f]) for f in BINDING_INSERT]
    if slices and connection.vendor == "postgresql":
        statement = _binding_with_slices(len(slices))
        stamp = connection.ops.adapt_datetimefield_value(values["created_at"])
        params.append(stamp)
        for row in slices:
            params.extend(row)
        return int(rawsql.fetch_in_order([(statement, params)])[0][0][0])
    if not connection.features.can_return_columns_from_insert:
        binding_id = rawsql.insert_returning_id(
            _sql("insert_binding"), params, column(PodBinding, "id")
        )
        insert_slices(binding_id, slices, values["created_at"])
        return binding_id
    returning = f"{_sql('insert_binding')} RETURNING {column(PodBinding, 'id')}"
    statements: list[tuple[str, Sequence[Any]]] = [(returning, params)]
    if slices:
        statements.append(_slices_insert(_sql("binding_of_uid"), values["pod_uid"], slices,
                                         values["created_at"]))  # fmt: skip
    return int(rawsql.fetch_in_order(statements)[0][0][0])


@functools.cache
def _binding_with_slices(n: int) -> str:
    """PostgreSQL: the binding INSERT and its `n` slices' INSERT as one statement."""
    values = ", ".join([rawsql.placeholders(len(SLICE_VALUES))] * n)
    given = [f"c{i}" for i in range(len(SLICE_VALUES))]  # card ... mig_size: from VALUES
    # A VALUES column of nothing but NULLs (no slice asked for a priority, no MIG placement)
    # is text to PostgreSQL: the cast gives it the column's type.
    picked = [
        f"CAST(v.{c} AS smallint)"
        if name in ("priority", "mig_start", "mig_size")
        else f"CAST(v.{c} AS integer)"
        if name == "resident_mib"
        else f"v.{c}"
        for c, name in zip(given, SLICE_VALUES, strict=True)
    ]
    return (
        f"WITH b AS ({_sql('insert_binding')} RETURNING {column(PodBinding, 'id')}) "
        f"INSERT INTO {table(Slice)} ({columns(Slice, _SLICE_INSERT)}) "
        f"SELECT b.{column(PodBinding, 'id')}, {', '.join(picked)}, TRUE, %s "
        f"FROM b, (VALUES {values}) AS v ({', '.join(given)}) "
        f"RETURNING {column(Slice, 'binding')}"
    )


def insert_slices(binding_id: int, slices: Sequence[NewSlice], now: datetime) -> None:
    """INSERT active slices of a binding row that exists, in one statement."""
    if slices:
        rawsql.execute(*_slices_insert("%s", binding_id, slices, now))


def _slices_insert(
    binding_sql: str, binding_param: Any, slices: Sequence[NewSlice], now: datetime
) -> tuple[str, list[Any]]:
    stamp = connection.ops.adapt_datetimefield_value(now)
    row = "(" + ", ".join([binding_sql] + ["%s"] * (len(_SLICE_INSERT) - 1)) + ")"
    params: list[Any] = []
    for values in slices:
        params.extend((binding_param, *values, True, stamp))
    return _sql("insert_slices") + ", ".join([row] * len(slices)), params


def confirm(confirmations: Sequence[tuple[str, datetime]]) -> int:
    """reserved -> bound for each (pod UID, bound at), one statement; the rows changed."""
    if not confirmations:
        return 0
    adapt = connection.ops.adapt_datetimefield_value
    phases = PodBinding.Phase
    params: list[Any] = [phases.BOUND.value, adapt(timezone.now())]
    for pod_uid, at in confirmations:
        params += [pod_uid, adapt(at)]
    params.append(phases.RESERVED.value)
    values = ", ".join(["(%s, %s)"] * len(confirmations))
    return rawsql.execute(_sql("confirm").replace("{values}", values), params)


def decisions_bound(pod_uids: Sequence[str], outcome: str) -> int:
    """Set these pods' decision rows (those that exist) to `outcome`; the rows changed."""
    changed = 0
    for start in range(0, len(pod_uids), 500):  # within every database's parameter limit
        chunk = pod_uids[start : start + 500]
        statement = _sql("decisions_bound").replace("{uids}", ", ".join(["%s"] * len(chunk)))
        changed += rawsql.execute(statement, [outcome, *chunk, outcome])
    return changed


def upsert_decisions(rows: Sequence[dict[str, Any]]) -> None:
    """Insert or replace the decision-log rows (`DECISION` fields, Python values, one row per
    pod UID) in one statement: the filter logs one per call."""
    if not rows:
        return
    params = [rawsql.db_value(SchedulingDecision, f, row[f]) for row in rows for f in DECISION]
    values = ", ".join([rawsql.placeholders(len(DECISION))] * len(rows))
    rawsql.execute(_sql("upsert_decisions").replace("{values}", values), params)
