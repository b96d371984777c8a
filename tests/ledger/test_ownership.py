"""One owner of the ledger's rows, one change stamp.

Every public function of `controlplane.ledger.services` has a scenario here. Each scenario runs
the function against a small ledger and checks both facts the design rests on:

- the rows it writes are written from the ledger's services (the guard of tests/ledger_guard.py
  saw the service write; it also fails any database test where other code writes them);
- the extender's snapshot cache, refreshed incrementally (no full rebuild), sees what the
  function changed: its nodes, cards and quotas equal a fresh read of the committed ledger. A
  writer that forgets the change stamp leaves the cache with the old row and fails here.

A new service function without a scenario fails `test_every_service_function_has_a_scenario`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from datetime import timedelta
from types import ModuleType

import pytest
from django.utils import timezone

from controlplane.extender.snapshots import SnapshotCache
from controlplane.ledger import allocation, selectors
from controlplane.ledger.models import Card, Node, PodBinding, SchedulingDecision, Slice
from controlplane.ledger.services import (
    audit,
    bindings,
    claims,
    confirmations,
    cordons,
    decisions,
    modes,
    nodes,
    nominations,
    quotas,
)
from controlplane.scheduling import CardClaim, parse_pod
from tests.builders import card_report, make_node
from tests.ledger_guard import ROOT, guarded
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db

MODULES: tuple[ModuleType, ...] = (
    audit,
    bindings,
    claims,
    confirmations,
    cordons,
    decisions,
    modes,
    nodes,
    nominations,
    quotas,
)


def _request(name: str, mem: int = 1000):
    request = parse_pod(pod_json(name, containers=[gpu_container(mem=mem)]))
    assert request is not None
    return request


def _bound(name: str, node: str = "n1") -> str:
    reservation = bindings.bind_pod(_request(name), node)
    bindings.confirm_binding(reservation.pod_uid)
    return reservation.pod_uid


def _reserved(name: str, node: str = "n1") -> str:
    return bindings.bind_pod(_request(name), node).pod_uid


def _report(*cards):
    return nodes.InventoryReport("test", tuple(cards))


def _adopt() -> None:
    record = allocation.verify_allocation(
        allocation.annotations(
            allocation.allocation_record(
                "uid-adopted", "default", "adopted", "n1",
                [allocation.ContainerAllocation("c", 0, False,
                                                (allocation.Device("GPU-n1-0", 0, 3000, 10),))],
            )
        )
    )  # fmt: skip
    bindings.adopt_binding(record, "test")


def _claim(card: str, memory_mib: int = 2000) -> claims.ClaimMirror:
    """A claim kube-scheduler allocated on `card` of n1, mirrored."""
    slices = (claims.ClaimSlice(card, "gpu", 0, memory_mib, 20),)
    return claims.mirror_claim(claims.ClaimRecord("uid-claim", "default", "c", "n1", slices), "t")


def _stale() -> None:
    Node.objects.filter(name="n2").update(last_heartbeat=timezone.now() - timedelta(days=1))


def _card_long_missing() -> None:
    nodes.apply_inventory("n1", _report(card_report("GPU-n1-0", 0, 10000)), "test")
    Card.objects.filter(uuid="GPU-n1-1").update(last_seen=timezone.now() - timedelta(days=30))


def _old_decision() -> None:
    decisions.record_decisions([_decision()])
    SchedulingDecision.objects.update(decided_at=timezone.now() - timedelta(days=30))


def _decision() -> decisions.DecisionRecord:
    return decisions.DecisionRecord("uid-x", "default", "x", "unschedulable", "no room", (), {},
                                    {}, 1)  # fmt: skip


def _nominate(until: timedelta = timedelta(minutes=1)) -> None:
    nominations.nominate(
        pod_uid="uid-urgent", namespace="default", name="urgent", node_name="n1", priority=100,
        claims={"GPU-n1-0": CardClaim(5000, 10, 1, False)}, victims=["default/p"],
        deadline=timezone.now() + until,
    )  # fmt: skip


def _draining() -> None:
    _bound("p")
    modes.set_card_mode("GPU-n1-0", "exclusive", "test")
    Slice.objects.filter(active=True).update(active=False)  # the pod ended behind the reconciler


# name -> (set-up, the call). Set-up runs before the cache is primed; the call after it.
Scenario = tuple[Callable[[], object], Callable[[], object]]


def _nothing() -> None:
    return None


SCENARIOS: dict[str, Scenario] = {
    "bindings.bind_pod": (_nothing, lambda: bindings.bind_pod(_request("p"), "n1")),
    "bindings.confirm_bindings": (
        lambda: _reserved("p"),
        lambda: bindings.confirm_bindings([("uid-default-p", timezone.now())]),
    ),
    "bindings.confirm_binding": (
        lambda: _reserved("p"),
        lambda: bindings.confirm_binding("uid-default-p"),
    ),
    "bindings.confirm_reservations": (
        lambda: _reserved("p"),
        lambda: bindings.confirm_reservations(["uid-default-p"], "test"),
    ),
    "bindings.release_binding": (
        lambda: _bound("p"),
        lambda: bindings.release_binding("uid-default-p", "ended"),
    ),
    "bindings.release_bindings": (
        lambda: _bound("p"),
        lambda: bindings.release_bindings(["uid-default-p"], "gone", failed=True, actor="test"),
    ),
    "bindings.mark_allocated": (
        lambda: _bound("p"),
        lambda: bindings.mark_allocated("uid-default-p", "c", ["GPU-n1-0"], "n1", "n1"),
    ),
    "bindings.adopt_binding": (_nothing, _adopt),
    # a claim allocated anew on the other card: both cards' rows change
    "claims.mirror_claim": (lambda: _claim("GPU-n1-0"), lambda: _claim("GPU-n1-1", 3000)),
    "claims.mirror_claims": (
        _nothing,
        lambda: claims.mirror_claims(
            [
                claims.ClaimRecord(
                    "uid-c2",
                    "default",
                    "c2",
                    "n2",
                    (claims.ClaimSlice("GPU-n2-0", "gpu", 0, 1000, 10),),
                )
            ],
            "t",
        ),
    ),
    "confirmations.confirm_later": (
        lambda: _reserved("p"),
        lambda: confirmations.confirm_later("uid-default-p", timezone.now()),
    ),
    "nodes.apply_inventory": (
        _nothing,
        lambda: nodes.apply_inventory(
            "n1",
            _report(card_report("GPU-n1-0", 0, 10000, healthy=False), card_report("GPU-new", 2)),
            "test",
        ),
    ),
    "nodes.mark_stale_nodes": (_stale, lambda: nodes.mark_stale_nodes("test")),
    "nodes.mark_deleted_nodes": (_nothing, lambda: nodes.mark_deleted_nodes({"n1"}, "test")),
    "nodes.set_card_slots": (_nothing, lambda: nodes.set_card_slots("GPU-n1-1", 3, "test")),
    "nodes.set_card_factor": (_nothing, lambda: nodes.set_card_factor("GPU-n1-1", "2", "test")),
    "nodes.prune_missing_cards": (_card_long_missing, lambda: nodes.prune_missing_cards("test")),
    "cordons.set_node_cordon": (_nothing, lambda: cordons.set_node_cordon("n2", True, "test")),
    "cordons.set_card_cordon": (
        _nothing,
        lambda: cordons.set_card_cordon("GPU-n1-1", True, "test"),
    ),
    "quotas.set_quota": (
        _nothing,
        lambda: quotas.set_quota("default", quotas.QuotaLimitsInput(gpus=1), "test"),
    ),
    "quotas.delete_quota": (
        lambda: quotas.set_quota("default", quotas.QuotaLimitsInput(gpus=1), "test"),
        lambda: quotas.delete_quota("default", "test"),
    ),
    "decisions.record_decisions": (_nothing, lambda: decisions.record_decisions([_decision()])),
    "decisions.record_bind_outcome": (
        _nothing,
        lambda: decisions.record_bind_outcome("uid-x", "default", "x", "bind_failed", "gone"),
    ),
    "decisions.prune_decisions": (_old_decision, lambda: decisions.prune_decisions()),
    "decisions.forget_decisions": (
        lambda: decisions.record_decisions([_decision()]),
        lambda: decisions.forget_decisions(["uid-x"], before=timezone.now()),
    ),
    "decisions.note_preemption": (
        _nothing,
        lambda: decisions.note_preemption("uid-x", "default", "x", "preempting default/p"),
    ),
    "modes.set_card_mode": (_nothing, lambda: modes.set_card_mode("GPU-n1-1", "mps", "test")),
    "modes.apply_pending_modes": (_draining, lambda: modes.apply_pending_modes()),
    "nominations.nominate": (_nothing, _nominate),
    "nominations.end_nominations": (_nominate, lambda: nominations.end_nominations(["uid-urgent"])),
    "nominations.expire_nominations": (
        lambda: _nominate(timedelta(seconds=-1)),
        lambda: nominations.expire_nominations(),
    ),
    "audit.record_event": (_nothing, lambda: audit.record_event("test", "x", "node", "n1")),
    "audit.record_events": (
        _nothing,
        lambda: audit.record_events("test", "x", "node", [("n1", {})]),
    ),
}
# Public functions that write nothing themselves.
NOT_WRITERS = {
    "bindings.held_reservation",  # a repeat read back, for a bind whose pod is gone
    "nodes.lock_card",
    "modes.active_slices",
    "modes.apply_after_release",  # queues `apply_pending_modes` for after the commit
    "nominations.claims_json",
}


def public_functions() -> set[str]:
    found = set()
    for module in MODULES:
        short = module.__name__.rsplit(".", 1)[1]
        for name, value in vars(module).items():
            if (
                inspect.isfunction(value)
                and not name.startswith("_")
                and value.__module__ == module.__name__
            ):
                found.add(f"{short}.{name}")
    return found


def test_every_service_function_has_a_scenario() -> None:
    assert public_functions() == set(SCENARIOS) | NOT_WRITERS


@pytest.fixture
def ledger(settings) -> SnapshotCache:
    settings.TESSERA = {**settings.TESSERA, "FILTER_SNAPSHOT_TTL_MS": 1}
    make_node("n1", cards=2, memory_mib=10000)
    make_node("n2", cards=1, memory_mib=10000)
    return SnapshotCache(background=False)


def _settled() -> None:
    """Stamp every row an hour back: the cache's next pass must find the call's change by the
    call's own stamps, not because the set-up's rows are seconds old."""
    old = timezone.now() - timedelta(hours=1)
    for model in (Node, Card, PodBinding):
        model.objects.update(updated_at=old)


def _as_seen(cache: SnapshotCache) -> dict[str, object]:
    snapshot = cache.get()
    return {node.name: node for node in snapshot.nodes}


def _committed() -> dict[str, object]:
    return {node.name: node for node in selectors.cluster_snapshot().nodes}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_service_writes_its_rows_and_the_cache_sees_the_change(
    name: str, ledger: SnapshotCache
) -> None:
    setup, call = SCENARIOS[name]
    setup()
    _settled()
    primed = _as_seen(ledger)
    assert primed == _committed()
    rebuilds = ledger.full_rebuilds
    with guarded() as guard:
        call()
    assert guard.by_services, f"{name} wrote no ledger row through a service"
    assert not guard.violations
    seen = _as_seen(ledger)  # an incremental refresh: the stamps say what changed
    assert ledger.full_rebuilds == rebuilds
    assert seen == _committed()
    assert ledger.quota_limits("default") == selectors.quota_limits("default")


@pytest.mark.parametrize(
    "name", ["bindings.bind_pod", "nodes.mark_deleted_nodes", "cordons.set_card_cordon"]
)
def test_a_write_without_the_stamp_is_missed_by_the_cache(
    name: str, ledger: SnapshotCache, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check above can fail: with the stamp frozen in the past, the cache misses the change
    (so a writer that forgot it would fail that test)."""
    setup, call = SCENARIOS[name]
    setup()
    _settled()
    _as_seen(ledger)
    frozen = timezone.now() - timedelta(hours=1)
    monkeypatch.setattr(timezone, "now", lambda: frozen)
    call()
    monkeypatch.undo()
    assert _as_seen(ledger) != _committed()


@pytest.mark.ledger_guard_off  # the suite-wide guard would fail this test for its rogue write
def test_the_guard_flags_a_ledger_write_from_outside_the_services() -> None:
    make_node("n1", cards=1)
    rogue = compile(
        "Node.objects.filter(name='n1').update(cordoned=True)",
        str(ROOT / "controlplane" / "reconciler" / "rogue.py"),
        "exec",
    )
    with guarded() as guard:
        exec(rogue, {"Node": Node})  # noqa: S102 - a write that poses as a reconciler module
    assert guard.violations == ["controlplane/reconciler/rogue.py writes ledger_node"]
    assert not guard.by_services
    assert PodBinding.objects.count() == 0
