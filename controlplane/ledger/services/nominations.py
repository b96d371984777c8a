"""Nominations: room held on a node for a pod whose preemption is under way.

Written under the node's row lock (the lock bind takes), so a bind in flight either committed
before the hold or sees it. While a nomination lasts, filter and bind count its room as taken
for every pod but its own; it ends when its pod binds (bind deletes it) or at its deadline.
Each write moves the node's change stamp, so the extender's snapshot cache re-reads the node.

Part of preemption: the ledger's reads for it are `controlplane.ledger.preemption`, the map of
every piece is `controlplane.extender.preemption`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime

from django.db import transaction
from django.utils import timezone

from controlplane.ledger.errors import NotFound
from controlplane.ledger.models import Node, Nomination
from controlplane.ledger.services.audit import record_event
from controlplane.scheduling import CardClaim


def claims_json(claims: Mapping[str, CardClaim]) -> dict[str, list[int]]:
    """Card UUID -> [memory MiB, compute, slots, exclusive (0/1)], then [MIG mask, resident
    MiB, spill MiB] where the pod's slices there spill (virtual device memory): the hold then
    keeps the same room in each budget as the pod will."""
    return {
        uuid: [c.memory_mib, c.cores, c.slots, int(c.exclusive)]
        + ([c.mig_mask, c.resident, c.spill_mib] if c.resident_mib is not None else [])
        for uuid, c in claims.items()
    }


@transaction.atomic(durable=True)
def nominate(
    *,
    pod_uid: str,
    namespace: str,
    name: str,
    node_name: str,
    priority: int,
    claims: Mapping[str, CardClaim],
    victims: Sequence[str],
    deadline: datetime,
) -> Nomination:
    """Hold `claims` on `node_name` for the pod until `deadline` (idempotent per pod: a second
    call moves the hold). Audited as `preempt`."""
    node = Node.objects.select_for_update().filter(name=node_name).first()
    if node is None:
        raise NotFound(f"node {node_name!r} is not registered with Tessera", field="node")
    earlier = Nomination.objects.filter(pod_uid=pod_uid).values_list("node_id", flat=True).first()
    held, _ = Nomination.objects.update_or_create(
        pod_uid=pod_uid,
        defaults={
            "namespace": namespace,
            "name": name,
            "node": node,
            "priority": priority,
            "claims": claims_json(claims),
            "victims": list(victims),
            "deadline": deadline,
        },
    )
    Node.objects.filter(pk__in={node.pk, earlier or node.pk}).update()
    record_event(
        "system", "preempt", "pod", f"{namespace}/{name}",
        node=node_name, victims=list(victims), priority=priority, until=deadline.isoformat(),
    )  # fmt: skip
    return held


@transaction.atomic(durable=True)
def end_nominations(pod_uids: Sequence[str]) -> int:
    """Drop the pods' holds (bound elsewhere, gone, or their preemption given up)."""
    rows = Nomination.objects.filter(pod_uid__in=list(pod_uids))
    nodes = set(rows.values_list("node_id", flat=True))
    count, _ = rows.delete()
    Node.objects.filter(pk__in=nodes).update()
    return count


@transaction.atomic(durable=True)
def expire_nominations(now: datetime | None = None) -> list[str]:
    """Drop the holds whose deadline has passed; the pod UIDs they were for."""
    rows = Nomination.objects.filter(deadline__lte=now or timezone.now())
    found = list(rows.values_list("pod_uid", "node_id"))
    if found:
        Nomination.objects.filter(pod_uid__in=[uid for uid, _ in found]).delete()
        Node.objects.filter(pk__in={node for _, node in found}).update()
    return [uid for uid, _ in found]
