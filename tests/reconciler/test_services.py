"""Reconciler repairs called directly: each kind of drift; a second pass changes nothing."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.kube.sources import PodView
from controlplane.ledger import allocation
from controlplane.ledger.allocation import verify_allocation
from controlplane.ledger.models import AuditEvent, Node, PodBinding, Slice
from controlplane.ledger.services import bindings, nodes
from controlplane.reconciler import services
from controlplane.scheduling import parse_pod
from tests.builders import make_node
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db


def reserve(name: str, node: str = "n1", mem: int = 1000) -> bindings.Reservation:
    request = parse_pod(pod_json(name, containers=[gpu_container(mem=mem)]))
    assert request is not None
    return bindings.bind_pod(request, node)


def view(binding_or_uid, node: str | None = "n1", phase: str = "Running", **annotations):
    uid = binding_or_uid if isinstance(binding_or_uid, str) else binding_or_uid.pod_uid
    name = uid.removeprefix("uid-default-")
    return PodView(uid, "default", name, node, phase, annotations)


def run(pods, complete: bool = True, **kw):
    later = timezone.now() + timedelta(seconds=1)
    return services.reconcile_pods(
        pods, listed_at=later, complete=complete, verify=verify_allocation, **kw
    )


def phase(uid: str) -> str:
    return PodBinding.objects.get(pod_uid=uid).phase


def signed(uid: str, name: str, node: str, card: str, mem: int = 2000, cores: int = 10):
    record = allocation.allocation_record(
        uid,
        "default",
        name,
        node,
        [allocation.ContainerAllocation("c", 0, False, (allocation.Device(card, 0, mem, cores),))],
    )
    return allocation.annotations(record)


@pytest.fixture(autouse=True)
def _node(db: None) -> None:
    make_node("n1", cards=2, memory_mib=10000)


def test_deleted_and_finished_pods_release_their_slices_and_a_rerun_changes_nothing() -> None:
    gone, done, failed, alive = (reserve(n) for n in ("gone", "done", "failed", "alive"))
    for b in (done, failed, alive):
        bindings.confirm_binding(b.pod_uid)
    pods = [view(done, phase="Succeeded"), view(failed, phase="Failed"), view(alive)]
    drift = run(pods)
    assert drift == {"released_deleted": 1, "released_finished": 2}
    assert [phase(b.pod_uid) for b in (gone, done, failed, alive)] == [
        "released",
        "released",
        "released",
        "bound",
    ]
    assert Slice.objects.filter(active=True).count() == 1
    assert AuditEvent.objects.filter(actor="reconciler", action="release").count() == 3
    assert run(pods) == {}


def test_a_partial_event_list_never_releases_pods_it_does_not_name() -> None:
    keep, drop = reserve("keep"), reserve("drop")
    drift = run([], complete=False, deleted_uids=[drop.pod_uid])
    assert drift == {"released_deleted": 1}
    assert phase(keep.pod_uid) == "reserved" and phase(drop.pod_uid) == "released"


def test_bindings_newer_than_the_list_are_left_alone() -> None:
    listed_at = timezone.now()
    fresh = reserve("fresh")
    drift = services.reconcile_pods(
        [], listed_at=listed_at, complete=True, verify=verify_allocation
    )
    assert drift == {}
    assert phase(fresh.pod_uid) == "reserved"


def test_expired_reservation_is_released_or_confirmed_by_what_the_api_server_says() -> None:
    never, landed, waiting = reserve("never"), reserve("landed"), reserve("waiting")
    PodBinding.objects.filter(pod_uid__in=[never.pod_uid, landed.pod_uid]).update(
        deadline=timezone.now() - timedelta(seconds=1)
    )
    pods = [view(never, node=None, phase="Pending"), view(landed), view(waiting, node=None)]
    drift = run(pods)
    assert drift == {"released_expired_reservation": 1, "confirmed_reservation": 1}
    assert phase(never.pod_uid) == "failed"  # its bind never reached the API server
    assert phase(landed.pod_uid) == "bound"  # the Binding landed; its process died after
    assert phase(waiting.pod_uid) == "reserved"  # still within its deadline


def test_a_bind_retried_after_the_pods_were_read_keeps_its_reservation() -> None:
    """The view says "unbound, deadline passed"; then the extender retries the bind (the
    Binding goes out again and lands). The pass that acts on the older view must not fail the
    reservation: the pod would run holding nothing in the ledger."""
    retried = reserve("retried")
    PodBinding.objects.filter(pod_uid=retried.pod_uid).update(
        deadline=timezone.now() - timedelta(seconds=5)
    )
    listed_at = timezone.now()  # the view: unbound, past the deadline
    again = reserve("retried")  # the retried bind, after the view
    assert again.repeat and again.phase == "reserved"
    drift = services.reconcile_pods(
        [view(retried, node=None, phase="Pending")],
        listed_at=listed_at,
        complete=True,
        verify=verify_allocation,
    )
    assert drift == {}
    assert phase(retried.pod_uid) == "reserved"
    assert Slice.objects.filter(binding__pod_uid=retried.pod_uid, active=True).count() == 1


def test_a_retried_bind_renews_its_reservation_s_deadline() -> None:
    first = reserve("slow")
    PodBinding.objects.filter(pod_uid=first.pod_uid).update(
        deadline=timezone.now() - timedelta(seconds=5)
    )
    before = timezone.now()
    reserve("slow")
    deadline = PodBinding.objects.get(pod_uid=first.pod_uid).deadline
    assert deadline is not None and deadline > before


def test_the_expiry_release_skips_a_reservation_renewed_after_the_view() -> None:
    """Under the row lock, not from the rows read earlier in the pass: a bind can renew the
    reservation between the pass's read of the bindings and its release."""
    renewed, stale = reserve("renewed"), reserve("stale")
    view_time = timezone.now()
    PodBinding.objects.filter(pod_uid=stale.pod_uid).update(
        deadline=view_time - timedelta(seconds=1)
    )
    PodBinding.objects.filter(pod_uid=renewed.pod_uid).update(
        deadline=view_time + timedelta(seconds=30)
    )
    done = bindings.release_bindings(
        [renewed.pod_uid, stale.pod_uid], "expired", failed=True, expired_by=view_time
    )
    assert done == [stale.pod_uid]
    assert (phase(renewed.pod_uid), phase(stale.pod_uid)) == ("reserved", "failed")


