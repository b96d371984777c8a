"""The extender's filter on cards in other modes: what kube-scheduler and the decision log are
told names the mode (a full MIG card, an MPS card, a draining card)."""

from __future__ import annotations

import pytest
from django.utils import timezone

from controlplane.ledger.models import Card, SchedulingDecision
from controlplane.ledger.services import bindings
from controlplane.scheduling import parse_pod
from tests.builders import make_node
from tests.extender.builders import filter_args
from tests.extender.conftest import post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db


def set_mode(node: str, mode: str, **kw: object) -> None:
    Card.objects.filter(node__name=node).update(mode=mode, updated_at=timezone.now(), **kw)


def filter_body(client, pod, names):
    response = post(client, "/scheduler/filter", filter_args(pod, names))
    assert response.status_code == 200
    return response.json()


def test_a_full_mig_card_is_named_with_the_profile_it_lacks(client) -> None:
    make_node("a100", cards=1)
    set_mode("a100", "mig", mig_capable=True, mig_enabled=True)
    mig = {"nvidia.com/vgpu-mode": "mig"}
    for i in range(2):
        bindings.bind_pod(parse_pod(gpu_pod(f"big{i}", mem=30000, annotations=mig)), "a100")
    body = filter_body(client, gpu_pod("late", mem=30000, annotations=mig), ["a100"])
    assert body["NodeNames"] == []
    reason = body["FailedNodes"]["a100"]
    assert reason == "card GPU-a100-0 (NVIDIA A100-SXM4-80GB): MIG mode, no free 3g.40gb placement"
    decision = SchedulingDecision.objects.get(name="late")
    assert decision.reason_counts == {"NoMigPlacement": 1}
    assert "MIG card with a free placement" in decision.summary


def test_mps_and_draining_cards_say_why_a_plain_pod_cannot_have_them(client) -> None:
    make_node("mps", cards=1)
    make_node("drain", cards=1)
    set_mode("mps", "mps")
    set_mode("drain", "shared", pending_mode="mig")
    body = filter_body(client, gpu_pod("p", mem=1000), ["mps", "drain"])
    assert body["NodeNames"] == []
    unresolvable = body["FailedAndUnresolvableNodes"]
    assert unresolvable["mps"].startswith("no card is in shared mode")
    assert "draining for a mode change" in body["FailedNodes"]["drain"]
    body = filter_body(client, gpu_pod("q", mem=1000, annotations={"nvidia.com/vgpu-mode": "mps"}),
                       ["mps", "drain"])  # fmt: skip
    assert body["NodeNames"] == ["mps"]
