"""Tessera's own preemption: choose, hold, evict, tell, and free the room (docs/preemption.md)."""

from __future__ import annotations

from typing import Any

import pytest
from django.conf import settings
from django.utils import timezone

from controlplane.extender.preemption import preemptor as preempting
from controlplane.extender.preemption.preemptor import finish, preempt, preemptor, selector_matches
from controlplane.ledger.errors import AllocationRefused
from controlplane.ledger.models import AuditEvent, Nomination, PodBinding
from controlplane.ledger.services import bindings, decisions, nominations
from controlplane.ledger.why import pod_status as status_of
from controlplane.scheduling import parse_pod
from tests.builders import make_node
from tests.extender.builders import bind_args, filter_args
from tests.extender.conftest import post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db


def _bound(client, fake_kube, name: str, node: str, mem: int, priority: int, **labels: str):
    pod = gpu_pod(name, "ml", mem=mem)
    pod["spec"]["priority"] = priority
    pod["metadata"]["labels"] = labels
    fake_kube.add(pod)
    answer = post(client, "/scheduler/bind", bind_args(pod, node)).json()
    assert answer == {"Error": ""}, answer
    return pod


def _urgent(fake_kube, mem: int = 8000, priority: int = 1000, **spec: Any):
    pod = gpu_pod("urgent", "serving", mem=mem)
    pod["spec"].update(priority=priority, **spec)
    fake_kube.add(pod)
    request = parse_pod(pod)
    assert request is not None
    return pod, request


@pytest.fixture
def two_nodes(client, fake_kube) -> dict[str, Any]:
    """n1: two low-priority pods (3000 + 5000 MiB of 10000); n2: one of 9000 at priority 5."""
    make_node("n1", cards=1, memory_mib=10000)
    make_node("n2", cards=1, memory_mib=10000)
    return {
        "a": _bound(client, fake_kube, "a", "n1", 3000, 0, app="a"),
        "b": _bound(client, fake_kube, "b", "n1", 5000, 0, app="b"),
        "c": _bound(client, fake_kube, "c", "n2", 9000, 5, app="c"),
    }


def test_the_fewest_victims_are_evicted_and_the_room_is_held(client, fake_kube, two_nodes):
    _, request = _urgent(fake_kube, mem=8000)
    outcome = preempt(request, ["n1", "n2"], fake_kube)
    # One victim on n2 (c, priority 5) beats two on n1.
    assert (outcome.kind, outcome.node, outcome.victims) == ("nominated", "n2", ("ml/c",))
    assert fake_kube.evictions == [("ml", "c")]
    held = Nomination.objects.get(pod_uid=request.uid)
    assert held.node.name == "n2" and held.victims == ["ml/c"] and held.priority == 1000
    assert held.claims == {"GPU-n2-0": [8000, 0, 1, 0]}
    assert held.deadline > timezone.now()
    stored = fake_kube.pods[("serving", "urgent")]
    assert stored["status"]["nominatedNodeName"] == "n2"
    reasons = {(e["involvedObject"]["name"], e["reason"]) for e in fake_kube.events}
    assert {("c", "Preempted"), ("urgent", "Preempting")} <= reasons
    assert "room held until" in outcome.message
    assert AuditEvent.objects.filter(action="preempt", target="serving/urgent").exists()


def test_held_room_is_taken_for_other_pods_and_free_for_its_own(
    client, fake_kube, two_nodes, monkeypatch
):
    _, request = _urgent(fake_kube, mem=8000)
    outcome = preempt(request, ["n1", "n2"], fake_kube)
    assert outcome.node == "n2"
    # The victim ends and its slices are released (as finish does).
    assert finish(request, outcome, fake_kube, sleep=lambda s: None)
    assert not PodBinding.objects.get(pod_uid=two_nodes["c"]["metadata"]["uid"]).active
    touched = fake_kube.pods[("serving", "urgent")]["metadata"]["annotations"]
    assert preempting.FREED_ANNOTATION in touched

    # Another pod of lower priority does not fit there: the room is held.
    other = gpu_pod("other", "ml", mem=5000)
    fake_kube.add(other)
    answer = post(client, "/scheduler/filter", filter_args(other, ["n2"])).json()
    assert answer["NodeNames"] in ([], None)
    with pytest.raises(AllocationRefused):
        bindings.bind_pod(parse_pod(other), "n2")

    # The pod it is held for fits, and binding it ends the hold.
    monkeypatch.setitem(settings.TESSERA, "PREEMPTION", True)
    preemptor.refresh()
    pod = fake_kube.pods[("serving", "urgent")]
    answer = post(client, "/scheduler/filter", filter_args(pod, ["n2"])).json()
    assert answer["NodeNames"] == ["n2"]
    assert post(client, "/scheduler/bind", bind_args(pod, "n2")).json() == {"Error": ""}
    assert not Nomination.objects.filter(pod_uid=request.uid).exists()
    assert preemptor.held_node(request.uid) is None


def test_a_disruption_budget_moves_preemption_to_another_node(client, fake_kube, two_nodes):
    fake_kube.budgets = [
        {
            "metadata": {"name": "keep-c", "namespace": "ml"},
            "spec": {"selector": {"matchLabels": {"app": "c"}}},
            "status": {"disruptionsAllowed": 0},
        }
    ]
    _, request = _urgent(fake_kube, mem=8000)
    outcome = preempt(request, ["n1", "n2"], fake_kube)
    assert (outcome.kind, outcome.node) == ("nominated", "n1")
    assert sorted(outcome.victims) == ["ml/a", "ml/b"]
    assert ("ml", "c") not in fake_kube.evictions


