"""Ledger services of operators: quotas and cordons, each audited and validated."""

from __future__ import annotations

import pytest

from controlplane.ledger.errors import Conflict, NotFound, ServiceError
from controlplane.ledger.models import AuditEvent, Card, NamespaceQuota, Node
from controlplane.ledger.services import cordons, nodes, quotas
from controlplane.ledger.services.quotas import QuotaLimitsInput
from tests.builders import make_node

pytestmark = pytest.mark.django_db


def test_set_quota_creates_then_replaces_and_audits() -> None:
    quota, created = quotas.set_quota("team-a", QuotaLimitsInput(gpumem_mib=100), "ann")
    assert created and (quota.gpumem_mib, quota.gpucores, quota.gpus) == (100, None, None)
    quota, created = quotas.set_quota("team-a", QuotaLimitsInput(gpus=0), "bob")
    assert not created and (quota.gpumem_mib, quota.gpus, quota.updated_by) == (None, 0, "bob")
    events = list(AuditEvent.objects.order_by("id"))
    assert [(e.actor, e.action, e.target) for e in events] == [
        ("ann", "quota-set", "team-a"),
        ("bob", "quota-set", "team-a"),
    ]
    assert events[1].details == {
        "before": {"gpumem_mib": 100, "gpucores": None, "gpus": None},
        "after": {"gpumem_mib": None, "gpucores": None, "gpus": 0},
    }


def test_set_quota_create_only_conflicts() -> None:
    quotas.set_quota("team-a", QuotaLimitsInput(gpus=1), "ann")
    with pytest.raises(Conflict) as err:
        quotas.set_quota("team-a", QuotaLimitsInput(gpus=2), "ann", create_only=True)
    assert err.value.field == "namespace"
    assert NamespaceQuota.objects.get().gpus == 1


@pytest.mark.parametrize(
    ("namespace", "limits", "field"),
    [
        ("Team-A", QuotaLimitsInput(), "namespace"),
        ("", QuotaLimitsInput(), "namespace"),
        ("ok", QuotaLimitsInput(gpumem_mib=-1), "gpumem_mib"),
        ("ok", QuotaLimitsInput(gpucores=10**12), "gpucores"),
        ("ok", QuotaLimitsInput(gpus=True), "gpus"),  # type: ignore[arg-type]
        ("ok", QuotaLimitsInput(gpus="3"), "gpus"),  # type: ignore[arg-type]
    ],
)
def test_set_quota_refuses_bad_input(namespace: str, limits: QuotaLimitsInput, field: str) -> None:
    with pytest.raises(ServiceError) as err:
        quotas.set_quota(namespace, limits, "ann")
    assert err.value.field == field
    assert not NamespaceQuota.objects.exists() and not AuditEvent.objects.exists()


def test_delete_quota() -> None:
    quotas.set_quota("team-a", QuotaLimitsInput(gpus=1), "ann")
    quotas.delete_quota("team-a", "bob")
    assert not NamespaceQuota.objects.exists()
    event = AuditEvent.objects.get(action="quota-delete")
    assert (event.actor, event.details["before"]["gpus"]) == ("bob", 1)
    with pytest.raises(NotFound):
        quotas.delete_quota("team-a", "bob")


def test_cordons_are_audited_only_when_they_change() -> None:
    make_node("n1", cards=1)
    first = cordons.set_node_cordon("n1", True, "ann", "drain")
    assert first == cordons.Cordon("node", "n1", "n1", cordoned=True, changed=True)
    assert not cordons.set_node_cordon("n1", True, "ann").changed
    card = cordons.set_card_cordon("GPU-n1-0", True, "bob")
    assert card == cordons.Cordon("card", "GPU-n1-0", "n1", cordoned=True, changed=True)
    cordons.set_card_cordon("GPU-n1-0", False, "bob")
    assert Node.objects.get().cordoned and not Card.objects.get().cordoned
    events = list(
        AuditEvent.objects.filter(action__contains="cordon")
        .order_by("id")
        .values_list("actor", "action", "target")
    )
    assert events == [
        ("ann", "node-cordon", "n1"),
        ("bob", "card-cordon", "GPU-n1-0"),
        ("bob", "card-uncordon", "GPU-n1-0"),
    ]
    with pytest.raises(NotFound):
        cordons.set_node_cordon("n9", True, "ann")
    with pytest.raises(NotFound):
        cordons.set_card_cordon("GPU-none", True, "ann")


def test_card_slots_return_before_and_after_and_are_audited_only_when_they_change() -> None:
    make_node("n1", cards=1)
    before = Card.objects.get().slots
    changed = nodes.set_card_slots("GPU-n1-0", 3, "ann")
    assert changed == nodes.CardSlots("GPU-n1-0", "n1", before, 3)
    assert nodes.set_card_slots("GPU-n1-0", 3, "ann") == nodes.CardSlots("GPU-n1-0", "n1", 3, 3)
    assert Card.objects.get().slots == 3
    events = AuditEvent.objects.filter(action="card-slots").values_list("details", flat=True)
    assert [(e["before"], e["after"]) for e in events] == [(before, 3)]
    with pytest.raises(ServiceError):
        nodes.set_card_slots("GPU-n1-0", 0, "ann")
    with pytest.raises(NotFound):
        nodes.set_card_slots("GPU-none", 2, "ann")