def test_a_young_bound_reservation_is_confirmed_as_routine_an_old_one_as_drift() -> None:
    """The extender confirms in batches moments after its Binding; a reconciler that gets
    there first confirms too, but that is no drift. Past the grace the confirmation was lost."""
    young, old = reserve("young"), reserve("old")
    PodBinding.objects.filter(pod_uid=old.pod_uid).update(
        reserved_at=timezone.now() - services.CONFIRM_GRACE - timedelta(seconds=1)
    )
    drift = run([view(young), view(old)])
    assert drift == {"confirmed_reservation": 1}
    assert phase(young.pod_uid) == "bound" and phase(old.pod_uid) == "bound"
    audited = AuditEvent.objects.filter(actor="reconciler", action="confirm")
    assert [e.details["uid"] for e in audited] == [old.pod_uid]
    assert run([view(young), view(old)]) == {}


def test_pod_bound_to_another_node_releases_the_stale_reservation() -> None:
    make_node("n2", cards=1)
    b = reserve("moved")
    drift = run([view(b, node="n2")])
    assert drift == {"released_wrong_node": 1}
    assert phase(b.pod_uid) == "failed"


def test_a_bound_pod_missing_from_the_ledger_is_adopted() -> None:
    annotations = signed("uid-default-lost", "lost", "n1", "GPU-n1-1", mem=2500, cores=30)
    drift = run([view("uid-default-lost", **annotations)])
    assert drift == {"adopted": 1}
    binding = PodBinding.objects.get(pod_uid="uid-default-lost")
    assert binding.phase == "bound" and binding.node.name == "n1"
    assert list(binding.slices.values_list("card__uuid", "memory_mib", "compute_percent")) == [
        ("GPU-n1-1", 2500, 30)
    ]
    assert run([view("uid-default-lost", **annotations)]) == {}


