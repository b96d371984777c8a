"""Ledger services: reserve / confirm / release under the node lock, quotas, idempotency."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Sum
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.ledger import errors, selectors, usage
from controlplane.ledger.models import Card, NamespaceQuota, PodBinding, Slice
from controlplane.ledger.services import bindings
from controlplane.scheduling import ReasonCode, parse_pod
from tests.builders import card_report, make_node
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db


def request_for(name: str, *containers: dict, namespace: str = "default", **kw):
    parsed = parse_pod(pod_json(name, namespace, containers=list(containers), **kw))
    assert parsed is not None
    return parsed


def allocated_mib(uuid: str) -> int:
    total = Slice.objects.filter(card__uuid=uuid, active=True).aggregate(s=Sum("memory_mib"))["s"]
    return total or 0


def test_reserve_writes_binding_and_slices_on_distinct_cards() -> None:
    make_node("n1", cards=4, memory_mib=10000)
    reservation = bindings.bind_pod(
        request_for("p", gpu_container("a", gpus=2, mem=3000, cores=20)), "n1"
    )
    assert reservation.phase == PodBinding.Phase.RESERVED and not reservation.repeat
    assert [(a.container_name, a.memory_mib, a.cores) for a in reservation.assignments] == [
        ("a", 3000, 20), ("a", 3000, 20)
    ]  # fmt: skip
    binding = PodBinding.objects.get(pk=reservation.binding_id)
    assert binding.phase == PodBinding.Phase.RESERVED and binding.deadline is not None
    slices = list(binding.slices.select_related("card"))
    assert len(slices) == 2
    assert len({s.card.uuid for s in slices}) == 2
    assert {s.card.uuid for s in slices} == {a.card_uuid for a in reservation.assignments}
    assert all(s.memory_mib == 3000 and s.compute_percent == 20 and s.active for s in slices)
    assert binding.request["uid"] == "uid-default-p"
    record = reservation.allocation()
    assert [d["uuid"] for d in record["containers"][0]["devices"]] == sorted(
        s.card.uuid for s in slices
    )  # in card index order: the order the container sees its cards in


def test_reserve_is_idempotent_per_pod_uid_and_conflicts_on_another_node() -> None:
    make_node("n1", cards=1, memory_mib=10000)
    make_node("n2", cards=1, memory_mib=10000)
    req = request_for("p", gpu_container(mem=4000))
    first = bindings.bind_pod(req, "n1")
    again = bindings.bind_pod(req, "n1")
    assert again.binding_id == first.binding_id and again.repeat and not first.repeat
    assert again.assignments == first.assignments and again.allocation() == first.allocation()
    assert Slice.objects.filter(active=True).count() == 1
    with pytest.raises(errors.Conflict) as err:
        bindings.bind_pod(req, "n2")
    assert "n1" in err.value.message
    assert Slice.objects.filter(active=True).count() == 1


def test_reserve_refuses_when_room_is_gone_and_writes_nothing() -> None:
    make_node("n1", cards=1, memory_mib=10000)
    bindings.bind_pod(request_for("p1", gpu_container(mem=7000)), "n1")
    with pytest.raises(errors.AllocationRefused) as err:
        bindings.bind_pod(request_for("p2", gpu_container(mem=4000)), "n1")
    assert err.value.refusals[0].code == ReasonCode.INSUFFICIENT_MEMORY
    assert "n1" in err.value.message
    assert PodBinding.objects.count() == 1
    assert allocated_mib("GPU-n1-0") == 7000


def test_unknown_node_is_not_found() -> None:
    with pytest.raises(errors.NotFound):
        bindings.bind_pod(request_for("p", gpu_container(mem=1)), "nope")
    assert not PodBinding.objects.exists()


def test_release_frees_the_room_and_is_idempotent() -> None:
    make_node("n1", cards=1, memory_mib=10000)
    bindings.bind_pod(request_for("p1", gpu_container(mem=7000)), "n1")
    released = bindings.release_binding("uid-default-p1", "pod deleted")
    assert released is not None and released.phase == PodBinding.Phase.RELEASED
    assert allocated_mib("GPU-n1-0") == 0
    assert bindings.release_binding("uid-default-p1", "again").phase == PodBinding.Phase.RELEASED
    assert bindings.release_binding("unknown", "x") is None
    bindings.bind_pod(request_for("p2", gpu_container(mem=9000)), "n1")
    assert allocated_mib("GPU-n1-0") == 9000
    with pytest.raises(errors.Conflict):  # an ended pod is never bound again
        bindings.bind_pod(request_for("p1", gpu_container(mem=1)), "n1")


def test_confirm_moves_reserved_to_bound_once() -> None:
    make_node("n1", cards=1)
    bindings.bind_pod(request_for("p", gpu_container(mem=1000)), "n1")
    bound = bindings.confirm_binding("uid-default-p")
    assert (bound.pod_uid, bound.node, bound.phase) == ("uid-default-p", "n1", "bound")
    assert PodBinding.objects.get(pod_uid="uid-default-p").deadline is None
    assert bound.bound_at is not None
    assert bindings.confirm_binding("uid-default-p").bound_at == bound.bound_at
    bindings.release_binding("uid-default-p", "done")
    with pytest.raises(errors.Conflict):
        bindings.confirm_binding("uid-default-p")
    with pytest.raises(errors.NotFound):
        bindings.confirm_binding("missing")


def test_confirm_bindings_moves_many_reservations_in_one_statement() -> None:
    make_node("n1", cards=1, memory_mib=80000)
    for name in ("a", "b", "c", "d"):
        bindings.bind_pod(request_for(name, gpu_container(mem=1000)), "n1")
    bindings.confirm_binding("uid-default-c")  # already bound: left as it is
    c_bound_at = PodBinding.objects.get(pod_uid="uid-default-c").bound_at
    bindings.release_binding("uid-default-d", "gone")  # ended: never bound again
    at_a = timezone.now() - timedelta(seconds=2)
    at_b = at_a + timedelta(milliseconds=1500)
    written_from = timezone.now()
    with CaptureQueriesContext(connection) as queries:
        changed = bindings.confirm_bindings(
            [("uid-default-a", at_a), ("uid-default-b", at_b), ("uid-default-c", at_b),
             ("uid-default-d", at_b), ("missing", at_b)]
        )  # fmt: skip
    assert changed == 2
    assert len(queries) == 1
    rows = {
        b.pod_uid.removeprefix("uid-default-"): b for b in PodBinding.objects.order_by("pod_uid")
    }
    assert [(n, b.phase) for n, b in rows.items()] == [
        ("a", "bound"), ("b", "bound"), ("c", "bound"), ("d", "released")
    ]  # fmt: skip
    assert (rows["a"].bound_at, rows["b"].bound_at) == (at_a, at_b)
    # bound_at is when the API server accepted the Binding; the change stamp is the write's time
    # (a retried confirmation lands later than its Binding)
    assert rows["a"].deadline is None and rows["a"].updated_at >= written_from > at_b
    assert rows["c"].bound_at == c_bound_at
    assert bindings.confirm_bindings([]) == 0


def test_failed_binding_can_be_retried_on_another_node() -> None:
    make_node("n1", cards=1)
    make_node("n2", cards=1)
    req = request_for("p", gpu_container(mem=1000))
    bindings.bind_pod(req, "n1")
    failed = bindings.release_binding(req.uid, "API server refused", failed=True)
    assert failed is not None and failed.phase == PodBinding.Phase.FAILED
    assert failed.reason == "API server refused" and failed.released_at is not None
    retried = bindings.bind_pod(req, "n2")
    assert retried.binding_id == failed.binding_id and retried.node == "n2" and not retried.repeat
    row = PodBinding.objects.get(pk=retried.binding_id)
    assert row.node.name == "n2"
    assert list(row.slices.filter(active=True).values_list("card__node__name", flat=True)) == ["n2"]


def test_quota_refuses_past_the_limit_and_counts_only_active_bindings() -> None:
    make_node("n1", cards=4, memory_mib=10000)
    NamespaceQuota.objects.create(namespace="team-a", gpumem_mib=5000, gpus=3)
    bindings.bind_pod(request_for("a", gpu_container(mem=3000), namespace="team-a"), "n1")
    with pytest.raises(errors.AllocationRefused) as err:
        bindings.bind_pod(request_for("b", gpu_container(mem=3000), namespace="team-a"), "n1")
    assert err.value.refusals[0].code == ReasonCode.QUOTA_EXCEEDED
    assert "team-a" in err.value.message
    # another namespace is not limited
    bindings.bind_pod(request_for("c", gpu_container(mem=3000), namespace="other"), "n1")
    bindings.release_binding("uid-team-a-a", "ended")
    bindings.bind_pod(request_for("b", gpu_container(mem=3000), namespace="team-a"), "n1")
    held = usage.quota_usage("team-a")
    assert (held.memory_mib, held.gpus) == (3000, 1)


def test_cards_missing_from_a_report_keep_slices_but_take_no_new_ones() -> None:
    make_node("n1", cards=2, memory_mib=10000)
    bindings.bind_pod(request_for("p", gpu_container(gpus=2, mem=1000)), "n1")
    from controlplane.ledger.services.nodes import InventoryReport, apply_inventory

    apply_inventory("n1", InventoryReport("t", (card_report("GPU-n1-0", 0, 10000),)), actor="test")
    assert Card.objects.get(uuid="GPU-n1-1").present is False
    assert Slice.objects.filter(card__uuid="GPU-n1-1", active=True).count() == 1
    with pytest.raises(errors.AllocationRefused):
        bindings.bind_pod(request_for("q", gpu_container(gpus=2, mem=1000)), "n1")
    state = selectors.cluster_snapshot().nodes[0]
    missing = next(c for c in state.cards if c.uuid == "GPU-n1-1")
    assert not missing.healthy and missing.health_reason == selectors.MISSING_CARD_REASON


def test_snapshot_uses_a_fixed_number_of_queries(django_assert_num_queries) -> None:
    for i in range(3):
        make_node(f"n{i}", cards=2, memory_mib=10000)
    bindings.bind_pod(request_for("p", gpu_container(mem=1000)), "n0")
    with django_assert_num_queries(4):
        small = selectors.cluster_snapshot()
    for i in range(3, 12):
        make_node(f"n{i}", cards=4, memory_mib=10000)
    for i in range(10):
        bindings.bind_pod(request_for(f"q{i}", gpu_container(mem=500)), f"n{3 + i % 9}")
    with django_assert_num_queries(4):
        big = selectors.cluster_snapshot()
    assert len(small.nodes) == 3 and len(big.nodes) == 12
    used = sum(c.used_memory_mib for n in big.nodes for c in n.cards)
    assert used == 1000 + 10 * 500


def test_init_container_peak_is_counted_once_per_card() -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = pod_json("p", containers=[gpu_container("app", mem=3000)])
    pod["spec"]["initContainers"] = [gpu_container("init", mem=5000)]
    req = parse_pod(pod)
    assert req is not None
    bindings.bind_pod(req, "n1")
    card = selectors.cluster_snapshot().nodes[0].cards[0]
    assert card.used_memory_mib == 5000  # max(init 5000, app 3000), not the sum
    assert card.used_slots == 1
