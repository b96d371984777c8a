"""`services.claims.mirror_claim`: a ResourceClaim's allocation written as a binding row."""

from __future__ import annotations

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.ledger import selectors
from controlplane.ledger.errors import NotFound
from controlplane.ledger.models import AuditEvent, PodBinding, Slice
from controlplane.ledger.services import bindings
from controlplane.ledger.services.claims import ClaimRecord, ClaimSlice, mirror_claim, mirror_claims
from controlplane.scheduling import parse_pod
from tests.builders import make_node
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def _nodes(db: None) -> None:
    make_node("n1", cards=2, memory_mib=10000)
    make_node("n2", cards=1, memory_mib=10000)


def record(*slices: ClaimSlice, node: str = "n1", uid: str = "uid-c") -> ClaimRecord:
    return ClaimRecord(uid, "team", "c", node, slices)


def active(uid: str = "uid-c") -> list[tuple[str, str, int, int, int]]:
    return sorted(
        Slice.objects.filter(binding__pod_uid=uid, active=True).values_list(
            "card__uuid", "container_name", "container_index", "memory_mib", "compute_percent"
        )
    )


def test_a_claim_is_created_once_then_unchanged_then_follows_its_allocation() -> None:
    first = mirror_claim(record(ClaimSlice("GPU-n1-0", "gpu", 0, 2000, 20)), "reconciler")
    assert first.outcome == "created"
    binding = PodBinding.objects.get(pod_uid="uid-c")
    assert (binding.source, binding.phase, binding.node.name) == ("claim", "bound", "n1")
    assert active() == [("GPU-n1-0", "gpu", 0, 2000, 20)]
    # the routine path: not audited
    assert not AuditEvent.objects.filter(action="mirror-claim").exists()

    same = mirror_claim(record(ClaimSlice("GPU-n1-0", "gpu", 0, 2000, 20)), "reconciler")
    assert same.outcome == "unchanged" and same.binding_id == first.binding_id

    moved = mirror_claim(
        record(ClaimSlice("GPU-n2-0", "gpu", 0, 3000, 30), node="n2"), "reconciler"
    )
    assert moved.outcome == "updated" and moved.binding_id == first.binding_id
    assert PodBinding.objects.get(pod_uid="uid-c").node.name == "n2"
    assert active() == [("GPU-n2-0", "gpu", 0, 3000, 30)]
    assert Slice.objects.filter(binding__pod_uid="uid-c").count() == 1  # the old one is gone
    assert AuditEvent.objects.get(action="mirror-claim").details["outcome"] == "updated"


def test_a_released_claim_allocated_again_takes_its_row_back() -> None:
    mirror_claim(record(ClaimSlice("GPU-n1-0", "gpu", 0, 2000, 20)), "reconciler")
    assert bindings.release_bindings(["uid-c"], "the claim was deallocated") == ["uid-c"]
    again = mirror_claim(record(ClaimSlice("GPU-n1-1", "gpu", 0, 1000, 0)), "reconciler")
    assert again.outcome == "updated"
    binding = PodBinding.objects.get(pod_uid="uid-c")
    assert binding.phase == "bound" and binding.released_at is None
    assert active() == [("GPU-n1-1", "gpu", 0, 1000, 0)]


@pytest.mark.parametrize(
    ("claim", "says"),
    [
        (record(ClaimSlice("GPU-n1-0", "gpu", 0, 1, 0), node="n7"), "node 'n7' is not registered"),
        (record(ClaimSlice("GPU-n2-0", "gpu", 0, 1, 0)), "GPU-n2-0 .* not on node n1"),
        (record(ClaimSlice("GPU-nope", "gpu", 0, 1, 0)), "GPU-nope"),
    ],
    ids=["unknown-node", "card-of-another-node", "unknown-card"],
)
def test_a_claim_the_ledger_cannot_place_changes_nothing(claim: ClaimRecord, says: str) -> None:
    with pytest.raises(NotFound, match=says):
        mirror_claim(claim, "reconciler")
    assert not PodBinding.objects.exists() and not Slice.objects.exists()