@pytest.mark.parametrize(
    "tamper",
    ["unsigned", "bad-signature", "altered-memory", "other-pod", "other-node", "garbage"],
)
def test_forged_or_invalid_allocations_are_flagged_never_adopted(tamper: str) -> None:
    annotations = dict(signed("uid-default-x", "x", "n1", "GPU-n1-0"))
    node = "n1"
    if tamper == "unsigned":
        del annotations[allocation.SIGNATURE_ANNOTATION]
    elif tamper == "bad-signature":
        annotations[allocation.SIGNATURE_ANNOTATION] = "v1:AAAA"
    elif tamper == "altered-memory":
        annotations[allocation.ANNOTATION] = annotations[allocation.ANNOTATION].replace(
            "2000", "9000"
        )
    elif tamper == "other-pod":
        annotations = dict(signed("uid-default-y", "y", "n1", "GPU-n1-0"))
    elif tamper == "other-node":
        node = "n9"
    elif tamper == "garbage":
        annotations = {allocation.ANNOTATION: "{not json", allocation.SIGNATURE_ANNOTATION: ""}
        annotations[allocation.SIGNATURE_ANNOTATION] = allocation.sign(
            annotations[allocation.ANNOTATION]
        )
    drift = run([view("uid-default-x", node=node, **annotations)])
    assert drift == {"flagged_invalid_allocation": 1}, drift
    assert not PodBinding.objects.exists()
    event = AuditEvent.objects.get(action="invalid-allocation")
    assert event.details["uid"] == "uid-default-x" and event.details["reason"]


def test_stale_and_deleted_nodes_are_marked_not_ready() -> None:
    make_node("n2", cards=1)
    Node.objects.filter(name="n1").update(last_heartbeat=timezone.now() - timedelta(hours=1))
    assert nodes.mark_stale_nodes(services.SYSTEM) == 1
    assert nodes.mark_stale_nodes(services.SYSTEM) == 0
    assert not Node.objects.get(name="n1").ready
    assert nodes.mark_deleted_nodes({"n1"}, services.SYSTEM) == 1
    assert not Node.objects.get(name="n2").ready
    make_node("n1", cards=2, memory_mib=10000)  # its next report brings it back
    assert Node.objects.get(name="n1").ready


class Restored:
    """An API server whose etcd came back from a backup at version 50, where the pod of the
    one binding is gone; a watch from any version says nothing (as a real one does for a
    version it has not reached)."""

    def __init__(self) -> None:
        self.watched: list[str] = []

    def list_pods(self, page_size: int = 500):
        return [], "50"

    def watch_pods(self, rv, timeout_s):
        self.watched.append(rv)
        return iter(())

    def get_pod(self, namespace, name):
        return None

    def list_node_names(self):
        return {"n1"}

    def last_resource_version(self):
        return self.watched[-1] if self.watched else "50"

    def current_resource_version(self):
        return "50"

    def cluster_identity(self):
        return "uid-of-kube-system"


def test_metrics_show_the_reconcilers_runs_and_drift(admin_client) -> None:
    from controlplane.reconciler.tasks import LocalState, run_reconcile

    reserve("gone")
    PodBinding.objects.update(created_at=timezone.now() - timedelta(seconds=5))
    run = run_reconcile(Restored(), LocalState(), full=True)
    assert run.drift == {"released_deleted": 1}
    body = admin_client.get("/metrics").content.decode()
    assert 'tessera_reconcile_drift_24h{kind="released_deleted"} 1' in body
    assert 'tessera_reconcile_last_duration_seconds{mode="full"}' in body


def test_a_resume_point_ahead_of_the_api_server_is_a_full_relist_not_a_silent_watch() -> None:
    import time

    from controlplane.reconciler.tasks import (
        LAST_FULL_KEY,
        RESUME_KEY,
        LocalState,
        resume_point,
        run_reconcile,
    )

    make_node("n1", cards=1, memory_mib=10000)
    gone = reserve("gone")
    PodBinding.objects.update(created_at=timezone.now() - timedelta(seconds=5))
    source = Restored()
    saved = resume_point(source.cluster_identity(), "900")  # saved before the restore
    state = LocalState({RESUME_KEY: saved, LAST_FULL_KEY: str(time.time())})

    first = run_reconcile(source, state, full=False)

    assert first.mode == "full" and source.watched == []
    assert first.drift == {"resume_point_ahead": 1, "released_deleted": 1}
    assert PodBinding.objects.get(pk=gone.binding_id).phase == "released"
    assert json.loads(state[RESUME_KEY]) == {"cluster": "uid-of-kube-system", "rv": "50"}
    second = run_reconcile(source, state, full=False)  # now a version the server has
    assert second.mode == "watch" and source.watched == ["50"]


