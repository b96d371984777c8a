"""Bind on cards in MIG, MPS and exclusive mode: the ledger rows, the allocation record, and
the placements two binds take on one MIG card."""

from __future__ import annotations

import json

import pytest
from django.db.models import Q
from django.utils import timezone

from controlplane.ledger import allocation, errors, selectors
from controlplane.ledger.models import Card, Slice
from controlplane.ledger.services import bindings, modes
from controlplane.scheduling import parse_pod
from tests.builders import make_node
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db

MIG = {"nvidia.com/vgpu-mode": "mig"}


def set_mode(node: str, mode: str, **kw: object) -> None:
    Card.objects.filter(node__name=node).update(mode=mode, updated_at=timezone.now(), **kw)


def mig_request(name: str, mem: int, gpus: int = 1):
    containers = [gpu_container(gpus=gpus, mem=mem)]
    return parse_pod(pod_json(name, containers=containers, annotations=MIG))


def masks_by_card() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    rows = Slice.objects.filter(~Q(mig_profile=""), active=True)
    for uuid, start, size in rows.values_list("card__uuid", "mig_start", "mig_size"):
        out.setdefault(uuid, []).append(((1 << size) - 1) << start)
    return out


def test_a_mig_bind_records_the_instance_and_the_record_says_it() -> None:
    make_node("n1", cards=1)
    set_mode("n1", "mig", mig_capable=True, mig_enabled=True)
    reservation = bindings.bind_pod(mig_request("p1", 30000), "n1")
    row = Slice.objects.get(binding_id=reservation.binding_id)
    assert (row.mig_profile, row.mig_start, row.mig_size) == ("3g.40gb", 4, 4)
    assert (row.memory_mib, row.compute_percent) == (40192, 42)
    [device] = reservation.allocation()["containers"][0]["devices"]
    assert device == {
        "cores": 42,
        "memory_mib": 40192,
        "uuid": "GPU-n1-0",
        "mode": "mig",
        "mig": {"profile": "3g.40gb", "start": 4, "size": 4},
    }
    # Read back from the ledger (a retried bind, the REST allocation) it is the same record.
    assert selectors.allocation_of(row.binding) == reservation.allocation()
    again = bindings.bind_pod(mig_request("p1", 30000), "n1")
    assert again.repeat and again.allocation() == reservation.allocation()


def test_binds_on_one_mig_card_never_overlap_and_the_last_is_refused_by_name() -> None:
    make_node("n1", cards=1)
    set_mode("n1", "mig", mig_capable=True, mig_enabled=True)
    for i in range(2):
        bindings.bind_pod(mig_request(f"p{i}", 30000), "n1")
    [masks] = masks_by_card().values()
    assert len(masks) == 2 and masks[0] & masks[1] == 0
    with pytest.raises(errors.AllocationRefused) as refused:
        bindings.bind_pod(mig_request("p9", 30000), "n1")
    assert "MIG mode, no free 3g.40gb placement" in str(refused.value)
    # Smaller instances still fit beside them? No: 3g + 3g cover all 8 memory slices.
    with pytest.raises(errors.AllocationRefused):
        bindings.bind_pod(mig_request("p10", 1000), "n1")


def test_seven_small_instances_fill_an_a100_and_the_snapshot_sees_each() -> None:
    make_node("n1", cards=1)
    set_mode("n1", "mig", mig_capable=True, mig_enabled=True)
    for i in range(7):
        bindings.bind_pod(mig_request(f"p{i}", 8000), "n1")
    [masks] = masks_by_card().values()
    assert sorted(masks) == [1 << s for s in range(7)]
    [card] = selectors.node_cards(["n1"])
    assert card.mig_used == 0b0111_1111 and card.mode == "mig" and card.mig_enabled
    with pytest.raises(errors.AllocationRefused):
        bindings.bind_pod(mig_request("p7", 8000), "n1")


def test_a_shared_record_has_no_mode_keys() -> None:
    make_node("n1", cards=1)
    reservation = bindings.bind_pod(
        parse_pod(pod_json("p", containers=[gpu_container(mem=1000, cores=10)])), "n1"
    )
    value = allocation.encode(reservation.allocation())
    assert '"mode"' not in value and '"mig"' not in value
    assert json.loads(value)["containers"][0]["devices"] == [
        {"cores": 10, "memory_mib": 1000, "uuid": "GPU-n1-0"}
    ]
    row = Slice.objects.get()
    assert (row.mig_profile, row.mig_start, row.mig_size) == ("", None, None)


def test_mps_and_exclusive_devices_say_their_mode() -> None:
    make_node("mps", cards=1)
    make_node("whole", cards=1)
    set_mode("mps", "mps")
    set_mode("whole", "exclusive")
    mps = parse_pod(pod_json("a", containers=[gpu_container(mem=2000, cores=30)],
                             annotations={"nvidia.com/vgpu-mode": "mps"}))  # fmt: skip
    [device] = bindings.bind_pod(mps, "mps").allocation()["containers"][0]["devices"]
    assert device == {"cores": 30, "memory_mib": 2000, "uuid": "GPU-mps-0", "mode": "mps"}
    whole = parse_pod(pod_json("b", containers=[gpu_container(cores=100)]))
    [device] = bindings.bind_pod(whole, "whole").allocation()["containers"][0]["devices"]
    assert device == {
        "cores": 100, "memory_mib": 81920, "uuid": "GPU-whole-0", "mode": "exclusive"
    }  # fmt: skip


def test_a_draining_card_refuses_new_binds() -> None:
    make_node("n1", cards=1)
    set_mode("n1", "shared", pending_mode="mig")
    with pytest.raises(errors.AllocationRefused) as refused:
        bindings.bind_pod(parse_pod(pod_json("p", containers=[gpu_container(mem=10)])), "n1")
    assert "draining for a mode change" in str(refused.value)


def test_a_signed_mig_record_reads_back_and_a_malformed_one_is_refused() -> None:
    make_node("n1", cards=1)
    set_mode("n1", "mig", mig_capable=True, mig_enabled=True)
    record = bindings.bind_pod(mig_request("p1", 8000), "n1").allocation()
    parsed = allocation.verify_allocation(allocation.annotations(record))
    [device] = parsed.containers[0].devices
    assert (device.mode, device.mig) == ("mig", ("1g.10gb", 6, 1))
    broken = json.loads(json.dumps(record))
    del broken["containers"][0]["devices"][0]["mig"]
    with pytest.raises(allocation.InvalidAllocation, match="mig"):
        allocation.verify_allocation(allocation.annotations(broken))


def test_mig_is_refused_for_a_model_the_core_has_no_geometry_for() -> None:
    make_node("l4", cards=1, model="NVIDIA L4")
    make_node("a100", cards=1)
    Card.objects.update(mig_capable=True, updated_at=timezone.now())
    with pytest.raises(errors.ServiceError, match="no MIG geometry"):
        modes.set_card_mode("GPU-l4-0", "mig", actor="op")
    assert Card.objects.get(uuid="GPU-l4-0").mode == "shared"
    assert modes.set_card_mode("GPU-a100-0", "mig", actor="op").mode == "mig"
