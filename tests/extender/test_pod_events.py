"""Bind tells the pod what it got (or why not) with Kubernetes Events, off its path."""

from __future__ import annotations

import threading

import pytest
from django.conf import settings
from prometheus_client import REGISTRY

from controlplane.kube import base as kube
from controlplane.kube import events
from tests.builders import make_node
from tests.extender.builders import bind_args
from tests.extender.conftest import fixture_pod, post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db


def bind(client, pod, node):
    return post(client, "/scheduler/bind", bind_args(pod, node))


def dropped() -> float:
    return REGISTRY.get_sample_value("tessera_pod_events_dropped_total") or 0.0


def test_a_bound_pod_gets_an_allocated_event_with_its_cards(client, fake_kube) -> None:
    make_node("big", cards=2, memory_mib=8000)
    pod = fake_kube.add(fixture_pod())
    assert bind(client, pod, "big").json() == {"Error": ""}

    [event] = fake_kube.events
    meta = pod["metadata"]
    assert event["involvedObject"] == {
        "apiVersion": "v1", "kind": "Pod", "namespace": "team-a", "name": meta["name"],
        "uid": meta["uid"],
    }  # fmt: skip
    assert event["metadata"]["namespace"] == "team-a"
    assert event["metadata"]["name"].startswith(meta["name"] + ".")
    assert (event["type"], event["reason"]) == ("Normal", "Allocated")
    assert event["source"] == {"component": "tessera-extender"}
    # the init container (no gpucores: not limited) first, then the app container's two cards in
    # the order it sees them
    assert event["message"] == (
        "node big: warmup (init): card 0 GPU-big-0 2000 MiB compute not limited; "
        "trainer: card 0 GPU-big-0 3000 MiB 30% compute, card 1 GPU-big-1 3000 MiB 30% compute"
    )


def test_a_repeated_bind_tells_nothing_twice(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())
    assert bind(client, pod, "n1").json() == {"Error": ""}
    assert bind(client, pod, "n1").json() == {"Error": ""}
    assert [e["reason"] for e in fake_kube.events] == ["Allocated"]


def test_a_refused_bind_gets_a_warning_with_the_reason(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    first = fake_kube.add(gpu_pod("first", mem=8000))
    second = fake_kube.add(gpu_pod("second", mem=4000))
    assert bind(client, first, "n1").json() == {"Error": ""}
    answer = bind(client, second, "n1").json()["Error"]

    warning = fake_kube.events[-1]
    assert warning["involvedObject"]["name"] == "second"
    assert (warning["type"], warning["reason"]) == ("Warning", "AllocationFailed")
    assert warning["message"] == f"node n1: {answer}"
    assert "2000 MiB free" in warning["message"]


def test_a_binding_the_api_server_refused_gets_a_warning(client, fake_kube) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())

    def fail() -> None:
        raise kube.KubeError("API server answered 403: forbidden", 403, False)

    fake_kube.fail_bind = fail
    bind(client, pod, "n1")
    [warning] = fake_kube.events
    assert warning["reason"] == "AllocationFailed"
    assert "refused the Binding" in warning["message"] and "forbidden" in warning["message"]


def test_an_event_the_api_server_cannot_take_is_dropped_and_bind_still_succeeds(
    client, fake_kube, monkeypatch
) -> None:
    monkeypatch.setattr(events, "RETRY_S", 0.0)
    calls = []

    def away(namespace, event) -> None:
        calls.append(event["reason"])
        raise kube.KubeError("API server unreachable: connection refused", None, None)

    fake_kube.create_event = away
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod())
    before = dropped()
    assert bind(client, pod, "n1").json() == {"Error": ""}
    assert calls == ["Allocated"] * events.ATTEMPTS  # a temporary failure is tried again
    assert dropped() == before + 1


def test_a_refused_event_is_not_retried(fake_kube, monkeypatch) -> None:
    calls = []

    def refuse(namespace, event) -> None:
        calls.append(event["reason"])
        raise kube.KubeError("API server answered 403: forbidden", 403, False)

    fake_kube.create_event = refuse
    before = dropped()
    events.record("ns", "p", "uid-1", "Allocated", "m")
    assert calls == ["Allocated"] and dropped() == before + 1


def test_a_long_message_is_cut_to_what_the_api_server_takes() -> None:
    event = events.pod_event("ns", "p", "uid-1", "AllocationFailed", "x" * 5000, events.WARNING)
    assert len(event["message"]) == events.MAX_MESSAGE and event["message"].endswith("…")


def test_events_leave_bind_s_path_and_are_posted_by_one_thread(fake_kube, monkeypatch) -> None:
    monkeypatch.setattr(settings, "TESSERA", {**settings.TESSERA, "EVENTS_ASYNC": True})
    release = threading.Event()
    posted: list[str] = []

    def slow(namespace, event) -> None:
        release.wait(5)
        posted.append(event["message"])

    fake_kube.create_event = slow
    recorder = events.Recorder()
    for i in range(3):
        recorder.submit(events.pod_event("ns", f"p{i}", f"uid-{i}", "Allocated", f"m{i}"))
    assert posted == []  # submit returned while the API server was still busy
    release.set()
    assert recorder.flush(5.0)
    assert posted == ["m0", "m1", "m2"]


def test_a_full_queue_drops_and_counts(fake_kube, monkeypatch) -> None:
    monkeypatch.setattr(settings, "TESSERA", {**settings.TESSERA, "EVENTS_ASYNC": True})
    monkeypatch.setattr(events, "MAX_QUEUED", 2)
    release = threading.Event()

    def held(namespace, event) -> None:
        release.wait(5)

    fake_kube.create_event = held
    recorder = events.Recorder()
    before = dropped()
    for i in range(6):
        recorder.submit(events.pod_event("ns", f"p{i}", f"uid-{i}", "Allocated", "m"))
    # the thread holds one, two wait in the queue: the other three are dropped
    assert dropped() >= before + 3
    release.set()
    assert recorder.flush(5.0)