class Replaceable:
    """A cluster that can be replaced under the reconciler: a new etcd, a new kube-system UID,
    and a resourceVersion counter of its own. Like a real API server, a watch from a version
    the store has passed long ago returns no error; from the old cluster's version it shows
    only what happened here after that number, so everything before is never seen."""

    def __init__(self) -> None:
        self.identity, self.rv, self.pods = "uid-a", "120", [view("uid-default-keeper")]
        self.watched: list[str] = []

    def replace(self) -> None:
        self.identity, self.rv, self.pods = "uid-b", "400", []

    def list_pods(self, page_size: int = 500):
        return list(self.pods), self.rv

    def watch_pods(self, rv, timeout_s):
        self.watched.append(rv)
        return iter(())

    def get_pod(self, namespace, name):
        return next((p for p in self.pods if p.name == name), None)

    def list_node_names(self):
        return {"n1"}

    def last_resource_version(self):
        return self.rv

    def current_resource_version(self):
        return self.rv

    def cluster_identity(self):
        return self.identity


def test_a_resume_point_saved_on_a_replaced_cluster_is_discarded_for_a_full_relist() -> None:
    """Redis kept the resume point while the cluster behind the API server was replaced. Its
    version (120) is behind the new cluster's (400), so the ahead check passes it; a watch from
    it would miss that the pod of the binding is gone. The identity tells."""
    import time

    from controlplane.reconciler.tasks import LAST_FULL_KEY, RESUME_KEY, LocalState, run_reconcile

    keeper = reserve("keeper")
    PodBinding.objects.update(created_at=timezone.now() - timedelta(seconds=5))
    cluster = Replaceable()
    state = LocalState()
    first = run_reconcile(cluster, state, full=True)
    assert first.mode == "full" and phase(keeper.pod_uid) != "released"
    assert json.loads(state[RESUME_KEY]) == {"cluster": "uid-a", "rv": "120"}

    cluster.replace()
    state[LAST_FULL_KEY] = str(time.time())  # a recent relist: only the identity can tell
    second = run_reconcile(cluster, state, full=False)

    assert second.mode == "full" and cluster.watched == []
    assert second.drift == {"resume_point_other_cluster": 1, "released_deleted": 1}
    assert phase(keeper.pod_uid) == "released"
    assert json.loads(state[RESUME_KEY]) == {"cluster": "uid-b", "rv": "400"}
    third = run_reconcile(cluster, state, full=False)  # this cluster's own point: a watch
    assert third.mode == "watch" and cluster.watched == ["400"] and third.drift == {}


def test_a_resume_point_of_an_older_format_or_garbage_is_no_resume_point() -> None:
    """A value without a cluster (or not JSON at all) is simply absent: one relist, not counted
    as drift."""
    import time

    from controlplane.reconciler.tasks import LAST_FULL_KEY, RESUME_KEY, LocalState, run_reconcile

    for junk in ("120", "{not json", json.dumps({"cluster": "uid-a"})):
        cluster = Replaceable()
        state = LocalState({RESUME_KEY: junk, LAST_FULL_KEY: str(time.time())})
        run = run_reconcile(cluster, state, full=False)
        assert run.mode == "full" and cluster.watched == [] and run.drift == {}, junk
        assert json.loads(state[RESUME_KEY]) == {"cluster": "uid-a", "rv": "120"}


def test_a_pass_applies_the_mode_change_of_a_card_its_repairs_drained() -> None:
    from controlplane.ledger.models import Card
    from controlplane.ledger.services import modes
    from controlplane.reconciler.tasks import LocalState, run_reconcile

    gone = reserve("gone")
    uuid = gone.assignments[0].card_uuid
    modes.set_card_mode(uuid, "mps", "ann")
    PodBinding.objects.update(created_at=timezone.now() - timedelta(seconds=5))
    # The release's after-commit step does not run inside the test's transaction: the pass's own
    # sweep is what applies the change here.
    run = run_reconcile(Restored(), LocalState(), full=True)
    assert run.drift == {"released_deleted": 1, "card_modes_applied": 1}
    assert Card.objects.filter(uuid=uuid).values_list("mode", "pending_mode").get() == ("mps", "")
    event = AuditEvent.objects.filter(action="card-mode").get()
    assert (event.actor, event.target, event.details["to"]) == ("system", uuid, "mps")
    again = run_reconcile(Restored(), LocalState(), full=True)
    assert "card_modes_applied" not in again.drift
