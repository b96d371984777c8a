"""What would make a pending pod fit: largest free room, oldest holders, quota in the way."""

from __future__ import annotations

import itertools
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.access.roles import Role
from controlplane.ledger import fit_hints
from controlplane.ledger.models import Card, Node, PodBinding
from controlplane.ledger.services.cordons import set_card_cordon, set_node_cordon
from controlplane.ledger.services.quotas import QuotaLimitsInput, set_quota
from tests.builders import token_client
from tests.dashboard.builders import decision, make_node, pod, signed_in
from tests.pods import gpu_container

pytestmark = pytest.mark.django_db

GiB = 1024


_serial = itertools.count()


def hints(namespace: str = "team-a", outcome: str = "unschedulable", **kw: Any):
    n = next(_serial)
    row = decision(f"big-{n}", namespace=namespace, pod_uid=f"uid-big-{n}", **kw)
    found = fit_hints.hints_for(namespace, outcome, row)
    assert found is not None
    return found


def test_the_largest_free_room_is_on_a_card_that_takes_new_slices() -> None:
    make_node("a", cards=2, memory_mib=80 * GiB)
    make_node("b", cards=1, memory_mib=40 * GiB)
    pod("p0", "a", gpu_container(mem=70 * GiB, cores=10))  # a-0 or a-1 keeps 10 GiB free
    pod("p1", "a", gpu_container(mem=20 * GiB, cores=10))  # the other keeps 60 GiB
    room = hints().largest_free
    assert room is not None and room.node == "a" and room.free_memory_mib == 60 * GiB
    assert room.free_slots > 0 and room.mode == "shared"
    best = room.card

    # every reason a card takes no new slice moves the answer elsewhere
    set_card_cordon(best, True, "alice", "")
    assert hints().largest_free.card == "GPU-b-0"  # 40 GiB, now the most
    set_card_cordon(best, False, "alice", "")
    Card.objects.filter(uuid=best).update(pending_mode="mig")
    assert hints().largest_free.card == "GPU-b-0"
    Card.objects.filter(uuid=best).update(pending_mode="", healthy=False)
    assert hints().largest_free.card == "GPU-b-0"
    Card.objects.filter(uuid=best).update(healthy=True)
    set_node_cordon("a", True, "alice", "")
    assert hints().largest_free.card == "GPU-b-0"
    set_node_cordon("a", False, "alice", "")
    Node.objects.filter(name="a").update(ready=False)
    assert hints().largest_free.card == "GPU-b-0"
    Node.objects.filter(name="a").update(ready=True)
    assert hints().largest_free.card == best


def test_no_room_beside_an_exclusive_slice_or_without_a_free_slot() -> None:
    make_node("a", cards=1, memory_mib=80 * GiB)
    make_node("b", cards=1, memory_mib=80 * GiB)
    make_node("c", cards=1, memory_mib=24 * GiB)
    pod("whole", "a", gpu_container(mem=1 * GiB, cores=100))  # 79 GiB free, but exclusive
    Card.objects.filter(uuid="GPU-b-0").update(slots=1)
    pod("one", "b", gpu_container(mem=1 * GiB, cores=10))  # 79 GiB free, no slot
    found = hints()
    assert found.largest_free.card == "GPU-c-0"
    assert "Largest free room: 24576 MiB, 100% compute" in found.lines[0]


def test_the_best_card_to_wait_for_and_its_oldest_holders() -> None:
    make_node("a", cards=1, memory_mib=80 * GiB)
    make_node("b", cards=1, memory_mib=80 * GiB)
    make_node("idle", cards=1, memory_mib=80 * GiB)  # the most free room, but nobody to wait for
    pod("b-big", "b", gpu_container(mem=60 * GiB, cores=50))  # b: 20 GiB free
    holders = []
    for i in range(4):
        holders.append(pod(f"a-{i}", "a", gpu_container(mem=4 * GiB, cores=5), namespace="t"))
    # a: 64 GiB free, the occupied card with the most: the one to wait for
    start = timezone.now() - timedelta(hours=5)
    for i, binding in enumerate(holders):  # created in the order 3, 1, 2, 0
        at = start + timedelta(minutes={3: 0, 1: 1, 2: 2, 0: 3}[i])
        PodBinding.objects.filter(pk=binding.pk).update(created_at=at)
    found = hints()
    assert found.largest_free.card == "GPU-idle-0"
    assert found.candidate is not None and found.candidate.card == "GPU-a-0"
    assert [h.name for h in found.holders] == ["a-3", "a-1", "a-2"]  # oldest first, three
    assert all(h.memory_mib == 4 * GiB and h.cores == 5 for h in found.holders)
    assert "t/a-3 (4096 MiB, 5%" in found.lines[1] and "not known" in found.lines[1]


