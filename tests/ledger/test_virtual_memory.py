"""Virtual device memory through the ledger (docs/virtual-memory.md): the node's report, the
card's factor, bind under the lock with the three budgets, the rows and the allocation record,
usage and quotas."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.ledger import allocation, errors, selectors, sql, usage
from controlplane.ledger.models import AuditEvent, Card, Node, Slice
from controlplane.ledger.services import bindings, nodes
from controlplane.ledger.services.nodes import InventoryReport, apply_inventory
from controlplane.scheduling import PodRequest, parse_pod
from tests.builders import card_report
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db

OPT_IN = "tessera.io/memory-oversubscription"


def report(factor: int | None = 200, reserve: int | None = 2000, host: int | None = 64000,
           memory: int = 1000) -> InventoryReport:  # fmt: skip
    return InventoryReport(
        plugin_version="test",
        cards=(card_report("GPU-v-0", 0, memory), card_report("GPU-v-1", 1, memory)),
        memory_factor=factor,
        spill_reserve_mib=reserve,
        host_memory_mib=host,
    )


def request(name: str, pct: int, opted: bool | None) -> PodRequest:
    container = gpu_container("main")
    container["resources"]["limits"]["nvidia.com/gpumem-percentage"] = pct
    body = pod_json(name, uid=f"uid-{name}", containers=[container])
    if opted is not None:
        body["metadata"]["annotations"] = {OPT_IN: "true" if opted else "false"}
    parsed = parse_pod(body)
    assert parsed is not None
    return parsed


def one_card(uuid: str = "GPU-v-0") -> None:
    """Only one card of the node takes slices: the other is cordoned."""
    other = "GPU-v-1" if uuid == "GPU-v-0" else "GPU-v-0"
    Card.objects.filter(uuid=other).update(cordoned=True)


def test_the_node_report_sets_the_default_factor_and_the_reserve() -> None:
    apply_inventory("v", report(), "test")
    node = Node.objects.get(name="v")
    assert (node.memory_factor, node.spill_reserve_mib, node.host_memory_mib) == (200, 2000, 64000)
    state = selectors.cluster_snapshot(["v"]).by_name["v"]
    assert [c.factor for c in state.cards] == [200, 200] and state.spill_reserve_mib == 2000
    assert AuditEvent.objects.filter(action="node-memory").count() == 1
    apply_inventory("v", report(None, None, None), "test")  # a plugin that says nothing: defaults
    node.refresh_from_db()
    assert (node.memory_factor, node.spill_reserve_mib, node.host_memory_mib) == (100, 0, None)


def test_a_reserve_above_the_node_memory_is_refused_and_changes_nothing() -> None:
    apply_inventory("v", report(), "test")
    before = list(Node.objects.values_list("memory_factor", "spill_reserve_mib", "last_heartbeat"))
    with pytest.raises(errors.ServiceError, match="more than the node's memory"):
        apply_inventory("v", report(reserve=70000), "test")
    assert (
        list(Node.objects.values_list("memory_factor", "spill_reserve_mib", "last_heartbeat"))
        == before
    )


def test_bind_places_three_opted_in_pods_on_one_card_and_records_their_resident_part() -> None:
    apply_inventory("v", report(), "test")
    one_card()
    for i in range(3):
        reservation = bindings.bind_pod(request(f"p{i}", 60, True), "v")
        device = reservation.allocation()["containers"][0]["devices"][0]
        assert device == {"cores": 0, "memory_mib": 600, "resident_mib": 300, "uuid": "GPU-v-0"}
    assert sorted(Slice.objects.values_list("memory_mib", "resident_mib")) == [(600, 300)] * 3
    state = selectors.cluster_snapshot(["v"]).by_name["v"]
    card = state.cards[0]
    assert (card.used_memory_mib, card.resident_used, state.used_spill_mib) == (1800, 900, 900)
    # Quotas count a slice's memory as they always did.
    assert usage.quota_usage("default").memory_mib == 1800
    # A repeated bind reads the record back from the rows: the same record.
    again = bindings.bind_pod(request("p0", 60, True), "v")
    assert again.repeat and again.allocation()["containers"][0]["devices"][0]["resident_mib"] == 300


def test_bind_refuses_a_pod_without_the_opt_in_naming_the_resident_budget() -> None:
    apply_inventory("v", report(), "test")
    one_card()
    for i in range(3):
        bindings.bind_pod(request(f"p{i}", 60, True), "v")
    with pytest.raises(errors.AllocationRefused, match="500 MiB of resident memory"):
        bindings.bind_pod(request("plain", 50, None), "v")
    assert Slice.objects.count() == 3


def test_the_record_of_a_pod_without_the_opt_in_is_as_before() -> None:
    apply_inventory("v", report(), "test")
    record = bindings.bind_pod(request("plain", 20, False), "v").allocation()
    assert record["containers"][0]["devices"][0] == {
        "cores": 0,
        "memory_mib": 200,
        "uuid": "GPU-v-0",
    }
    assert Slice.objects.get().resident_mib is None


def test_lock_and_read_reads_what_the_budgets_need() -> None:
    apply_inventory("v", report(), "test")
    bindings.bind_pod(request("p", 60, True), "v")
    locked = sql.lock_and_read("default", "v", "uid-x")
    assert locked.node is not None
    assert (locked.node.memory_factor, locked.node.spill_reserve_mib) == (200, 2000)
    assert [s.resident_mib for s in locked.slices] == [300]
    assert {c.memory_factor for c in locked.cards} == {None}


def test_an_operator_sets_a_card_factor_that_wins_until_cleared() -> None:
    apply_inventory("v", report(factor=None), "test")
    nodes.set_card_factor("GPU-v-0", "1.5", "alice", "notebooks")
    state = selectors.cluster_snapshot(["v"]).by_name["v"]
    assert [c.factor for c in state.cards] == [150, 100]
    event = AuditEvent.objects.get(action="card-memory-factor")
    assert (event.actor, event.details["after"], event.details["applies"]) == (
        "alice",
        "1.5",
        "1.5",
    )
    nodes.set_card_factor("GPU-v-0", None, "alice")
    assert Card.objects.get(uuid="GPU-v-0").memory_factor is None


@pytest.mark.parametrize("bad", ["0.5", "abc", "1.555", "17", ""])
def test_a_bad_factor_is_refused_and_changes_nothing(bad: str) -> None:
    apply_inventory("v", report(), "test")
    with pytest.raises(errors.ServiceError, match='from "1" to "16"') as caught:
        nodes.set_card_factor("GPU-v-0", bad, "alice")
    assert caught.value.field == "factor"
    assert Card.objects.get(uuid="GPU-v-0").memory_factor is None
    assert not AuditEvent.objects.filter(action="card-memory-factor").exists()


def test_lowering_the_factor_below_what_is_bound_is_refused_and_changes_nothing() -> None:
    apply_inventory("v", report(), "test")
    one_card()
    for i in range(3):
        bindings.bind_pod(request(f"p{i}", 60, True), "v")
    with pytest.raises(errors.Conflict) as caught:
        nodes.set_card_factor("GPU-v-0", "1.5", "alice")
    message = str(caught.value)
    assert "1800 MiB" in message and "1500 MiB" in message and "at least 1.8" in message
    assert Card.objects.get(uuid="GPU-v-0").memory_factor is None
    nodes.set_card_factor("GPU-v-0", "1.8", "alice")  # exactly enough
    assert Card.objects.get(uuid="GPU-v-0").memory_factor == 180


def test_the_node_plugin_record_parser_refuses_a_bad_resident_part() -> None:
    def record(resident: Any) -> dict[str, str]:
        device = {"cores": 0, "memory_mib": 600, "uuid": "GPU-v-0", "resident_mib": resident}
        container = {"devices": [device], "index": 0, "init": False, "name": "m"}
        body = {"containers": [container], "name": "p", "namespace": "default", "node": "v",
                "pod_uid": "u", "v": 1}  # fmt: skip
        return allocation.annotations(body)

    parsed = allocation.verify_allocation(record(300))
    assert parsed.containers[0].devices[0].resident_mib == 300
    for bad in (0, 601, "300", True, 1.5):
        with pytest.raises(allocation.InvalidAllocation, match="resident_mib"):
            allocation.verify_allocation(record(bad))


def test_card_usage_sums_the_resident_parts_as_the_snapshot_does() -> None:
    apply_inventory("v", report(), "test")
    one_card()
    for i in range(3):
        bindings.bind_pod(request(f"p{i}", 60, True), "v")
    bindings.bind_pod(request("small", 5, False), "v")
    # An opted-in pod with a sidecar and an ordinary init container: folded at its peak.
    body = pod_json("folded", uid="uid-folded", containers=[gpu_container("app", mem=20)])
    side = gpu_container("side", mem=20)
    side["restartPolicy"] = "Always"
    body["spec"]["initContainers"] = [side, gpu_container("init", mem=30)]
    body["metadata"]["annotations"] = {OPT_IN: "true"}
    folded = parse_pod(body)
    assert folded is not None
    bindings.bind_pod(folded, "v")
    held = usage.card_usage()
    assert usage.claims_of(sql.active_slices()) == held
    card = Card.objects.get(uuid="GPU-v-0")
    # memory: 1800 + 50 + max(20 + 20, 30 + 20) = 1900; resident: 900 + 50 + max(10 + 10,
    # 30 + 10) = 990; spill: 900 + max(10 + 10, 0 + 10) = 920
    claim = held[card.pk]
    assert (claim.memory_mib, claim.resident, claim.spill_mib) == (1900, 990, 920)


def test_what_would_make_it_fit_counts_a_card_s_smaller_budget() -> None:
    from controlplane.ledger import fit_hints

    apply_inventory("v", report(), "test")
    one_card()
    for i in range(3):
        bindings.bind_pod(request(f"p{i}", 60, True), "v")
    rooms = {r.card: r.free_memory_mib for r in fit_hints.free_rooms()}
    # 1000 MiB card at factor 2: 900 MiB resident, 1800 MiB of 2000 virtual: 100 MiB for a
    # slice that stays on the card (the plain sum would say none).
    assert rooms["GPU-v-0"] == 100