def test_a_pods_binding_is_never_taken_for_a_claim() -> None:
    request = parse_pod(pod_json("p", containers=[gpu_container(mem=1000)]))
    assert request is not None
    bindings.bind_pod(request, "n1")
    with pytest.raises(NotFound, match="a pod's binding"):
        mirror_claim(record(ClaimSlice("GPU-n1-1", "gpu", 0, 1, 0), uid=request.uid), "r")
    assert PodBinding.objects.get(pod_uid=request.uid).source == "pod"


def test_an_allocation_past_what_the_ledger_thinks_free_is_recorded_and_audited() -> None:
    mirror_claim(record(ClaimSlice("GPU-n1-0", "gpu", 0, 8000, 50)), "reconciler")
    over = mirror_claim(
        record(ClaimSlice("GPU-n1-0", "gpu", 0, 8000, 50), uid="uid-d"), "reconciler"
    )
    assert over.outcome == "created" and over.overcommitted_cards == ("GPU-n1-0",)
    event = AuditEvent.objects.get(action="mirror-claim", details__uid="uid-d")
    assert event.details["overcommitted_cards"] == ["GPU-n1-0"]


def test_mirrored_claims_reads_rows_and_slices_as_the_record_says_them() -> None:
    slices = (ClaimSlice("GPU-n1-0", "a", 0, 100, 1), ClaimSlice("GPU-n1-1", "b", 1, 200, 2))
    mirror_claim(record(*slices), "reconciler")
    for uids in (None, ["uid-c"]):
        found = selectors.mirrored_claims(uids)
        assert set(found) == {"uid-c"}
        assert found["uid-c"].node == "n1" and found["uid-c"].slices == frozenset(slices)


def test_the_allocations_api_reads_a_pods_row_before_a_claims_of_the_same_name() -> None:
    slices = (ClaimSlice("GPU-n1-1", "gpu", 0, 500, 5),)
    mirror_claim(ClaimRecord("uid-claim-p", "default", "p", "n1", slices), "reconciler")
    only_claim = selectors.active_allocation_of_pod("default", "p")
    assert only_claim is not None and only_claim.record["pod_uid"] == "uid-claim-p"
    request = parse_pod(pod_json("p", containers=[gpu_container(mem=1000)]))
    assert request is not None
    bindings.bind_pod(request, "n1")
    both = selectors.active_allocation_of_pod("default", "p")
    assert both is not None and both.record["pod_uid"] == request.uid


def test_a_batch_writes_what_it_can_place_and_refuses_the_rest_naming_why() -> None:
    good = [record(ClaimSlice("GPU-n1-0", "gpu", 0, 100, 1), uid=f"uid-{i}") for i in range(3)]
    stray = record(ClaimSlice("GPU-n2-0", "gpu", 0, 100, 1), uid="uid-stray")  # n2's card
    batch = mirror_claims([*good, stray], "reconciler")
    assert [(d.uid, d.outcome) for d in batch.done] == [(f"uid-{i}", "created") for i in range(3)]
    assert [(r.uid, "not on node n1" in why) for r, why in batch.refused] == [("uid-stray", True)]
    assert not PodBinding.objects.filter(pod_uid="uid-stray").exists()
    assert [active(f"uid-{i}") for i in range(3)] == [[("GPU-n1-0", "gpu", 0, 100, 1)]] * 3


def test_new_claims_cost_the_same_queries_however_many(django_assert_max_num_queries) -> None:
    def claims(n: int, prefix: str) -> list[ClaimRecord]:
        return [
            record(ClaimSlice(f"GPU-n1-{i % 2}", "gpu", 0, 10, 0), uid=f"{prefix}-{i}")
            for i in range(n)
        ]

    with CaptureQueriesContext(connection) as two:
        mirror_claims(claims(2, "a"), "reconciler")
    with django_assert_max_num_queries(len(two.captured_queries)):
        mirror_claims(claims(16, "b"), "reconciler")  # 9 slices a card: none over its 10
    assert PodBinding.objects.filter(source="claim").count() == 18
