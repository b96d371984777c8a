"""The filter's per-process snapshot cache: bounded staleness, own binds seen at once."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.extender import snapshots
from controlplane.extender.snapshots import snapshot_cache
from controlplane.ledger import selectors
from controlplane.ledger.models import Node
from controlplane.ledger.services import bindings
from controlplane.scheduling import parse_pod
from tests.builders import make_node
from tests.extender.builders import bind_args, filter_args
from tests.extender.conftest import post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db


@pytest.fixture
def cached(settings, monkeypatch):
    """The cache on, refreshed in the request (a thread would not see the test's transaction)."""
    settings.TESSERA = {**settings.TESSERA, "FILTER_SNAPSHOT_TTL_MS": 200}
    monkeypatch.setattr(snapshot_cache, "background", False)
    snapshot_cache.clear()
    yield
    snapshot_cache.clear()


def feasible(client, pod, names) -> list[str]:
    return post(client, "/scheduler/filter", filter_args(pod, names)).json()["NodeNames"]


def test_other_writers_show_within_the_ttl(client, cached, django_assert_max_num_queries) -> None:
    rebuilds = snapshot_cache.full_rebuilds
    make_node("n1", cards=1, memory_mib=10000)
    assert feasible(client, gpu_pod("a", mem=6000), ["n1"]) == ["n1"]
    # another replica reserves (not through this process's bind)
    bindings.bind_pod(parse_pod(gpu_pod("other", mem=6000)), "n1")
    # within the TTL the cache may still say yes (an accelerator; bind would refuse) ...
    # only the decision upsert in its transaction (+ SET LOCAL on PostgreSQL); quotas come
    # with the snapshot; re-reading the snapshot would add 3 queries or more
    with django_assert_max_num_queries(4):
        assert feasible(client, gpu_pod("b", mem=6000), ["n1"]) == ["n1"]
    time.sleep(0.25)
    # ... after it, the incremental refresh has picked the change up
    assert feasible(client, gpu_pod("c", mem=6000), ["n1"]) == []
    assert snapshot_cache.full_rebuilds == rebuilds + 1 and snapshot_cache.refreshes >= 1


def test_this_process_binds_are_seen_at_once(client, cached, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    first = fake_kube.add(gpu_pod("first", mem=6000))
    assert feasible(client, first, ["n1"]) == ["n1"]
    assert post(client, "/scheduler/bind", bind_args(first, "n1")).json() == {"Error": ""}
    assert feasible(client, gpu_pod("second", mem=6000), ["n1"]) == []  # no TTL wait


def test_own_binds_are_assumed_exactly_as_the_ledger_reads_them_back(
    client, cached, fake_kube, django_assert_max_num_queries
) -> None:
    make_node("n1", cards=3, memory_mib=10000)
    feasible(client, gpu_pod("warm"), ["n1"])
    pods = [
        fake_kube.add(gpu_pod("two", gpus=2, mem=3000, cores=30)),
        fake_kube.add(gpu_pod("whole", mem=2000, cores=100)),
    ]
    for pod in pods:
        assert post(client, "/scheduler/bind", bind_args(pod, "n1")).json() == {"Error": ""}
    # the next answer reads no node from the ledger (only the decision upsert in its savepoint,
    # + SET LOCAL on PostgreSQL; a re-read would add 3 queries), yet the cached node is exactly
    # what the ledger says now: memory, compute, slots and exclusivity
    with django_assert_max_num_queries(4):
        assert feasible(client, gpu_pod("third", mem=8000), ["n1"]) == []
    assert snapshot_cache.get().by_name["n1"] == selectors.cluster_snapshot(["n1"]).nodes[0]


def test_new_nodes_appear_and_deleted_ones_go(client, cached, monkeypatch) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    assert feasible(client, gpu_pod(), ["n1", "n2"]) == ["n1"]
    make_node("n2", cards=1, memory_mib=10000)
    time.sleep(0.25)
    assert feasible(client, gpu_pod(), ["n1", "n2"]) == ["n1", "n2"]
    # a node deleted outright: the counts drop, which forces a full rebuild
    Node.objects.get(name="n2").cards.all().delete()
    Node.objects.filter(name="n2").delete()
    rebuilds = snapshot_cache.full_rebuilds
    time.sleep(0.25)
    feasible(client, gpu_pod(), ["n1", "n2"])  # notices the deletion
    assert feasible(client, gpu_pod(), ["n1", "n2"]) == ["n1"]
    assert snapshot_cache.full_rebuilds == rebuilds + 1
    # and a full rebuild also happens when one is simply due
    monkeypatch.setattr(snapshots, "FULL_REFRESH_S", 0.0)
    time.sleep(0.25)
    feasible(client, gpu_pod(), ["n1"])
    assert snapshot_cache.full_rebuilds >= rebuilds + 2


def test_ttl_zero_reads_the_ledger_every_time(client) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    assert feasible(client, gpu_pod("a", mem=6000), ["n1"]) == ["n1"]
    bindings.bind_pod(parse_pod(gpu_pod("other", mem=6000)), "n1")
    assert feasible(client, gpu_pod("b", mem=6000), ["n1"]) == []


@pytest.mark.django_db(transaction=True)
def test_the_background_thread_keeps_it_fresh_off_the_request_path(client, settings) -> None:
    settings.TESSERA = {**settings.TESSERA, "FILTER_SNAPSHOT_TTL_MS": 100}
    assert snapshot_cache.background
    rebuilds, refreshes = snapshot_cache.full_rebuilds, snapshot_cache.refreshes
    try:
        make_node("n1", cards=1, memory_mib=10000)
        assert feasible(client, gpu_pod("a", mem=6000), ["n1"]) == ["n1"]
        bindings.bind_pod(parse_pod(gpu_pod("other", mem=6000)), "n1")
        deadline = time.monotonic() + 5
        while (
            time.monotonic() < deadline
            and snapshot_cache.get().by_name["n1"].cards[0].used_memory_mib == 0
        ):
            time.sleep(0.05)
        assert feasible(client, gpu_pod("b", mem=6000), ["n1"]) == []
        assert snapshot_cache.full_rebuilds == rebuilds + 1  # the first read only
        assert snapshot_cache.refreshes > refreshes
    finally:
        snapshot_cache.clear()  # stops the thread
        time.sleep(0.25)


def test_passes_skip_own_held_binds_and_reread_every_other_change(
    client, cached, fake_kube, monkeypatch
) -> None:
    # a short look-back, so that a pass no longer sees the nodes' creation (or the last step)
    monkeypatch.setattr(snapshots, "LATE_COMMIT_MARGIN", timedelta(milliseconds=100))
    make_node("n1", cards=2, memory_mib=10000)
    make_node("n2", cards=2, memory_mib=10000)
    feasible(client, gpu_pod("warm"), ["n1", "n2"])
    reread: list[set[str]] = []
    real = selectors.cluster_snapshot

    def counting(names=None):
        if names is not None:
            reread.append(set(names))
        return real(names)

    monkeypatch.setattr(selectors, "cluster_snapshot", counting)

    def next_pass() -> set[str]:
        reread.clear()
        time.sleep(0.25)
        feasible(client, gpu_pod("probe", mem=1), ["n1", "n2"])
        return set().union(*reread)

    assert next_pass() == {"n1", "n2"}  # their creation, still within the look-back

    ours = fake_kube.add(gpu_pod("ours", mem=6000))
    assert post(client, "/scheduler/bind", bind_args(ours, "n1")).json() == {"Error": ""}
    assert next_pass() == set()  # our own reservation (and its confirmation): already assumed
    assert snapshot_cache.get().by_name["n1"] == real(["n1"]).nodes[0]

    bindings.bind_pod(parse_pod(gpu_pod("foreign", mem=6000)), "n2")
    assert next_pass() == {"n2"}  # another writer's binding on n2 (ours on n1 still skipped)

    bindings.release_binding(ours["metadata"]["uid"], "the pod ended")
    assert next_pass() == {"n1"}  # our pod's slices freed by someone else: read back
    assert snapshot_cache.get().by_name["n1"] == real(["n1"]).nodes[0]

    Node.objects.filter(name="n2").update(cordoned=True, updated_at=timezone.now())
    assert next_pass() == {"n2"}  # the node row itself


def test_a_deleted_node_goes_even_in_the_first_minutes_after_boot(client, cached, monkeypatch):
    """The monotonic clock starts near zero at boot: "rebuild now" must not be the time 0.0,
    which is not yet FULL_REFRESH_S in the past during a node's first ten minutes."""
    real = time.monotonic
    offset = real() - 30.0  # as if booted 30 s ago
    monkeypatch.setattr(time, "monotonic", lambda: real() - offset)
    snapshot_cache.clear()
    make_node("n1", cards=1, memory_mib=10000)
    make_node("n2", cards=1, memory_mib=10000)
    assert feasible(client, gpu_pod(), ["n1", "n2"]) == ["n1", "n2"]
    Node.objects.get(name="n2").cards.all().delete()
    Node.objects.filter(name="n2").delete()
    time.sleep(0.25)
    feasible(client, gpu_pod(), ["n1", "n2"])  # notices the deletion
    assert feasible(client, gpu_pod(), ["n1", "n2"]) == ["n1"]


def test_own_binds_of_opted_in_pods_are_assumed_with_their_resident_parts_and_spill(
    client, cached, fake_kube
) -> None:
    from controlplane.ledger.services.nodes import InventoryReport, apply_inventory
    from tests.builders import card_report

    report = InventoryReport("test", (card_report("GPU-v-0", 0, 10000),), memory_factor=200,
                             spill_reserve_mib=20000, host_memory_mib=64000)  # fmt: skip
    apply_inventory("n1", report, "test")
    opted = {"tessera.io/memory-oversubscription": "true"}
    feasible(client, gpu_pod("warm"), ["n1"])
    for name in ("a", "b", "c"):
        pod = fake_kube.add(gpu_pod(name, mem=6000, annotations=opted))
        assert post(client, "/scheduler/bind", bind_args(pod, "n1")).json() == {"Error": ""}
    # resident 9000 of 10000, 18000 of 20000 virtual, 9000 spilled: exactly the ledger's
    cached_node = snapshot_cache.get().by_name["n1"]
    assert cached_node == selectors.cluster_snapshot(["n1"]).nodes[0]
    assert (cached_node.cards[0].resident_used, cached_node.used_spill_mib) == (9000, 9000)
    assert feasible(client, gpu_pod("plain", mem=2000), ["n1"]) == []  # the resident budget
