"""How much of each card, and of each namespace's quota, the active bindings hold.

The one place the ledger's usage is added up. The rule is the scheduling core's
(`claims_per_card`: per card, each pod's claim, an init container at its peak and not on top of
the app containers, a sidecar beside every container after it; `usage_of`: what a pod counts
against its quota). Filter, bind, the dashboard, the REST API and /metrics all read usage here,
so they never disagree on how full a card or a namespace is.

Two ways in, the same figures (a test holds them equal):
- `card_usage` / `namespace_usage` for the whole cluster: the database sums the app slices per
  card (or namespace) and only the few pods that hold an init slice (sidecars are init slices)
  are folded by the core's rule and added as a correction. Reading and folding every one of
  20,000 slice rows instead took the overview page and the quota page twice to three times as
  long.
- `claims_of` for slice rows a caller already holds (bind's locked read of one node, the
  snapshot, a page of cards): the core's fold of those rows.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from django.db.models import Case, Count, Max, QuerySet, Sum, Value, When
from django.db.models.functions import Coalesce

from controlplane import rawsql
from controlplane.ledger.models import Slice
from controlplane.scheduling import (
    EXCLUSIVE_CORES,
    CardClaim,
    LedgerSlice,
    QuotaUsage,
    SliceClaim,
    card_claims,
    claims_per_card,
)

EMPTY_CARD = CardClaim(0, 0, 0, False)
# The columns of a slice row as the core folds them (`LedgerSlice`), the resident part last.
SLICE_ROW = (
    "binding_id", "card_id", "container_index", "init_container", "memory_mib", "compute_percent",
    "sidecar", "mig_start", "mig_size", "resident_mib",
)  # fmt: skip
_EXCLUSIVE = Max(Case(When(compute_percent__gte=EXCLUSIVE_CORES, then=Value(1)), default=Value(0)))


def claims_of(rows: Iterable[LedgerSlice]) -> dict[int, CardClaim]:
    """Per card id, the claims of these active slice rows (no queries)."""
    return card_claims(rows)


def card_usage() -> dict[int, CardClaim]:
    """Per card id, what it has given away: the sum over pods of each pod's claim (two
    queries), the resident parts too (docs/virtual-memory.md)."""
    totals: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0, 0])
    app = (
        Slice.objects.filter(active=True, init_container=False)
        .order_by()
        .values_list("card_id")
        .annotate(mem=Sum("memory_mib"), cores=Sum("compute_percent"), n=Count("id"),
                  excl=_EXCLUSIVE, res=Sum(Coalesce("resident_mib", "memory_mib")))
    )  # fmt: skip
    for card_id, memory, cores, n, exclusive, resident in rawsql.rows_of(app):
        _add(totals[card_id], memory, cores, n, exclusive, resident, memory - resident)
    for _, card_id, delta in _init_corrections(Slice.objects.all()):
        _add(totals[card_id], *delta)
    return {
        card: CardClaim(t[0], t[1], t[2], bool(t[3]), 0, None if t[4] == t[0] else t[4], t[5])
        for card, t in totals.items()
    }


def namespace_usage(namespace: str | None = None) -> dict[str, QuotaUsage]:
    """Per namespace (or only `namespace`), what its active bindings count against its quota
    (two queries)."""
    slices = Slice.objects.all()
    if namespace is not None:
        slices = slices.filter(binding__namespace=namespace)
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    app = (
        slices.filter(active=True, init_container=False)
        .order_by()
        .values_list("binding__namespace")
        .annotate(mem=Sum("memory_mib"), cores=Sum("compute_percent"), n=Count("id"))
    )
    for ns, memory, cores, n in rawsql.rows_of(app):
        _add(totals[ns], memory, cores, n, 0)
    for (ns,), _, delta in _init_corrections(slices, "binding__namespace"):
        _add(totals[ns], *delta)
    return {ns: QuotaUsage(t[0], t[1], t[2]) for ns, t in totals.items()}


def quota_usage(namespace: str) -> QuotaUsage:
    """What one namespace holds against its quota (two queries)."""
    return namespace_usage(namespace).get(namespace, QuotaUsage())


def _add(
    total: list[int],
    memory: int,
    cores: int,
    slots: int,
    exclusive: Any,
    resident: int = 0,
    spill: int = 0,
) -> None:
    total[0] += memory
    total[1] += cores
    total[2] += slots
    total[3] = total[3] or int(bool(exclusive))
    if len(total) > 4:  # a card's (a namespace's quota counts memory, not where it lives)
        total[4] += resident
        total[5] += spill


def _init_corrections(
    slices: QuerySet[Slice], *extra: str
) -> list[tuple[tuple[Any, ...], int, tuple[int, int, int, bool, int, int]]]:
    """For pods that hold active init slices: what the core's rule adds on top of the plain sum
    of their app slices, per card: (extra values, card id, (memory, cores, slots, exclusive,
    resident, spill)).
    The slots may be 1 for a card only an init container uses. One query, over only those pods
    (few: init containers are short)."""
    with_init = slices.filter(active=True, init_container=True).values("binding_id")
    rows = list(
        slices.filter(active=True, binding_id__in=with_init)
        .order_by()
        .values_list(*SLICE_ROW, *extra)
    )
    width = len(SLICE_ROW)
    extra_of = {r[0]: tuple(r[width:]) for r in rows}
    plain: dict[tuple[int, int], list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
    folded: dict[int, list[SliceClaim]] = defaultdict(list)
    for row in rows:
        binding_id, card_id, index, init, memory, cores, sidecar = row[:7]
        part = SliceClaim(str(card_id), index, init, memory, cores, sidecar, resident_mib=row[9])
        if not init:
            base = plain[(binding_id, card_id)]
            base[0], base[1], base[2] = base[0] + memory, base[1] + cores, base[2] + 1
            base[3] += part.resident
            base[4] += memory - part.resident
        folded[binding_id].append(part)
    out = []
    for binding_id, claims in folded.items():
        for card_key, claim in claims_per_card(claims).items():
            base = plain.get((binding_id, int(card_key)), [0, 0, 0, 0, 0])
            delta = (
                claim.memory_mib - base[0], claim.cores - base[1], claim.slots - base[2],
                claim.exclusive, claim.resident - base[3], claim.spill_mib - base[4],
            )  # fmt: skip
            out.append((extra_of[binding_id], int(card_key), delta))
    return out
