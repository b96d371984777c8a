"""`POST /scheduler/prioritize`: a bare HostPriorityList, 0..10 by the node policy."""

from __future__ import annotations

import pytest

from controlplane.ledger.services import bindings
from controlplane.scheduling import parse_pod
from tests.builders import make_node
from tests.extender.builders import filter_args, plain_pod
from tests.extender.conftest import post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db


@pytest.fixture
def half_full_and_empty() -> list[str]:
    make_node("empty", cards=1, memory_mib=10000)
    make_node("half", cards=1, memory_mib=10000)
    bindings.bind_pod(parse_pod(gpu_pod("hog", mem=5000)), "half")
    return ["empty", "half"]


def scores(client, pod, names) -> dict[str, int]:
    response = post(client, "/scheduler/prioritize", filter_args(pod, names))
    assert response.status_code == 200
    body = response.json()
    assert isinstance(body, list) and all(set(h) == {"Host", "Score"} for h in body)
    assert [h["Host"] for h in body] == names
    return {h["Host"]: h["Score"] for h in body}


def test_binpack_prefers_the_fuller_node(client, half_full_and_empty) -> None:
    got = scores(client, gpu_pod(mem=1000), half_full_and_empty)
    assert got == {"empty": 1, "half": 6}


def test_spread_prefers_the_emptier_node(client, half_full_and_empty) -> None:
    pod = gpu_pod(mem=1000, annotations={"tessera.io/node-policy": "spread"})
    got = scores(client, pod, half_full_and_empty)
    assert got["empty"] > got["half"] and all(0 <= s <= 10 for s in got.values())


def test_hami_policy_annotation_is_an_alias(client, half_full_and_empty) -> None:
    pod = gpu_pod(mem=1000, annotations={"hami.io/node-scheduler-policy": "spread"})
    assert scores(client, pod, half_full_and_empty) == {"empty": 9, "half": 4}


def test_unmanaged_pod_scores_zero_everywhere(client, half_full_and_empty) -> None:
    assert scores(client, plain_pod(), half_full_and_empty) == {"empty": 0, "half": 0}


def test_bad_input_is_a_400_with_the_reason(client) -> None:
    response = post(client, "/scheduler/prioritize", {"Pod": gpu_pod(), "NodeNames": {"a": 1}})
    assert response.status_code == 400 and "NodeNames" in response.json()["Error"]
    pod = gpu_pod()
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpucores"] = "250"
    bad = post(client, "/scheduler/prioritize", filter_args(pod, ["n1"]))
    assert bad.status_code == 400 and "nvidia.com/gpucores" in bad.json()["Error"]


def test_the_request_filter_parsed_is_reused_for_the_same_pod(
    client, half_full_and_empty, monkeypatch
) -> None:
    from controlplane.extender import verbs

    parsed: list[str] = []
    real = verbs.parse_pod

    def counting(pod, config=None):
        parsed.append(pod["metadata"]["name"])
        return real(pod, config)

    monkeypatch.setattr(verbs, "parse_pod", counting)
    pod = gpu_pod("seen", mem=1000, annotations={"tessera.io/node-policy": "spread"})
    post(client, "/scheduler/filter", filter_args(pod, half_full_and_empty))
    assert scores(client, pod, half_full_and_empty) == {"empty": 9, "half": 4}
    assert parsed == ["seen"]  # once, by filter

    # a pod filter did not see (or another pod under a remembered UID) is parsed afresh
    other = gpu_pod("unseen", mem=1000)
    assert scores(client, other, half_full_and_empty) == {"empty": 1, "half": 6}
    renamed = gpu_pod("renamed", mem=1000)
    renamed["metadata"]["uid"] = pod["metadata"]["uid"]
    assert scores(client, renamed, half_full_and_empty) == {"empty": 1, "half": 6}
    assert parsed == ["seen", "unseen", "renamed"]