def test_a_holder_counts_what_it_holds_while_it_runs() -> None:
    make_node("a", cards=1, memory_mib=80 * GiB)
    pod(
        "with-init",
        "a",
        gpu_container("app", mem=2 * GiB, cores=10),
        init_containers=[gpu_container("setup", mem=30 * GiB, cores=50)],
    )
    (holder,) = hints().holders
    assert (holder.memory_mib, holder.cores) == (2 * GiB, 10)


def test_the_quota_that_stands_in_the_way() -> None:
    make_node("a", cards=2, memory_mib=80 * GiB)
    pod("p", "a", gpu_container(mem=10 * GiB, cores=30), namespace="team-a")
    pod("q", "a", gpu_container(mem=10 * GiB, cores=30), namespace="team-b")
    assert hints().quota is None  # no quota, nothing said
    set_quota("team-a", QuotaLimitsInput(gpumem_mib=40 * GiB, gpucores=None, gpus=1), "alice")
    quota = hints().quota
    assert quota is not None and quota.in_the_way  # one slice of one: used up
    limits = {q.resource: (q.limit, q.used, q.left) for q in quota.limits}
    assert limits == {"gpumem_mib": (40 * GiB, 10 * GiB, 30 * GiB), "gpus": (1, 1, 0)}
    set_quota("team-a", QuotaLimitsInput(gpumem_mib=40 * GiB, gpucores=None, gpus=5), "alice")
    found = hints()
    assert not found.quota.in_the_way
    assert "Quota of team-a leaves room: GPU memory 10240 of 40960 MiB used" in found.lines[-1]
    # the scheduler's own refusal for the quota is the stronger fact
    refused = hints(reason_counts={"QuotaExceeded": 2})
    assert refused.quota.in_the_way and "stands in the way" in refused.lines[-1]


def test_only_a_pod_waiting_for_room_gets_hints(django_assert_num_queries: Any) -> None:
    make_node("a", cards=1)
    with django_assert_num_queries(0):
        for outcome in ("bound", "feasible", "invalid", "reserved", "released"):
            assert fit_hints.hints_for("team-a", outcome, None) is None
    assert fit_hints.hints_for("team-a", "bind_failed", None) is not None


def test_hints_read_in_a_fixed_number_of_queries(django_assert_num_queries: Any) -> None:
    set_quota("team-a", QuotaLimitsInput(gpumem_mib=10**6, gpucores=None, gpus=None), "alice")
    make_node("a", cards=2)
    pod("p", "a", gpu_container(mem=1024), namespace="team-a")
    with django_assert_num_queries(7):
        fit_hints.hints_for("team-a", "unschedulable", None)
    for i in range(6):
        make_node(f"n{i}", cards=4)
        for j in range(3):
            pod(f"p{i}-{j}", f"n{i}", gpu_container(mem=1024), namespace="team-a")
    with django_assert_num_queries(7):
        fit_hints.hints_for("team-a", "unschedulable", None)


def test_the_rest_answer_and_the_pod_page_carry_the_hints() -> None:
    make_node("a", cards=1, memory_mib=80 * GiB)
    pod("p", "a", gpu_container(mem=60 * GiB, cores=10), namespace="team-a")
    set_quota("team-a", QuotaLimitsInput(gpumem_mib=64 * GiB, gpucores=None, gpus=None), "alice")
    decision("big", namespace="team-a", reason_counts={"InsufficientMemory": 1})
    body = token_client("vera", Role.VIEWER).get("/api/v1/pods/team-a/big/why").json()
    fit = body["fit"]
    assert fit["largest_free"]["card"] == "GPU-a-0"
    assert fit["largest_free"]["free_memory_mib"] == 20 * GiB
    assert [h["name"] for h in fit["holders"]] == ["p"] and fit["holders_order"] == "oldest"
    assert fit["quota"]["limits"]["gpumem_mib"] == {
        "limit": 64 * GiB,
        "used": 60 * GiB,
        "left": 4 * GiB,
    }
    page = signed_in(Role.VIEWER).get("/pods/team-a/big/").content.decode()
    assert "What would make it fit" in page
    assert "Largest free room: 20480 MiB" in page and 'href="/cards/GPU-a-0/"' in page
    # a running pod gets none
    assert token_client("vera", Role.VIEWER).get("/api/v1/pods/team-a/p/why").json()["fit"] is None
