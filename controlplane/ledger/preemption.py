"""The ledger as preemption reads it: each node with the pods that hold slices on it.

One read of the nodes' cards and active slices gives both the node as the core sees it and
each pod's claim on it, so the two always add up (a bind that commits in between is in both or
in neither).

Its holds are written by `controlplane.ledger.services.nominations`; the rule is
`controlplane.scheduling.preempt`, and the extender's side (with the map of every piece) is
`controlplane.extender.preemption`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime

from django.utils import timezone

from controlplane.ledger import selectors, sql
from controlplane.ledger.models import Nomination, PodBinding
from controlplane.scheduling import CardClaim, NodeState, pod_claims
from controlplane.scheduling.preempt import Candidate


def _started(bound_at: datetime | None, reserved_at: datetime | None, created: datetime) -> float:
    when = bound_at or reserved_at or created
    return when.timestamp()


def nodes_with_pods(node_names: Iterable[str]) -> dict[str, tuple[NodeState, list[Candidate]]]:
    """Per known node name: its state and the pods holding slices there (four queries)."""
    names = sorted(set(node_names))
    nodes, cards = sql.nodes(names), sql.cards(names)
    rows = sql.active_slices(names)
    snapshot = selectors.snapshot_of(nodes, cards, rows)
    uuid_of = {c.pk: c.uuid for c in cards}
    node_of_card = {c.pk: c.node_id for c in cards}
    name_of_node = {n.pk: n.name for n in nodes}
    held: dict[int, dict[str, CardClaim]] = defaultdict(dict)
    node_of_pod: dict[int, str] = {}
    for binding_id, card_id, claim in pod_claims(rows):
        held[binding_id][uuid_of[card_id]] = claim
        node_of_pod[binding_id] = name_of_node[node_of_card[card_id]]
    bindings = PodBinding.objects.filter(pk__in=list(held)).values_list(
        "pk", "pod_uid", "namespace", "name", "request", "bound_at", "reserved_at", "created_at"
    )
    pods: dict[str, list[Candidate]] = defaultdict(list)
    for pk, uid, namespace, name, request, bound_at, reserved_at, created_at in bindings:
        priority = request.get("pod_priority", 0) if isinstance(request, dict) else 0
        pods[node_of_pod[pk]].append(
            Candidate(
                uid=uid,
                namespace=namespace,
                name=name,
                priority=priority if isinstance(priority, int) else 0,
                started=_started(bound_at, reserved_at, created_at),
                claims=held[pk],
            )
        )
    return {node.name: (node, pods.get(node.name, [])) for node in snapshot.nodes}


def held_nodes(pod_uids: Iterable[str] | None = None) -> dict[str, str]:
    """Pod UID -> node name of every unexpired nomination (of those pods), one query."""
    rows = Nomination.objects.filter(deadline__gt=timezone.now())
    if pod_uids is not None:
        rows = rows.filter(pod_uid__in=list(pod_uids))
    return dict(rows.values_list("pod_uid", "node__name"))


def lowest_priority() -> int | None:
    """The lowest priority among the pods holding slices (None: no pod does), one query. A
    binding stored before priorities were recorded counts as 0."""
    values = PodBinding.objects.filter(phase__in=PodBinding.ACTIVE_PHASES).values_list(
        "request__pod_priority", flat=True
    )
    found = [v if isinstance(v, int) else 0 for v in values]
    return min(found) if found else None