def test_a_budget_everywhere_leaves_the_pod_pending_and_says_why(client, fake_kube, two_nodes):
    fake_kube.budgets = [
        {
            "metadata": {"name": "keep-all", "namespace": "ml"},
            "spec": {"selector": {}},
            "status": {"disruptionsAllowed": 0},
        }
    ]
    _, request = _urgent(fake_kube, mem=8000)
    outcome = preempt(request, ["n1", "n2"], fake_kube)
    assert outcome.kind == "none"
    assert "PodDisruptionBudget" in outcome.message and "ml/keep-all" in outcome.message
    assert fake_kube.evictions == [] and not Nomination.objects.exists()


def test_preemption_policy_never_evicts_nothing(client, fake_kube, two_nodes):
    _, request = _urgent(fake_kube, mem=8000, preemptionPolicy="Never")
    assert preempt(request, ["n1", "n2"], fake_kube).kind == "never"
    assert fake_kube.evictions == []


def test_equal_priority_pods_are_not_preempted(client, fake_kube, two_nodes):
    _, request = _urgent(fake_kube, mem=8000, priority=0)
    outcome = preempt(request, ["n1", "n2"], fake_kube)
    assert outcome.kind == "none" and fake_kube.evictions == []


def test_an_eviction_the_api_server_refuses_gives_the_hold_up(client, fake_kube, two_nodes):
    fake_kube.refuse_eviction = lambda ns, name: name == "c"
    _, request = _urgent(fake_kube, mem=8000)
    outcome = preempt(request, ["n1", "n2"], fake_kube)
    assert outcome.kind == "blocked" and "disruption budget" in outcome.message
    assert not Nomination.objects.filter(pod_uid=request.uid).exists()


def test_victims_that_outlive_the_hold_are_not_released(client, fake_kube, two_nodes, monkeypatch):
    monkeypatch.setattr(preempting, "HOLD_S", 0.0)
    monkeypatch.setattr(preempting, "DEFAULT_GRACE_S", 0)
    fake_kube.keep_evicted = True
    _, request = _urgent(fake_kube, mem=8000)
    outcome = preempt(request, ["n1", "n2"], fake_kube)
    assert not finish(request, outcome, fake_kube, sleep=lambda s: None)
    assert PodBinding.objects.get(pod_uid=two_nodes["c"]["metadata"]["uid"]).active


def test_an_expired_hold_is_dropped(client, fake_kube, two_nodes):
    _, request = _urgent(fake_kube, mem=8000)
    preempt(request, ["n1", "n2"], fake_kube)
    later = timezone.now() + preempting.timedelta(hours=1)
    assert nominations.expire_nominations(later) == [request.uid]
    assert not Nomination.objects.exists()


@pytest.mark.parametrize(
    ("selector", "labels", "matches"),
    [
        (None, {"app": "a"}, False),
        ({}, {"app": "a"}, True),
        ({"matchLabels": {"app": "a"}}, {"app": "a"}, True),
        ({"matchLabels": {"app": "a"}}, {"app": "b"}, False),
        ({"matchExpressions": [{"key": "app", "operator": "In", "values": ["a"]}]}, {"app": "a"},
         True),
        ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["a"]}]},
         {"app": "a"}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, {"app": "a"}, False),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, {"app": "a"}, True),
    ],
)  # fmt: skip
def test_disruption_budget_selectors(selector, labels, matches) -> None:
    assert selector_matches(selector, labels) is matches


def test_why_pending_tells_what_preemption_did(client, fake_kube, two_nodes):
    fake_kube.budgets = [
        {
            "metadata": {"name": "keep-all", "namespace": "ml"},
            "spec": {"selector": {}},
            "status": {"disruptionsAllowed": 0},
        }
    ]
    pod, request = _urgent(fake_kube, mem=8000)
    post(client, "/scheduler/filter", filter_args(pod, ["n1", "n2"]))
    preemptor.run_one(request, ["n1", "n2"], fake_kube)
    why = status_of("serving", "urgent")
    assert why is not None and why.outcome == "unschedulable"
    assert "Preemption: no node can make room" in why.text
    assert "ml/keep-all" in why.summary


def test_a_preemption_note_before_the_filters_decision_is_kept(client, fake_kube, two_nodes):
    pod, request = _urgent(fake_kube, mem=8000)
    decisions.note_preemption(request.uid, "serving", "urgent", "preempting ml/c on node n2")
    post(client, "/scheduler/filter", filter_args(pod, ["n1", "n2"]))  # writes its decision
    why = status_of("serving", "urgent")
    assert why is not None and why.outcome == "unschedulable"
    assert why.summary.endswith("Preemption: preempting ml/c on node n2")


def test_a_pod_no_lower_than_every_slice_holder_costs_no_search(
    client, fake_kube, two_nodes, django_assert_max_num_queries
):
    worker = preempting.Preemptor()
    _, request = _urgent(fake_kube, mem=8000, priority=0)  # the low pods are at 0 too
    with django_assert_max_num_queries(4):  # expiry (a transaction), the lowest priority; no node
        outcome = worker.run_one(request, ["n1", "n2"], fake_kube)
    assert outcome.kind == "none" and "lower priority" in outcome.message
    assert fake_kube.evictions == []
