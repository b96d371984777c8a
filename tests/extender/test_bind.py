"""`POST /scheduler/bind`: reserve, Binding with the signed allocation, confirm or undo."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone
from prometheus_client import REGISTRY

from controlplane.kube import base as kube
from controlplane.ledger import allocation
from controlplane.ledger.models import PodBinding, SchedulingDecision, Slice
from controlplane.ledger.selectors import expired_reservations
from tests.builders import make_node
from tests.extender.builders import bind_args, filter_args, plain_pod
from tests.extender.conftest import fixture_pod, post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db


def bind(client, pod, node):
    return post(client, "/scheduler/bind", bind_args(pod, node))


def test_bind_reserves_binds_with_signed_allocation_and_confirms(client, fake_kube) -> None:
    make_node("big", cards=2, memory_mib=8000)
    pod = fake_kube.add(fixture_pod())

    response = bind(client, pod, "big")

    assert response.status_code == 200 and response.json() == {"Error": ""}
    assert float(response["X-Tessera-Apiserver-Ms"]) >= 0
    binding = PodBinding.objects.get(pod_uid=pod["metadata"]["uid"])
    assert binding.phase == PodBinding.Phase.BOUND and binding.deadline is None
    assert binding.slices.filter(active=True).count() == 3  # warmup x1 + trainer x2

    [(ns, name, uid, node, annotations)] = fake_kube.bind_calls
    assert (ns, name, uid, node) == ("team-a", "trainer-7f9c4b6d8-x2kqp", binding.pod_uid, "big")
    value = annotations[allocation.ANNOTATION]
    record = json.loads(value)
    # docs/allocation.md: compact JSON, keys sorted, version 1
    assert value == json.dumps(record, separators=(",", ":"), sort_keys=True)
    assert record["v"] == 1 and record["node"] == "big" and record["namespace"] == "team-a"
    assert record["name"] == "trainer-7f9c4b6d8-x2kqp" and record["pod_uid"] == binding.pod_uid
    warmup, trainer = record["containers"]
    assert (warmup["name"], warmup["init"], warmup["index"]) == ("warmup", True, 0)
    assert (trainer["name"], trainer["init"], trainer["index"]) == ("trainer", False, 0)
    assert [d["uuid"] for d in trainer["devices"]] == ["GPU-big-0", "GPU-big-1"]  # card order
    assert all(d == {**d, "memory_mib": 3000, "cores": 30} for d in trainer["devices"])
    assert warmup["devices"][0]["memory_mib"] == 2000
    # the signature: v1: + unpadded base64url HMAC-SHA256 over the exact value bytes
    signature = annotations[allocation.SIGNATURE_ANNOTATION]
    assert signature.startswith("v1:") and "=" not in signature
    key = b"tessera-test-allocation-key-0123456789abcdef"
    assert allocation.verify(value, signature, key)
    assert not allocation.verify(value.replace("3000", "9000"), signature, key)
    assert fake_kube.pods[("team-a", "trainer-7f9c4b6d8-x2kqp")]["spec"]["nodeName"] == "big"


def test_bind_twice_returns_the_same_answer_without_a_second_binding(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())
    assert bind(client, pod, "n1").json() == {"Error": ""}
    assert bind(client, pod, "n1").json() == {"Error": ""}
    assert len(fake_kube.bind_calls) == 1
    assert Slice.objects.filter(active=True).count() == 1
    other = bind(client, pod, "n2").json()["Error"]
    assert "already bound on node n1" in other


def test_a_repeated_bind_of_a_pod_gone_since_gets_the_ledgers_answer(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())
    assert bind(client, pod, "n1").json() == {"Error": ""}
    meta = pod["metadata"]
    assert fake_kube.delete_pod(meta.get("namespace", "default"), meta["name"])
    # bound before: success again, with no second Binding for a pod that is not there
    assert bind(client, pod, "n1").json() == {"Error": ""}
    assert len(fake_kube.bind_calls) == 1
    # held on another node than the one asked: refused, naming where it is
    assert "already bound on node n1" in bind(client, pod, "n2").json()["Error"]


def test_a_retry_after_a_crash_completes_the_same_reservation(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())

    class Crash(BaseException):
        pass

    def die() -> None:
        raise Crash

    fake_kube.fail_bind = die
    with pytest.raises(Crash):
        bind(client, pod, "n1")
    assert PodBinding.objects.get().phase == PodBinding.Phase.RESERVED
    fake_kube.fail_bind = None
    assert bind(client, pod, "n1").json() == {"Error": ""}
    assert PodBinding.objects.get().phase == PodBinding.Phase.BOUND
    assert Slice.objects.filter(active=True).count() == 1


def test_an_earlier_binding_that_landed_counts_as_success(client, fake_kube) -> None:
    """The Binding went through but the answer was lost: the 409 on retry is our own bind."""
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())
    original = fake_kube.bind_pod

    def bind_then_drop_the_answer(*args):
        original(*args)  # the API server did it...
        raise kube.KubeError("read timed out", None, None)  # ...but we never heard back

    fake_kube.bind_pod = bind_then_drop_the_answer
    assert bind(client, pod, "n1").json() == {"Error": ""}
    assert PodBinding.objects.get().phase == PodBinding.Phase.BOUND


@pytest.mark.parametrize(
    "error",
    [
        kube.KubeError("API server answered 500: etcdserver: request timed out", 500, None),
        kube.KubeError("API server answered 403: forbidden", 403, False),
        kube.KubeError("API server unreachable: connection refused", None, False),
    ],
)
def test_api_server_failure_at_bind_leaves_no_reservation(client, fake_kube, error) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())

    def fail() -> None:
        raise error

    fake_kube.fail_bind = fail
    answer = bind(client, pod, "n1").json()["Error"]
    assert "refused the Binding" in answer and error.message in answer
    binding = PodBinding.objects.get()
    assert binding.phase == PodBinding.Phase.FAILED
    assert not Slice.objects.filter(active=True).exists()
    decision = SchedulingDecision.objects.get()
    assert decision.outcome == "bind_failed" and error.message in decision.summary
    # and the room is really free again: the retry binds
    fake_kube.fail_bind = None
    assert bind(client, pod, "n1").json() == {"Error": ""}
    assert PodBinding.objects.get().phase == PodBinding.Phase.BOUND


def test_unknown_outcome_keeps_the_reservation_for_the_reconciler(client, fake_kube) -> None:
    """Timeout on the Binding and the API server cannot be asked: releasing could free room a
    bound pod uses, so the reservation stays, with its deadline, for the reconciler."""
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())

    def timeout() -> None:
        raise kube.KubeError("read timed out", None, None)

    fake_kube.fail_bind = timeout
    fake_kube.fail_get = None
    original_get = fake_kube.get_pod
    state = {"reads": 0}

    def get_then_fail(ns, name):
        state["reads"] += 1
        if state["reads"] > 1:
            raise kube.KubeError("API server unreachable", None, False)
        return original_get(ns, name)

    fake_kube.get_pod = get_then_fail
    answer = bind(client, pod, "n1").json()["Error"]
    assert "unknown" in answer and "reconciler" in answer
    binding = PodBinding.objects.get()
    assert binding.phase == PodBinding.Phase.RESERVED
    now = timezone.now()
    assert expired_reservations(now) == []
    [expired] = expired_reservations(binding.deadline + timedelta(seconds=1))
    assert expired.pod_uid == binding.pod_uid and expired.node == "n1"


def test_crash_between_commit_and_api_call_is_found_by_the_reconciler_query(
    client, fake_kube
) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())

    class ProcessDied(BaseException):
        """Not an Exception: nothing in the process may catch it, as with SIGKILL."""

    def die() -> None:
        raise ProcessDied

    fake_kube.fail_bind = die
    with pytest.raises(ProcessDied):
        bind(client, pod, "n1")
    binding = PodBinding.objects.get()
    assert binding.phase == PodBinding.Phase.RESERVED and binding.deadline is not None
    assert expired_reservations(timezone.now()) == []  # not yet: the deadline is ahead
    later = timezone.now() + timedelta(seconds=121)
    [found] = expired_reservations(later)
    assert (found.pod_uid, found.namespace, found.name, found.node) == (
        binding.pod_uid, "default", "p", "n1",
    )  # fmt: skip


def test_pod_without_managed_resources_gets_a_plain_binding(client, fake_kube) -> None:
    pod = fake_kube.add(plain_pod())
    pod["metadata"]["uid"] = fake_kube.pods[("default", "web")]["metadata"]["uid"]
    assert bind(client, pod, "cpu-node-1").json() == {"Error": ""}
    [(_, _, _, node, annotations)] = fake_kube.bind_calls
    assert node == "cpu-node-1" and annotations == {}
    assert not PodBinding.objects.exists()


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda a: a.pop("PodUID"), "PodUID: is missing"),
        (lambda a: a.update(Node=7), "Node: must be a non-empty string"),
        (lambda a: a.update(Node="Not_A_Node"), "is not a node name"),
        (lambda a: a.update(PodNamespace="x" * 70), "PodNamespace"),
        (lambda a: a.update(PodName="ghost"), "does not exist"),
        (lambda a: a.update(PodUID="some-other-uid"), "deleted and replaced"),
        (lambda a: a.update(Node="not-registered"), "not registered with Tessera"),
    ],
)
def test_bad_bind_input_gets_a_clear_error_and_changes_nothing(
    client, fake_kube, mutate, needle
) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())
    args = bind_args(pod, "n1")
    mutate(args)
    response = post(client, "/scheduler/bind", args)
    assert response.status_code == 200
    assert needle in response.json()["Error"]
    assert not PodBinding.objects.filter(phase__in=PodBinding.ACTIVE_PHASES).exists()
    assert not Slice.objects.filter(active=True).exists()
    assert fake_kube.bind_calls == []


def test_bind_of_a_pod_that_no_longer_fits_is_refused(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    first = fake_kube.add(gpu_pod("first", mem=8000))
    second = fake_kube.add(gpu_pod("second", mem=4000))
    assert bind(client, first, "n1").json() == {"Error": ""}
    answer = bind(client, second, "n1").json()["Error"]
    assert "no longer fits on n1" in answer and "2000 MiB free" in answer
    assert len(fake_kube.bind_calls) == 1


def test_bind_body_that_is_not_json_is_a_400(client, fake_kube) -> None:
    response = client.post("/scheduler/bind", data=b"PodName=x", content_type="text/plain")
    assert response.status_code == 400 and "not JSON" in response.json()["Error"]
    lower = post(client, "/scheduler/bind", {"podname": "x"})
    assert lower.status_code == 200 and "PodNamespace: is missing" in lower.json()["Error"]


def test_bind_and_filter_are_counted_in_the_dashboard_metrics(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())

    def count(name: str, labels: dict[str, str]) -> float:
        return REGISTRY.get_sample_value(name, labels) or 0.0

    bound = count("tessera_bind_outcomes_total", {"outcome": "bound"})
    again = count("tessera_bind_outcomes_total", {"outcome": "already_bound"})
    filters = count("tessera_extender_request_seconds_count", {"verb": "filter"})
    post(client, "/scheduler/filter", {"Pod": pod, "NodeNames": ["n1"]})
    bind(client, pod, "n1")
    bind(client, pod, "n1")
    assert count("tessera_bind_outcomes_total", {"outcome": "bound"}) == bound + 1
    assert count("tessera_bind_outcomes_total", {"outcome": "already_bound"}) == again + 1
    assert count("tessera_extender_request_seconds_count", {"verb": "filter"}) == filters + 1


def test_after_filter_bind_does_not_read_the_pod_back(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod("seen", mem=4000))
    plain = fake_kube.add(plain_pod("web"))
    for p in (pod, plain):
        assert post(client, "/scheduler/filter", filter_args(p, ["n1"])).status_code == 200
    assert bind(client, pod, "n1").json() == {"Error": ""}
    assert bind(client, plain, "n1").json() == {"Error": ""}
    assert fake_kube.get_calls == 0  # the requests came from filter
    [slice_] = Slice.objects.filter(active=True)
    assert slice_.memory_mib == 4000 and slice_.binding.phase == PodBinding.Phase.BOUND
    assert [c[1] for c in fake_kube.bind_calls] == ["seen", "web"]
    assert PodBinding.objects.count() == 1  # the plain pod has no ledger row


def test_a_pod_replaced_after_filter_is_refused_by_the_uid_precondition(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod("p", mem=4000))
    assert post(client, "/scheduler/filter", filter_args(pod, ["n1"])).status_code == 200
    replaced = gpu_pod("p", mem=4000)
    replaced["metadata"]["uid"] = "uid-of-the-new-pod"
    fake_kube.add(replaced)  # deleted and created again under the same name
    error = bind(client, pod, "n1").json()["Error"]
    assert "refused the Binding" in error and "Precondition" in error
    assert not Slice.objects.filter(active=True).exists()  # the reservation was undone
    assert PodBinding.objects.get().phase == PodBinding.Phase.FAILED
