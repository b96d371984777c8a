"""The ledger's one usage arithmetic: per card and per namespace, init containers at their peak,
the same figures the scheduling core's snapshot holds."""

from __future__ import annotations

import pytest

from controlplane.ledger import selectors, sql, usage
from controlplane.ledger.models import Card
from controlplane.scheduling import EXCLUSIVE_CORES, QuotaUsage
from tests.dashboard.builders import make_node, pod
from tests.pods import gpu_container

pytestmark = pytest.mark.django_db


def test_card_usage_matches_the_schedulers_snapshot_with_init_containers() -> None:
    make_node("n1", cards=3, memory_mib=20000)
    pod("excl", "n1", gpu_container(mem=1000, cores=EXCLUSIVE_CORES))
    pod("plain", "n1", gpu_container(mem=2000, cores=EXCLUSIVE_CORES - 1))
    pod(
        "with-init",
        "n1",
        gpu_container("app", mem=1000, cores=10),
        init_containers=[gpu_container("setup", mem=5000, cores=40)],
    )
    pod("gone", "n1", gpu_container(mem=3000), phase="released")
    snapshot = selectors.cluster_snapshot()
    expected = {
        c.uuid: (c.used_memory_mib, c.used_compute, c.used_slots, c.exclusive)
        for c in snapshot.nodes[0].cards
    }
    ids = dict(Card.objects.values_list("id", "uuid"))
    held = usage.card_usage()
    got = {ids[cid]: (u.memory_mib, u.cores, u.slots, u.exclusive) for cid, u in held.items()}
    assert got == {k: v for k, v in expected.items() if v != (0, 0, 0, False)}
    # the fold of slice rows a caller holds gives the same figures as the database's sums
    assert usage.claims_of(sql.active_slices()) == held
    # one rule for "exclusive", in SQL and in Python: the card at the threshold only
    assert sorted(u.exclusive for u in held.values()) == [False, False, True]
    # the init container is counted at its peak, not on top of the app container; the
    # released pod holds nothing
    assert sum(u.memory_mib for u in held.values()) == 1000 + 2000 + 5000


def test_namespace_usage_counts_active_bindings_init_at_peak() -> None:
    make_node("n1", cards=4, memory_mib=40000)
    pod("a1", "n1", gpu_container(gpus=2, mem=3000, cores=20), namespace="team-a")
    pod(
        "a2",
        "n1",
        gpu_container(mem=1000, cores=5),
        namespace="team-a",
        init_containers=[gpu_container("init", mem=9000, cores=50)],
    )
    pod("b1", "n1", gpu_container(mem=7000, cores=30), namespace="team-b", phase="reserved")
    pod("b2", "n1", gpu_container(mem=7000, cores=30), namespace="team-b", phase="released")
    every = usage.namespace_usage()
    assert every["team-a"] == QuotaUsage(memory_mib=2 * 3000 + 9000, cores=2 * 20 + 50, gpus=3)
    assert every["team-b"] == QuotaUsage(memory_mib=7000, cores=30, gpus=1)
    for ns in ("team-a", "team-b"):
        assert usage.quota_usage(ns) == every[ns] == usage.namespace_usage(ns)[ns]
    assert usage.quota_usage("nobody") == QuotaUsage()


def test_usage_reads_two_queries_whatever_the_size(django_assert_num_queries) -> None:
    make_node("n1", cards=3, memory_mib=40000)
    pod("a", "n1", gpu_container(mem=1000))
    with django_assert_num_queries(2):
        usage.card_usage()
    with django_assert_num_queries(2):
        usage.namespace_usage()
    for i in range(20):
        pod(f"p{i}", "n1", gpu_container(mem=100), namespace=f"ns{i % 3}")
    with django_assert_num_queries(2):
        usage.card_usage()
    with django_assert_num_queries(2):
        usage.namespace_usage()
