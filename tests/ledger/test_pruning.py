"""Bounded state: cards long gone from their node's reports, and the decision log.

Cards missing from a report stay on record (shown as missing) for a retention, and go after it
only when nothing holds them; a node cannot pile up missing cards past its allowance. Decision
log entries go when they are old, or their pod is bound or gone.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.ledger import selectors
from controlplane.ledger.models import AuditEvent, Card, PodBinding, SchedulingDecision, Slice
from controlplane.ledger.services import bindings, decisions, nodes
from controlplane.scheduling import parse_pod
from tests.builders import card_report, make_node
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db

WEEK = timedelta(days=7)


def report(node: str, *uuids: str) -> nodes.InventoryResult:
    cards = tuple(card_report(uuid, i, 10000) for i, uuid in enumerate(uuids))
    return nodes.apply_inventory(node, nodes.InventoryReport("test", cards), node)


def gone_since(uuid: str, age: timedelta) -> None:
    """The card was last in a report `age` ago."""
    Card.objects.filter(uuid=uuid).update(last_seen=timezone.now() - age)


def bind(name: str, node: str = "n1", mem: int = 1000) -> str:
    request = parse_pod(pod_json(name, containers=[gpu_container(mem=mem)]))
    assert request is not None
    reservation = bindings.bind_pod(request, node)
    bindings.confirm_binding(reservation.pod_uid)
    return reservation.pod_uid


def uuids() -> set[str]:
    return set(Card.objects.values_list("uuid", flat=True))


# --- cards -----------------------------------------------------------------------------------


def test_a_missing_card_is_kept_and_shown_missing_within_the_retention() -> None:
    report("n1", "GPU-a", "GPU-b")
    report("n1", "GPU-a")
    gone_since("GPU-b", WEEK - timedelta(hours=1))
    assert nodes.prune_missing_cards("test") == ()
    card = Card.objects.get(uuid="GPU-b")
    assert not card.present
    states = {c.uuid: c for c in selectors.node_cards(["n1"])}
    assert not states["GPU-b"].healthy  # shown to the core (and the dashboard) as missing


def test_a_card_missing_past_the_retention_is_pruned_and_audited() -> None:
    report("n1", "GPU-a", "GPU-b")
    report("n1", "GPU-a")
    gone_since("GPU-b", WEEK + timedelta(hours=1))
    pruned = nodes.prune_missing_cards("reconciler")
    assert [(p.uuid, p.node, p.ended_slices) for p in pruned] == [("GPU-b", "n1", 0)]
    assert uuids() == {"GPU-a"}
    event = AuditEvent.objects.get(action="cards-pruned")
    assert (event.actor, event.target_type, event.target) == ("reconciler", "node", "n1")
    assert [c["uuid"] for c in event.details["cards"]] == ["GPU-b"]
    assert "missing" in event.details["reason"]
    assert {c.uuid for c in selectors.node_cards(["n1"])} == {"GPU-a"}
    assert nodes.prune_missing_cards("reconciler") == ()  # nothing left: a rerun does nothing


def test_a_card_still_used_by_an_active_slice_is_never_pruned() -> None:
    report("n1", "GPU-a")
    uid = bind("trainer")
    report("n1")  # the card is gone from the report while the pod still runs on it
    gone_since("GPU-a", timedelta(days=365))
    assert nodes.prune_missing_cards("test") == ()
    assert uuids() == {"GPU-a"}
    assert Slice.objects.filter(card__uuid="GPU-a", active=True).count() == 1

    bindings.release_binding(uid, "pod ended")
    pruned = nodes.prune_missing_cards("test")
    assert [(p.uuid, p.ended_slices) for p in pruned] == [("GPU-a", 1)]
    assert uuids() == set()
    binding = PodBinding.objects.get(pod_uid=uid)  # the ended pod's record stays
    assert binding.phase == "released" and not binding.slices.exists()


def test_a_card_held_by_a_live_binding_is_never_pruned_even_without_an_active_slice() -> None:
    report("n1", "GPU-a")
    uid = bind("trainer")
    Slice.objects.filter(binding__pod_uid=uid).update(active=False)  # a row gone inconsistent
    report("n1")
    gone_since("GPU-a", timedelta(days=365))
    assert nodes.prune_missing_cards("test") == ()
    assert uuids() == {"GPU-a"}


def test_a_card_that_came_back_is_not_pruned() -> None:
    report("n1", "GPU-a", "GPU-b")
    report("n1", "GPU-a")
    gone_since("GPU-b", WEEK + timedelta(hours=1))
    report("n1", "GPU-a", "GPU-b")  # back (last_seen is now, present again)
    assert nodes.prune_missing_cards("test") == ()
    assert AuditEvent.objects.filter(action="card-returned", target="GPU-b").exists()


def test_the_retention_is_a_setting(settings) -> None:
    settings.TESSERA = {**settings.TESSERA, "MISSING_CARD_RETENTION_S": 3600}
    report("n1", "GPU-a", "GPU-b")
    report("n1", "GPU-a")
    gone_since("GPU-b", timedelta(hours=2))
    assert [p.uuid for p in nodes.prune_missing_cards("test")] == ["GPU-b"]


def test_each_prune_is_bounded_longest_missing_first() -> None:
    report("n1", "GPU-keep", *(f"GPU-{i}" for i in range(5)))
    report("n2", "GPU-other")
    report("n1", "GPU-keep")
    for i in range(5):
        gone_since(f"GPU-{i}", WEEK + timedelta(days=5 - i))  # GPU-0 longest gone
    first = nodes.prune_missing_cards("test", limit=2)
    assert [p.uuid for p in first] == ["GPU-0", "GPU-1"]
    second = nodes.prune_missing_cards("test", limit=2)
    assert [p.uuid for p in second] == ["GPU-2", "GPU-3"]
    assert [p.uuid for p in nodes.prune_missing_cards("test", limit=2)] == ["GPU-4"]
    assert uuids() == {"GPU-keep", "GPU-other"}


def test_a_pruned_card_reported_again_is_registered_anew_even_by_another_node() -> None:
    report("n1", "GPU-a", "GPU-moved")
    report("n1", "GPU-a")
    gone_since("GPU-moved", WEEK + timedelta(hours=1))
    nodes.prune_missing_cards("test")
    result = report("n2", "GPU-moved")  # was refused as n1's card before the prune
    assert result.cards_added == ("GPU-moved",)
    assert Card.objects.get(uuid="GPU-moved").node.name == "n2"


def test_ever_new_uuids_keep_at_most_the_allowance_of_missing_cards(settings) -> None:
    settings.TESSERA = {**settings.TESSERA, "MISSING_CARDS_PER_NODE": 3}
    report("n1", "GPU-held")
    bind("long-job")  # its card will be missing but held: never pruned, not counted
    pruned: list[str] = []
    for round_ in range(10):
        result = report("n1", f"GPU-r{round_}-0", f"GPU-r{round_}-1")
        pruned += result.cards_pruned
    unheld = Card.objects.filter(present=False).exclude(uuid="GPU-held")
    assert unheld.count() == 3  # the allowance, whatever the number of reports
    assert Card.objects.filter(present=True).count() == 2
    assert uuids() >= {"GPU-held"}
    # the longest missing went first; the most recently seen are the ones kept
    kept = set(unheld.values_list("uuid", flat=True))
    assert kept == {"GPU-r8-0", "GPU-r8-1", "GPU-r7-1"}
    assert len(pruned) == 2 * 10 - 2 - 3  # every card of the rounds but present and kept
    assert AuditEvent.objects.filter(action="cards-pruned", target="n1").exists()


# --- decisions -------------------------------------------------------------------------------


def entry(name: str, age: timedelta = timedelta(0), outcome: str = "unschedulable") -> str:
    uid = f"uid-default-{name}"
    SchedulingDecision.objects.create(
        pod_uid=uid, namespace="default", name=name, outcome=outcome, summary="no room",
        decided_at=timezone.now() - age,
    )  # fmt: skip
    return uid


def logged() -> set[str]:
    return set(SchedulingDecision.objects.values_list("name", flat=True))


def test_entries_older_than_the_retention_are_pruned() -> None:
    entry("fresh", timedelta(hours=23))
    entry("stale", timedelta(hours=25))
    assert decisions.prune_decisions() == 1
    assert logged() == {"fresh"}


def test_entries_of_bound_pods_are_pruned_those_still_waiting_are_kept() -> None:
    make_node("n1", cards=2, memory_mib=10000)
    for name in ("bound", "released", "reserved", "failed", "pending"):
        entry(name)
    bind("bound")
    bindings.release_binding(bind("released"), "ended")
    request = parse_pod(pod_json("reserved", containers=[gpu_container(mem=1000)]))
    assert request is not None
    bindings.bind_pod(request, "n1")  # reserved: the Binding is on its way
    failed = parse_pod(pod_json("failed", containers=[gpu_container(mem=1000)]))
    assert failed is not None
    bindings.release_binding(bindings.bind_pod(failed, "n1").pod_uid, "bind failed", failed=True)
    assert decisions.prune_decisions() == 2
    assert logged() == {"reserved", "failed", "pending"}


def test_pruning_decisions_is_bounded_oldest_first() -> None:
    for i in range(5):
        entry(f"old-{i}", timedelta(days=2, minutes=5 - i))
    assert decisions.prune_decisions(limit=2) == 2
    assert logged() == {"old-2", "old-3", "old-4"}
    assert decisions.prune_decisions(limit=2) == 2
    assert decisions.prune_decisions(limit=2) == 1
    assert logged() == set()


def test_the_decision_retention_is_a_setting(settings) -> None:
    settings.TESSERA = {**settings.TESSERA, "DECISION_RETENTION_S": 600}
    entry("eleven-minutes", timedelta(minutes=11))
    entry("nine-minutes", timedelta(minutes=9))
    assert decisions.prune_decisions() == 1
    assert logged() == {"nine-minutes"}


def test_forgetting_gone_pods_spares_entries_newer_than_the_list() -> None:
    listed_at = timezone.now()
    gone = entry("gone", timedelta(minutes=1))
    newer = entry("newer", timedelta(minutes=-1))  # decided after the list was taken
    entry("other", timedelta(minutes=1))
    assert decisions.forget_decisions([gone, newer], before=listed_at) == 1
    assert logged() == {"newer", "other"}
