"""DRA mode: ResourceClaims mirrored into the ledger, against the embedded stand-in.

The claims and the ResourceSlices live in the stand-in (`EmbeddedKube.put_object`), the slices
built by the node plugin's own builder for the ledger's cards; the passes are the reconciler's
own (`run_reconcile`), full and incremental.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from controlplane.kube import sources
from controlplane.kube.embedded import EmbeddedClusterSource, EmbeddedKube
from controlplane.kube.models import EmbeddedObject
from controlplane.kube.sources import ClaimView, DeviceResult, PublishedDevice
from controlplane.ledger import usage
from controlplane.ledger.allocation import verify_allocation
from controlplane.ledger.models import AuditEvent, PodBinding, Slice
from controlplane.ledger.services.claims import ClaimSlice
from controlplane.reconciler import claims, services
from controlplane.reconciler.tasks import (
    CLAIMS_RESUME_KEY,
    LAST_FULL_KEY,
    LocalState,
    run_reconcile,
)
from nodeplugin import dra_slices
from nodeplugin.cards import Card
from nodeplugin.dra_slices import MigLayout, MigOffer, build_slices
from tests.builders import make_node

CLAIM, SLICE = EmbeddedObject.Kind.CLAIM, EmbeddedObject.Kind.SLICE
MEMORY_MIB = 81920


def cards(node: str, n: int = 2) -> list[Card]:
    """The cards `make_node` registers, as the node plugin sees them."""
    return [Card(f"GPU-{node}-{i}", i, "NVIDIA A100-SXM4-80GB", MEMORY_MIB, i) for i in range(n)]


def slices_of(node: str, modes: dict[str, str] | None = None, **kw: Any) -> list[dict[str, Any]]:
    return build_slices(  # type: ignore[return-value]
        node, cards(node), modes=modes or {}, health={}, slots=10, generation=1, **kw
    )


def result(node: str, device: str, memory: str = "4Gi", compute: str = "30", **kw: Any):
    out = {"request": "gpu", "driver": sources.DRA_DRIVER, "pool": node, "device": device}
    out["consumedCapacity"] = {"memory": memory, "compute": compute, "slots": "1"}
    return {**out, **kw}


def claim(name: str, *results: dict[str, Any], namespace: str = "team") -> dict[str, Any]:
    obj: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "metadata": {"name": name, "namespace": namespace, "uid": f"uid-claim-{name}"},
        "spec": {"devices": {"requests": [{"name": "gpu"}]}},
        "status": {},
    }
    if results:
        obj["status"]["allocation"] = {"devices": {"results": list(results)}}
    return obj


@pytest.fixture
def dra(settings: Any) -> None:
    settings.TESSERA = {**settings.TESSERA, "MODE": "dra"}


@pytest.fixture
def kube(db: None, dra: None) -> EmbeddedKube:
    make_node("n1")
    make_node("n2")
    kube = EmbeddedKube()
    for node in ("n1", "n2"):
        for s in slices_of(node):
            kube.put_object(SLICE, s)
    return kube


def row(name: str) -> PodBinding:
    return PodBinding.objects.get(name=name, source=PodBinding.Source.CLAIM)


def held(name: str) -> list[tuple[str, str, int, int]]:
    return sorted(
        Slice.objects.filter(binding__name=name, active=True).values_list(
            "card__uuid", "container_name", "memory_mib", "compute_percent"
        )
    )


# --- the pure mapping --------------------------------------------------------------------------


def test_the_control_plane_names_the_driver_and_capacities_as_the_node_plugin_publishes_them():
    assert (sources.DRA_DRIVER, sources.MEMORY, sources.COMPUTE) == (
        dra_slices.DRIVER,
        dra_slices.MEMORY,
        dra_slices.COMPUTE,
    )


def test_published_devices_map_each_device_to_its_card_and_mig_placement():
    layout = MigLayout(8, (MigOffer("3g.40gb", 4, 4, 40192),))
    built = slices_of("n1", {"GPU-n1-0": "exclusive", "GPU-n1-1": "mig"}, mig={"GPU-n1-1": layout})
    devices = sources.published_devices(built)
    assert devices[("n1", "gpu-0")] == PublishedDevice("GPU-n1-0", MEMORY_MIB, shared=False)
    assert devices[("n1", "gpu-1-mig-3g-40gb-4")] == PublishedDevice(
        "GPU-n1-1", 40192, False, "3g.40gb", 4, 4
    )
    other = [{**s, "spec": {**s["spec"], "driver": "other.example.com"}} for s in built]
    assert sources.published_devices(other) == {}


def view(obj: dict[str, Any]) -> ClaimView:
    return sources.claim_view(obj)


def test_a_shared_devices_consumed_capacity_becomes_the_slice_and_the_pool_its_node():
    devices = sources.published_devices(slices_of("n1"))
    record = claims.claim_record(view(claim("a", result("n1", "gpu-1", "8448Mi", "25"))), devices)
    assert record is not None
    assert (record.uid, record.namespace, record.name, record.node) == (
        "uid-claim-a", "team", "a", "n1",
    )  # fmt: skip
    assert record.slices == (ClaimSlice("GPU-n1-1", "gpu", 0, 8448, 25),)


def test_exclusive_and_mig_devices_take_the_whole_card_or_the_instance():
    layout = MigLayout(8, (MigOffer("3g.40gb", 4, 4, 40192),))
    devices = sources.published_devices(
        slices_of("n1", {"GPU-n1-0": "exclusive", "GPU-n1-1": "mig"}, mig={"GPU-n1-1": layout})
    )
    whole = {"request": "gpu", "driver": sources.DRA_DRIVER, "pool": "n1", "device": "gpu-0"}
    mig = {**whole, "request": "mig", "device": "gpu-1-mig-3g-40gb-4"}
    record = claims.claim_record(view(claim("x", whole, mig)), devices)
    assert record is not None
    assert record.slices == (
        ClaimSlice("GPU-n1-0", "gpu", 0, MEMORY_MIB, 100),
        ClaimSlice("GPU-n1-1", "mig", 1, 40192, 0, "3g.40gb", 4, 4),
    )


def test_claims_of_other_drivers_or_not_allocated_are_not_tesseras():
    devices = sources.published_devices(slices_of("n1"))
    assert claims.claim_record(view(claim("pending")), devices) is None
    foreign = result("n1", "gpu-0", driver="gpu.nvidia.com")
    assert claims.claim_record(view(claim("nvidia", foreign)), devices) is None


@pytest.mark.parametrize(
    ("results", "says"),
    [
        ([result("n1", "gpu-7")], "no ResourceSlice publishes device n1/gpu-7"),
        ([result("n1", "gpu-0", memory="1500Ki")], "no whole consumedCapacity"),
        ([result("n1", "gpu-0", memory="90Gi")], "of a card of 81920 MiB"),
        ([result("n1", "gpu-0"), result("n2", "gpu-0")], "several pools"),
        ([result("n1", "gpu-0"), result("n1", "gpu-0")], "two results on one card"),
    ],
    ids=["unknown-device", "not-whole-mib", "beyond-the-card", "two-pools", "one-card-twice"],
)
def test_an_allocation_the_ledger_cannot_hold_as_it_is_is_a_problem(results, says):
    devices = sources.published_devices(slices_of("n1") + slices_of("n2"))
    with pytest.raises(claims.ClaimProblem, match=says):
        claims.claim_record(
            ClaimView("u", "team", "c", True, tuple(DeviceResult(
                r["request"], r["driver"], r["pool"], r["device"], r["consumedCapacity"]
            ) for r in results)),
            devices,
        )  # fmt: skip


# --- the reconciler's passes ---------------------------------------------------------------------


def test_a_full_pass_mirrors_allocated_claims_counts_them_in_quota_and_a_rerun_changes_nothing(
    kube: EmbeddedKube,
):
    kube.put_object(CLAIM, claim("train", result("n1", "gpu-1", "4Gi", "30")))
    kube.put_object(CLAIM, claim("waiting"))  # not allocated yet: nothing to mirror
    source, state = EmbeddedClusterSource(kube), LocalState()
    run = run_reconcile(source, state, full=True)
    assert run.drift.get("claims_mirrored") == 1
    binding = row("train")
    assert (binding.pod_uid, binding.namespace, binding.phase, binding.node.name) == (
        "uid-claim-train", "team", "bound", "n1",
    )  # fmt: skip
    assert held("train") == [("GPU-n1-1", "gpu", 4096, 30)]
    assert not PodBinding.objects.filter(name="waiting").exists()
    used = usage.quota_usage("team")
    assert (used.memory_mib, used.cores, used.gpus) == (4096, 30, 1)
    again = run_reconcile(source, state, full=True)
    assert not {k for k in again.drift if "claim" in k}
    assert held("train") == [("GPU-n1-1", "gpu", 4096, 30)]


def test_a_watch_pass_mirrors_new_claims_follows_changes_and_releases_deleted_ones(
    kube: EmbeddedKube,
):
    source, state = EmbeddedClusterSource(kube), LocalState()
    run_reconcile(source, state, full=True)  # resume points for pods and claims
    state.set(LAST_FULL_KEY, str(time.time()))
    assert CLAIMS_RESUME_KEY in state
    kube.put_object(CLAIM, claim("a", result("n1", "gpu-0", "2Gi", "10")))
    kube.put_object(CLAIM, claim("b", result("n2", "gpu-1", "1Gi", "5")))
    first = run_reconcile(source, state, full=False)
    assert first.mode == "watch" and first.drift.get("claims_mirrored") == 2
    assert held("a") == [("GPU-n1-0", "gpu", 2048, 10)]

    # kube-scheduler allocated "a" again elsewhere (deallocated and allocated anew)
    kube.put_object(CLAIM, claim("a", result("n2", "gpu-0", "3Gi", "20")))
    kube.delete_object(CLAIM, "team", "b")
    second = run_reconcile(source, state, full=False)
    assert second.mode == "watch"
    assert (second.drift.get("claims_updated"), second.drift.get("released_claim_deleted")) == (
        1, 1,
    )  # fmt: skip
    assert row("a").node.name == "n2" and held("a") == [("GPU-n2-0", "gpu", 3072, 20)]
    assert row("b").phase == "released" and held("b") == []
    assert AuditEvent.objects.filter(action="release", target="team/b").exists()

    kube.put_object(CLAIM, claim("a"))  # deallocated: the pod that held it is gone
    third = run_reconcile(source, state, full=False)
    assert third.drift.get("released_claim_deallocated") == 1
    assert row("a").phase == "released" and usage.quota_usage("team").gpus == 0


def test_a_row_whose_claim_the_api_server_no_longer_has_is_released_by_a_full_pass(
    kube: EmbeddedKube,
):
    kube.put_object(CLAIM, claim("ghost", result("n1", "gpu-0")))
    source = EmbeddedClusterSource(kube)
    run_reconcile(source, LocalState(), full=True)
    # Deleted while no reconciler watched (its resume point lost with Redis): only a relist knows.
    EmbeddedObject.objects.filter(kind=CLAIM, name="ghost").delete()
    run = run_reconcile(source, LocalState(), full=True)
    assert run.drift.get("released_claim_deleted") == 1
    assert row("ghost").phase == "released" and held("ghost") == []


def test_a_claim_on_a_card_the_ledger_does_not_know_is_reported_not_invented(
    kube: EmbeddedKube,
):
    for s in slices_of("n9"):  # a node that publishes slices but never reported its inventory
        kube.put_object(SLICE, s)
    kube.put_object(CLAIM, claim("stray", result("n9", "gpu-0")))
    kube.put_object(CLAIM, claim("nowhere", result("n1", "gpu-5")))
    run = run_reconcile(EmbeddedClusterSource(kube), LocalState(), full=True)
    assert run.drift.get("flagged_claim") == 2
    assert not PodBinding.objects.filter(source=PodBinding.Source.CLAIM).exists()
    reasons = dict(
        AuditEvent.objects.filter(action="claim-unmirrored").values_list("target", "details")
    )
    assert "not registered" in reasons["team/stray"]["reason"]
    assert "no ResourceSlice publishes device n1/gpu-5" in reasons["team/nowhere"]["reason"]


def test_a_mirrored_claim_keeps_its_row_while_its_nodes_slices_are_withdrawn(kube: EmbeddedKube):
    kube.put_object(CLAIM, claim("steady", result("n1", "gpu-0")))
    source = EmbeddedClusterSource(kube)
    run_reconcile(source, LocalState(), full=True)
    # The kubelet deletes a driver's slices 30 s after its plugin stops; the claim still holds
    # the card, and the pod still runs on it.
    for s in slices_of("n1"):
        kube.delete_object(SLICE, "", s["metadata"]["name"])  # type: ignore[index]
    run = run_reconcile(source, LocalState(), full=True)
    assert run.drift.get("flagged_claim") == 1
    assert row("steady").phase == "bound" and held("steady") == [("GPU-n1-0", "gpu", 4096, 30)]


def test_pod_passes_leave_claim_rows_alone(kube: EmbeddedKube):
    kube.put_object(CLAIM, claim("mine", result("n1", "gpu-0")))
    run_reconcile(EmbeddedClusterSource(kube), LocalState(), full=True)
    later = row("mine").created_at.replace(year=2100)
    drift = services.reconcile_pods([], listed_at=later, complete=True, verify=verify_allocation)
    assert drift == {}
    assert row("mine").phase == "bound"


def test_extender_mode_mirrors_no_claims(kube: EmbeddedKube, settings: Any):
    settings.TESSERA = {**settings.TESSERA, "MODE": "extender"}
    kube.put_object(CLAIM, claim("train", result("n1", "gpu-0")))
    run = run_reconcile(EmbeddedClusterSource(kube), LocalState(), full=True)
    assert not PodBinding.objects.filter(source=PodBinding.Source.CLAIM).exists()
    assert "claims_mirrored" not in run.drift


class Refusing(EmbeddedClusterSource):
    """A cluster whose API server refuses the worker's claims list (no grant)."""

    def list_claims(self, page_size: int = 500) -> tuple[list[Any], str]:
        raise sources.ClaimsUnreadable("list resourceclaims: API server answered 403: forbidden")


def test_claims_the_worker_may_not_read_are_said_and_the_pass_still_ends(kube: EmbeddedKube):
    kube.put_object(CLAIM, claim("train", result("n1", "gpu-0")))
    run = run_reconcile(Refusing(kube), LocalState(), full=True)
    assert run.pk is not None and run.mode == "full"
    assert run.drift.get("claims_unreadable") == 1
    assert not PodBinding.objects.filter(source=PodBinding.Source.CLAIM).exists()
