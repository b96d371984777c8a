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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from django.db import transaction
from django.utils import timezone

from controlplane.ledger import selectors
from controlplane.ledger.errors import NotFound
from controlplane.ledger.models import Card, Node, PodBinding, Slice
from controlplane.ledger.services import modes
from controlplane.ledger.services.audit import record_events

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


@dataclass(frozen=True, slots=True)
class MirroredBatch:
    """What `mirror_claims` did: each claim written or found unchanged, and each refused with
    the reason (a node or card the ledger lacks, a pod's UID)."""

    done: tuple[ClaimMirror, ...]
    refused: tuple[tuple[ClaimRecord, str], ...]


def mirror_claim(record: ClaimRecord, actor: str) -> ClaimMirror:
    """Write one claim's row and slices as `record` says (`mirror_claims`); NotFound, changing
    nothing, when the ledger cannot place it."""
    batch = mirror_claims([record], actor)
    if batch.refused:
        (_, reason), *_ = batch.refused
        raise NotFound(reason, field="uid")
    return batch.done[0]


@transaction.atomic(durable=True)
def mirror_claims(records: Sequence[ClaimRecord], actor: str) -> MirroredBatch:
    """Write each claim's row and slices as its record says: create it, replace an allocation
    that changed (or a released row whose claim was allocated again), or change nothing.

    One transaction, under the row locks of the claims' nodes (taken in name order, as every
    write of a node's slices takes its node's), in a fixed number of queries for the claims that
    are new. A claim whose node or cards the ledger lacks, or whose UID is a pod's, is refused
    and written nothing (it is never invented); the others are written.
    """
    names = sorted({r.node for r in records})
    nodes = dict(
        Node.objects.select_for_update().filter(name__in=names).order_by("name")
        .values_list("name", "pk")
    )  # fmt: skip
    uuids = {s.card_uuid for r in records for s in r.slices}
    cards = {
        uuid: (node_id, pk)
        for uuid, node_id, pk in Card.objects.filter(uuid__in=uuids).values_list(
            "uuid", "node_id", "pk"
        )
    }
    existing = {
        b.pod_uid: b
        for b in PodBinding.objects.select_for_update(of=("self",)).filter(
            pod_uid__in=[r.uid for r in records]
        )
    }
    held = selectors.mirrored_claims(
        [uid for uid, b in existing.items() if b.source == CLAIM and b.active]
    )
    now = timezone.now()
    refused: list[tuple[ClaimRecord, str]] = []
    fresh: list[tuple[ClaimRecord, PodBinding]] = []
    done: list[ClaimMirror] = []
    for record in records:
        reason = _unplaceable(record, nodes.get(record.node), cards, existing.get(record.uid))
        if reason:
            refused.append((record, reason))
            continue
        earlier, mirrored = existing.get(record.uid), held.get(record.uid)
        if (
            earlier is not None and mirrored is not None and mirrored.node == record.node
            and mirrored.slices == frozenset(record.slices)
        ):  # fmt: skip
            done.append(ClaimMirror("unchanged", earlier.pk, record.uid))
            continue
        was_active = earlier is not None and earlier.active
        binding = earlier or PodBinding(pod_uid=record.uid, source=CLAIM, request={"claim": True})
        binding.node_id, binding.phase = nodes[record.node], Phase.BOUND
        binding.reason = "allocated by kube-scheduler"
        binding.namespace, binding.name = record.namespace, record.name
        binding.reserved_at, binding.bound_at, binding.released_at = now, now, None
        if earlier is not None:
            binding.save()
            if was_active:  # a draining card the allocation it replaces held may take its mode
                modes.apply_after_release([binding.pk])
            binding.slices.all().delete()
        fresh.append((record, binding))
    PodBinding.objects.bulk_create([b for r, b in fresh if b.pk is None])
    Slice.objects.bulk_create(
        Slice(binding_id=binding.pk, card_id=cards[s.card_uuid][1], container_name=s.request,
              container_index=s.index, memory_mib=s.memory_mib, compute_percent=s.compute_percent,
              mig_profile=s.mig_profile, mig_start=s.mig_start, mig_size=s.mig_size)
        for record, binding in fresh
        for s in record.slices
    )  # fmt: skip
    touched = {r.node for r, _ in fresh}
    full = {
        card.uuid
        for card in (selectors.node_cards(sorted(touched)) if touched else ())
        if card.used_memory_mib > card.memory_mib or card.used_slots > card.slots
    }
    audited = []
    for record, binding in fresh:
        outcome = "updated" if record.uid in existing else "created"
        over = tuple(sorted({s.card_uuid for s in record.slices} & full))
        done.append(ClaimMirror(outcome, binding.pk, record.uid, over))
        if outcome == "updated" or over:
            # a new claim is DRA mode's routine path, as a bind is in extender mode: not audited
            details = {"uid": record.uid, "node": record.node, "outcome": outcome,
                       "cards": sorted({s.card_uuid for s in record.slices}),
                       "overcommitted_cards": list(over)}  # fmt: skip
            audited.append((f"{record.namespace}/{record.name}", details))
    record_events(actor, "mirror-claim", "claim", audited)
    return MirroredBatch(tuple(done), tuple(refused))


def _unplaceable(
    record: ClaimRecord,
    node_id: int | None,
    cards: Mapping[str, tuple[int, int]],
    existing: PodBinding | None,
) -> str:
    """Why the ledger cannot hold this claim's row as it stands ("" when it can)."""
    if node_id is None:
        return f"node {record.node!r} is not registered with Tessera"
    missing = sorted(
        {s.card_uuid for s in record.slices if cards.get(s.card_uuid, (0,))[0] != node_id}
    )
    if missing:
        return (f"card(s) {', '.join(missing)} of claim {record.namespace}/{record.name} are not "
                f"on node {record.node} in the ledger")  # fmt: skip
    if existing is not None and existing.source != CLAIM:
        return f"UID {record.uid} is a pod's binding, not a claim's"
    return ""
