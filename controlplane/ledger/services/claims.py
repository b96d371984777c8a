"""ResourceClaims in the ledger: DRA mode's allocations, mirrored as bindings (docs/dra.md, *One
ledger for claims*).

In DRA mode kube-scheduler allocates Tessera's devices itself; the reconciler mirrors each
allocated claim into one `PodBinding` row of source `claim` (the claim's UID, namespace and name)
with one `Slice` per device result, so quota usage, the dashboard and `/metrics` read claims as
they read pods. The allocation is a fact the API server holds: the row records it as it is, even
on a card the ledger thinks full (the audit event says so), as an adoption does. Releasing a
claim's row is `bindings.release_bindings`, the same path as a pod's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from django.db import transaction
from django.utils import timezone

from controlplane.ledger import selectors, sql
from controlplane.ledger.errors import NotFound
from controlplane.ledger.models import Card, Node, PodBinding
from controlplane.ledger.services import modes
from controlplane.ledger.services.audit import record_event

Phase = PodBinding.Phase
CLAIM = PodBinding.Source.CLAIM


class ClaimSlice(NamedTuple):
    """One device result of a claim: which card, under which request, and what it consumes.
    Its fields, in order, are `selectors.MIRRORED_SLICE_COLUMNS`: a mirrored row compares equal
    to what its claim says now."""

    card_uuid: str
    request: str  # the claim's request name: the slice's container name
    index: int  # the result's position among Tessera's results: the slice's container index
    memory_mib: int
    compute_percent: int
    mig_profile: str = ""
    mig_start: int | None = None
    mig_size: int | None = None


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    """An allocated claim as the ledger holds it: its row and its slices."""

    uid: str
    namespace: str
    name: str
    node: str
    slices: tuple[ClaimSlice, ...]


@dataclass(frozen=True, slots=True)
class ClaimMirror:
    """What `mirror_claim` did: `created`, `updated` (the allocation changed) or `unchanged`."""

    outcome: str
    binding_id: int
    uid: str
    overcommitted_cards: tuple[str, ...] = ()


@transaction.atomic(durable=True)
def mirror_claim(record: ClaimRecord, actor: str) -> ClaimMirror:
    """Write the claim's row and slices as `record` says: create it, replace an allocation
    that changed (or a released row whose claim was allocated again), or change nothing.

    Under the node's row lock, as every write of a node's slices. NotFound, changing nothing,
    when the node or one of the cards is not in the ledger (it is never invented).
    """
    node = Node.objects.select_for_update().filter(name=record.node).first()
    if node is None:
        raise NotFound(f"node {record.node!r} is not registered with Tessera", field="node")
    uuids = {s.card_uuid for s in record.slices}
    cards = dict(Card.objects.filter(node=node, uuid__in=uuids).values_list("uuid", "pk"))
    if len(cards) != len(uuids):
        missing = ", ".join(sorted(uuids - set(cards)))
        raise NotFound(f"card(s) {missing} of claim {record.namespace}/{record.name} are not "
                       f"on node {node.name} in the ledger", field="card")  # fmt: skip
    existing = PodBinding.objects.select_for_update(of=("self",)).filter(pod_uid=record.uid).first()
    if existing is not None and existing.source != CLAIM:
        raise NotFound(f"UID {record.uid} is a pod's binding, not a claim's", field="uid")
    if existing is not None and existing.active:
        held = selectors.mirrored_claims([record.uid]).get(record.uid)
        if held is not None and held.node == node.name and held.slices == frozenset(record.slices):
            return ClaimMirror("unchanged", existing.pk, record.uid)
    now = timezone.now()
    rows = [
        sql.NewSlice(cards[s.card_uuid], s.request, s.index, False, s.memory_mib,
                     s.compute_percent, False, None, s.mig_profile, s.mig_start, s.mig_size)
        for s in record.slices
    ]  # fmt: skip
    binding = existing or PodBinding(pod_uid=record.uid, source=CLAIM, request={"claim": True})
    was_active = existing is not None and existing.active
    binding.node, binding.phase, binding.reason = node, Phase.BOUND, "allocated by kube-scheduler"
    binding.namespace, binding.name = record.namespace, record.name
    binding.reserved_at, binding.bound_at, binding.released_at = now, now, None
    binding.save()
    if was_active:  # a draining card the old allocation held may take its new mode
        modes.apply_after_release([binding.pk])
    if existing is not None:
        binding.slices.all().delete()  # the rows of the allocation it replaces
    outcome = "created" if existing is None else "updated"
    sql.insert_slices(binding.pk, rows, now)
    over = tuple(
        card.uuid
        for card in selectors.node_cards([node.name])
        if card.uuid in uuids
        and (card.used_memory_mib > card.memory_mib or card.used_slots > card.slots)
    )
    if outcome == "created" and not over:
        # The routine path of DRA mode, as a bind is in extender mode: not audited.
        return ClaimMirror(outcome, binding.pk, record.uid)
    record_event(
        actor,
        "mirror-claim",
        "claim",
        f"{record.namespace}/{record.name}",
        uid=record.uid,
        node=node.name,
        outcome=outcome,
        cards=sorted(uuids),
        overcommitted_cards=list(over),
    )
    return ClaimMirror(outcome, binding.pk, record.uid, over)
