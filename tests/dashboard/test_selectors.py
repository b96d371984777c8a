"""Dashboard selectors: figures that agree with the scheduler, fragmentation, fixed query counts."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from django.utils import timezone

from controlplane.dashboard import selectors
from controlplane.ledger import usage as ledger_usage
from controlplane.ledger.models import Card, Node
from tests.dashboard.builders import decision, make_node, pod
from tests.pods import gpu_container

pytestmark = pytest.mark.django_db


def test_overview_totals_and_pending() -> None:
    make_node("n1", cards=2, memory_mib=10000)
    make_node("n2", cards=2, memory_mib=10000, healthy=False, health_reason="XID 48")
    pod("a", "n1", gpu_container(mem=3000, cores=20), namespace="team-a")
    pod("b", "n1", gpu_container(gpus=2, mem=2000, cores=30), namespace="team-b", phase="reserved")
    pod("gone", "n1", gpu_container(mem=4000), phase="released")
    decision("waiting")  # unschedulable, holds nothing: pending
    decision("a", namespace="team-a")  # unschedulable earlier, but now holds a binding
    decision("fine", outcome="feasible")
    Node.objects.filter(name="n2").update(cordoned=True)
    Card.objects.filter(uuid="GPU-n1-1").update(cordoned=True)

    stats = selectors.cluster_overview()
    assert (stats.nodes, stats.nodes_ready, stats.nodes_cordoned) == (2, 2, 1)
    assert (stats.cards, stats.cards_unhealthy, stats.cards_cordoned) == (4, 2, 1)
    assert stats.memory_total_mib == 40000
    assert stats.memory_allocated_mib == 7000  # released pod not counted
    assert (stats.compute_total, stats.compute_allocated) == (400, 80)
    assert (stats.slices, stats.slots_allocated, stats.slots_total) == (3, 3, 40)
    assert (stats.pending_reserved, stats.pending_unschedulable) == (1, 1)
    assert stats.pending_pods == 2
    assert stats.memory_percent == pytest.approx(17.5)


def test_missing_cards_are_not_capacity() -> None:
    make_node("n1", cards=2, memory_mib=10000)
    Card.objects.filter(uuid="GPU-n1-1").update(present=False)
    stats = selectors.cluster_overview()
    assert (stats.cards, stats.cards_missing, stats.memory_total_mib) == (1, 1, 10000)


@pytest.mark.parametrize(
    ("free", "slots", "exclusive", "size", "stranded"),
    [
        (10000, 5, False, 3000, 1000),  # three fit, 1000 left over
        (10000, 2, False, 3000, 4000),  # only two slots left
        (10000, 0, False, 3000, 10000),  # no slot: all of it stranded
        (10000, 5, True, 3000, 10000),  # held exclusively: nothing else may share
        (2999, 5, False, 3000, 2999),  # smaller than one request
        (9000, 5, False, 3000, 0),  # exact fit
        (5000, 5, False, None, 0),  # no slices, no common size, nothing stranded
        (0, 5, False, 3000, 0),
    ],
)
def test_stranded_memory(free: int, slots: int, exclusive: bool, size: Any, stranded: int) -> None:
    assert selectors.stranded_memory(free, slots, exclusive, size) == stranded


def test_common_request_size_prefers_most_common_then_smaller() -> None:
    assert selectors.common_request_size(Counter({3000: 2, 1000: 1})) == 3000
    assert selectors.common_request_size(Counter({3000: 2, 1000: 2})) == 1000
    assert selectors.common_request_size(Counter()) is None


def test_fragmentation_counts_only_schedulable_cards() -> None:
    make_node("n1", cards=3, memory_mib=10000)
    make_node("n2", cards=1, memory_mib=10000)
    for i in range(2):  # 3000 MiB is the most common size
        pod(f"p{i}", "n1", gpu_container(mem=3000))
    pod("big", "n1", gpu_container(mem=6000))
    Card.objects.filter(node__name="n2").update(cordoned=True)
    stats = selectors.cluster_overview()
    frag = stats.fragmentation
    assert frag.common_request_mib == 3000
    # n1's cards hold 3000, 3000, 6000 (spread): free 7000, 7000, 4000 -> stranded 1000+1000+1000
    assert frag.free_mib == 18000
    assert frag.stranded_mib == 3000
    assert frag.percent == pytest.approx(100 * 3000 / 18000)


def test_card_views_and_quota_rows_show_the_ledgers_usage() -> None:
    make_node("n1", cards=3, memory_mib=20000)
    pod("plain", "n1", gpu_container(mem=2000, cores=10), namespace="team-a")
    pod(
        "with-init",
        "n1",
        gpu_container("app", mem=1000, cores=10),
        namespace="team-a",
        init_containers=[gpu_container("setup", mem=5000, cores=40)],
    )
    held = ledger_usage.card_usage()
    views = {c.id: c.usage for c in selectors.card_views(Card.objects.all())}
    assert views == {cid: held.get(cid, ledger_usage.EMPTY_CARD) for cid in views}
    assert sum(u.memory_mib for u in views.values()) == 2000 + 5000  # init at its peak
    rows = {r.namespace: r for r in selectors.quota_rows()}
    want = ledger_usage.quota_usage("team-a")
    got = rows["team-a"]
    assert (got.used_memory_mib, got.used_cores, got.used_gpus) == (
        want.memory_mib, want.cores, want.gpus
    )  # fmt: skip
    assert want.memory_mib == 7000 and not got.has_quota


def test_explain_pod_in_plain_words() -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod("runs", "n1", gpu_container(mem=1000))
    pod("waits", "n1", gpu_container(mem=1000), phase="reserved")
    decision(
        "stuck",
        summary="No node has a card with 90000 MiB free.",
        reason_counts={"insufficient_memory": 3},
        nodes_considered=3,
    )
    runs = selectors.pod_detail("default", "runs")
    assert runs.why.startswith("Not pending") and "n1" in runs.why
    assert "waiting for the Kubernetes API server" in selectors.pod_detail("default", "waits").why
    stuck = selectors.pod_detail("default", "stuck").why
    assert stuck.startswith("Pending: No node has a card with 90000 MiB free.")
    assert "3 node(s): insufficient memory" in stuck
    assert "no record" in selectors.pod_detail("default", "ghost").why


def _grow(n: int) -> None:
    """Add `n` nodes of 4 cards, each card holding a pod, some pending and some quotas."""
    start = Node.objects.count()
    for i in range(start, start + n):
        make_node(f"g{i}", cards=4, memory_mib=10000)
        for j in range(4):
            pod(f"p{i}-{j}", f"g{i}", gpu_container(mem=1000), namespace=f"ns{j}")
        decision(f"w{i}", namespace=f"ns{i % 3}", decided_at=timezone.now())
    from controlplane.ledger.models import AuditEvent, NamespaceQuota

    for j in range(4):
        NamespaceQuota.objects.get_or_create(namespace=f"ns{j}", defaults={"gpus": 100})
    AuditEvent.objects.create(actor="t", action="card-health", target_type="card", target="x")


SELECTORS = {
    "overview": (selectors.cluster_overview, 7),
    "pending": (selectors.pending_pods, 2),
    "attention": (selectors.attention_cards, 1),
    "node_page": (lambda: list(selectors.node_page(1).object_list), 4),
    "node_detail": (lambda: selectors.node_detail("g0"), 3),
    "card_detail": (lambda: selectors.card_detail("GPU-g0-0"), 4),
    "binding_page": (
        lambda: list(selectors.binding_page(selectors.BindingFilters(namespace="ns1")).object_list),
        3,
    ),
    "pod_detail": (lambda: selectors.pod_detail("ns1", "p0-1"), 4),
    "quota_rows": (selectors.quota_rows, 3),
    "audit_page": (lambda: list(selectors.audit_page(action="card-health").object_list), 2),
}


@pytest.mark.parametrize("name", list(SELECTORS))
def test_query_counts_are_fixed(name: str, django_assert_num_queries: Any) -> None:
    call, queries = SELECTORS[name]
    _grow(1)
    with django_assert_num_queries(queries):
        call()
    _grow(6)
    with django_assert_num_queries(queries):
        call()
