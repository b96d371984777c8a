"""Card modes: an operator's change, the drain, its end from release and reconciler, refusals."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.ledger.errors import NotFound, ServiceError
from controlplane.ledger.models import AuditEvent, Card
from controlplane.ledger.services import bindings, mode_rules, modes
from controlplane.scheduling import parse_pod
from tests.builders import make_node
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db

UUID = "GPU-n1-0"


def bind(name: str) -> str:
    parsed = parse_pod(pod_json(name, "default", containers=[gpu_container(mem=1000)]))
    assert parsed is not None
    return bindings.bind_pod(parsed, "n1").pod_uid


def card() -> Card:
    return Card.objects.get(uuid=UUID)


def events() -> list[tuple[str, str, dict[str, Any]]]:
    rows = AuditEvent.objects.filter(action__startswith="card-mode").order_by("id")
    return [(e.actor, e.action, e.details) for e in rows]


@pytest.fixture
def node() -> None:
    make_node("n1", cards=1)
    Card.objects.filter(uuid=UUID).update(mig_capable=True)


@pytest.mark.usefixtures("node")
def test_idle_card_changes_at_once_and_is_audited() -> None:
    changed = modes.set_card_mode(UUID, "mig", "ann", "for the training team")
    assert (changed.mode, changed.pending_mode) == ("mig", "")
    assert (card().mode, card().pending_mode) == ("mig", "")
    assert events() == [
        ("ann", "card-mode", {"node": "n1", "reason": "for the training team", "from": "shared",
                              "to": "mig"}),
    ]  # fmt: skip


@pytest.mark.usefixtures("node")
def test_busy_card_drains_and_takes_nothing_new() -> None:
    bind("p1")
    bind("p2")
    modes.set_card_mode(UUID, "mps", "ann")
    assert (card().mode, card().pending_mode, card().schedulable) == ("shared", "mps", False)
    assert events() == [
        ("ann", "card-mode-requested", {"node": "n1", "reason": "", "slices": 2,
                                        "from": "shared", "to": "mps"}),
    ]  # fmt: skip
    assert mode_rules.describe("shared", "mps", 2) == "draining: becomes MPS when its 2 slices end"
    # Asking again for the pending mode changes nothing and records nothing.
    modes.set_card_mode(UUID, "mps", "bob")
    assert len(events()) == 1


@pytest.mark.usefixtures("node")
def test_release_of_the_last_slice_applies_the_change(
    django_capture_on_commit_callbacks: Any,
) -> None:
    first, second = bind("p1"), bind("p2")
    modes.set_card_mode(UUID, "exclusive", "ann")
    with django_capture_on_commit_callbacks(execute=True):
        bindings.release_binding(first, "pod deleted")
    assert (card().mode, card().pending_mode) == ("shared", "exclusive")  # one slice left
    with django_capture_on_commit_callbacks(execute=True):
        bindings.release_binding(second, "pod deleted")
    assert (card().mode, card().pending_mode) == ("exclusive", "")
    assert events()[-1] == (
        "system", "card-mode",
        {"node": "n1", "reason": "its last slice ended", "from": "shared", "to": "exclusive"},
    )  # fmt: skip


@pytest.mark.usefixtures("node")
def test_bulk_release_applies_the_change(django_capture_on_commit_callbacks: Any) -> None:
    uids = [bind("p1"), bind("p2")]
    modes.set_card_mode(UUID, "mig", "ann")
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        bindings.release_bindings(uids, "pods deleted", actor="reconciler")
    assert len(callbacks) == 1
    assert (card().mode, card().pending_mode) == ("mig", "")


@pytest.mark.usefixtures("node")
def test_reconciler_pass_applies_a_missed_change_once() -> None:
    uid = bind("p1")
    modes.set_card_mode(UUID, "mps", "ann")
    # The release's after-commit step never ran (callbacks are not executed here): the drained
    # card waits for the periodic pass.
    bindings.release_binding(uid, "pod deleted")
    assert card().pending_mode == "mps"
    assert modes.apply_pending_modes() == [UUID]
    assert (card().mode, card().pending_mode) == ("mps", "")
    assert modes.apply_pending_modes() == []  # idempotent
    assert [e[1] for e in events()] == ["card-mode-requested", "card-mode"]


@pytest.mark.usefixtures("node")
def test_pass_leaves_a_card_that_still_holds_slices() -> None:
    bind("p1")
    modes.set_card_mode(UUID, "mps", "ann")
    card_id = card().pk
    assert modes.apply_pending_modes() == []
    assert modes.apply_pending_modes([card_id]) == []  # re-checked under the lock
    assert card().pending_mode == "mps"


@pytest.mark.usefixtures("node")
def test_asking_the_current_mode_cancels_a_pending_change() -> None:
    bind("p1")
    modes.set_card_mode(UUID, "mig", "ann")
    modes.set_card_mode(UUID, "shared", "bob", "changed our minds")
    assert (card().mode, card().pending_mode, card().schedulable) == ("shared", "", True)
    assert events()[-1] == (
        "bob", "card-mode-cancelled",
        {"node": "n1", "mode": "shared", "cancelled": "mig", "reason": "changed our minds"},
    )  # fmt: skip
    modes.set_card_mode(UUID, "shared", "bob")  # nothing pending: nothing recorded
    assert len(events()) == 2


@pytest.mark.usefixtures("node")
def test_a_new_request_replaces_a_pending_one() -> None:
    bind("p1")
    modes.set_card_mode(UUID, "mig", "ann")
    modes.set_card_mode(UUID, "mps", "ann")
    assert card().pending_mode == "mps"
    assert [e[2]["to"] for e in events()] == ["mig", "mps"]


@pytest.mark.usefixtures("node")
@pytest.mark.parametrize("mode", ["MIG", "vgpu", "", None, 3])
def test_unknown_mode_is_refused_and_changes_nothing(mode: Any) -> None:
    with pytest.raises(ServiceError) as err:
        modes.set_card_mode(UUID, mode, "ann")
    assert err.value.status == 400 and err.value.field == "mode"
    assert "shared, mig, mps, exclusive" in err.value.message
    assert (card().mode, card().pending_mode) == ("shared", "") and not events()


def test_mig_on_a_card_not_mig_capable_is_refused() -> None:
    make_node("n1", cards=1)
    bind("p1")
    with pytest.raises(ServiceError) as err:
        modes.set_card_mode(UUID, "mig", "ann")
    assert err.value.field == "mode" and "not reported MIG-capable" in err.value.message
    assert (card().mode, card().pending_mode) == ("shared", "") and not events()


def test_unknown_card_is_not_found() -> None:
    with pytest.raises(NotFound) as err:
        modes.set_card_mode("GPU-nope", "mps", "ann")
    assert err.value.status == 404 and err.value.field == "uuid"


@pytest.mark.parametrize(
    ("model", "capable", "expected"),
    [
        ("NVIDIA A100-SXM4-80GB", True, ("mig", "TESSERA_CARD_MODE_DEFAULTS[0] (model 'a100')")),
        ("NVIDIA H100 80GB HBM3", True, ("mps", "TESSERA_CARD_MODE_DEFAULTS[1] (model 'H100')")),
        ("Tesla T4", False, None),
    ],
)
def test_initial_mode_first_matching_rule_wins(
    model: str, capable: bool, expected: tuple[str, str] | None
) -> None:
    rules = [{"model": "a100", "mode": "mig"}, {"model": "H100", "mode": "mps"},
             {"model": "h100", "mode": "exclusive"}]  # fmt: skip
    got = mode_rules.initial_mode(model, capable, rules)
    assert (got.mode, got.note) == expected if got else expected is None


def test_initial_mig_rule_on_a_card_without_mig_stays_shared() -> None:
    got = mode_rules.initial_mode("NVIDIA A10", False, [{"model": "a10", "mode": "mig"}])
    assert got is not None and got.mode == "shared" and "not reported MIG-capable" in got.note
