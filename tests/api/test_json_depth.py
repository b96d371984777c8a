"""One nesting limit for every JSON body: measured exactly, refused with a 400, never a 500."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from django.test import Client
from hypothesis import given
from hypothesis import strategies as st
from rest_framework.test import APIClient

from controlplane.access.roles import Role
from controlplane.api.parsers import MAX_JSON_DEPTH, json_depth
from controlplane.ledger.models import AuditEvent, Card, NamespaceQuota, Node, PodBinding
from tests.builders import card_json, make_node, token_client
from tests.extender.conftest import fixture_pod


def reference_depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(reference_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(reference_depth, value), default=0)
    return 0


# Strings full of what could fool a byte scanner: quotes, backslashes, brackets, escapes.
tricky_text = st.text(alphabet=st.sampled_from(list('ab"\\[]{}/\n\u00e9\u2028')), max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | tricky_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(tricky_text, inner, max_size=3),
    max_leaves=30,
)


@given(json_values)
def test_the_measure_is_the_real_depth_whatever_the_strings_hold(value: Any) -> None:
    for body in (
        json.dumps(value).encode(),
        json.dumps(value, ensure_ascii=False, indent=2).encode(),
        orjson.dumps(value),
    ):
        assert json_depth(body) == reference_depth(value), body


def nested(levels: int, inner: Any = 1) -> Any:
    value = inner
    for i in range(levels):
        value = [value] if i % 2 else {"k": value}
    return value


def test_the_limit_is_exact_and_counts_brackets_in_strings_as_text() -> None:
    assert json_depth(json.dumps(nested(MAX_JSON_DEPTH)).encode()) == MAX_JSON_DEPTH
    assert json_depth(json.dumps(nested(MAX_JSON_DEPTH + 1)).encode()) == MAX_JSON_DEPTH + 1
    assert json_depth(json.dumps({"a": "[[[[" * 100, "b": '\\"{{{{'}).encode()) == 1
    assert json_depth(b"[" * 100_000) == 100_000  # unclosed: as deep as a decoder would go


def admission_review(pod: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {"uid": "u-1", "kind": {"kind": "Pod"}, "operation": "CREATE", "object": pod},
    }


def test_real_pods_and_reviews_are_far_below_the_limit() -> None:
    pod = fixture_pod()  # a full v1.Pod as the API server serves it, managedFields included
    pod["spec"]["affinity"] = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a"]}]}
                ]
            }
        }
    }
    review = json.dumps(admission_review(pod)).encode()
    filter_args = json.dumps({"Pod": pod, "NodeNames": [f"n{i}" for i in range(1000)]}).encode()
    assert json_depth(review) <= MAX_JSON_DEPTH // 2
    assert json_depth(filter_args) <= MAX_JSON_DEPTH // 2


# --- every entry point ---------------------------------------------------------------------------

DEEP = [MAX_JSON_DEPTH + 1, 100_000]


def ledger_state() -> tuple[Any, ...]:
    return (
        list(NamespaceQuota.objects.values_list("namespace", "gpus")),
        list(Node.objects.values_list("name", "cordoned", "plugin_version")),
        list(Card.objects.values_list("uuid", "cordoned")),
        list(PodBinding.objects.values_list("pod_uid", "phase")),
        AuditEvent.objects.count(),
    )


def deep_body(levels: int) -> str:
    if levels > 1000:  # past what json.dumps itself can write
        return "[" * levels + "]" * levels
    return json.dumps(nested(levels))


REST_WRITES = [
    ("operator", "post", "/api/v1/quotas/"),
    ("operator", "put", "/api/v1/quotas/team-a/"),
    ("operator", "patch", "/api/v1/quotas/team-a/"),
    ("operator", "post", "/api/v1/nodes/n1/cordon"),
    ("operator", "post", "/api/v1/nodes/n1/uncordon"),
    ("operator", "post", "/api/v1/cards/GPU-n1-0/cordon"),
    ("node", "put", "/api/v1/nodes/n1/inventory"),
    ("node", "post", "/api/v1/allocations/uid-1/containers/c/allocated"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("levels", DEEP)
@pytest.mark.parametrize(("who", "method", "url"), REST_WRITES)
def test_rest_writes_refuse_deep_bodies_with_a_400(
    who: str, method: str, url: str, levels: int
) -> None:
    make_node("n1", cards=1)
    client: APIClient = token_client("n1" if who == "node" else "otto", Role(who))
    before = ledger_state()
    response = getattr(client, method)(url, data=deep_body(levels), content_type="application/json")
    assert response.status_code == 400, response.content
    body = response.json()
    assert f"nested deeper than {MAX_JSON_DEPTH} levels" in body["error"]
    assert "body" in body["fields"]
    assert ledger_state() == before


@pytest.mark.django_db
def test_a_body_at_the_limit_reaches_validation() -> None:
    make_node("n1", cards=1)
    client = token_client("otto", Role.OPERATOR)
    body = json.dumps({"reason": nested(MAX_JSON_DEPTH - 1)})
    response = client.post("/api/v1/nodes/n1/cordon", data=body, content_type="application/json")
    assert response.status_code == 400
    assert "reason" in response.json()["fields"]  # parsed; refused by the serializer instead


@pytest.mark.django_db
@pytest.mark.parametrize("levels", DEEP)
@pytest.mark.parametrize(
    ("path", "key"),
    [
        ("/scheduler/filter", "Error"),
        ("/scheduler/prioritize", "Error"),
        ("/scheduler/bind", "Error"),
        ("/webhook/mutate", "error"),
    ],
)
def test_extender_and_webhook_refuse_deep_bodies_with_a_400(
    path: str, key: str, levels: int
) -> None:
    inner = deep_body(levels)
    # The deep part where a real body carries its pod, so the rest of the body is well formed.
    if path == "/webhook/mutate":
        body = json.dumps(admission_review({"spec": "X"})).replace('"X"', inner)
    elif path == "/scheduler/bind":
        body = '{"PodName": "p", "PodNamespace": "default", "PodUID": "u", "Node": ' + inner + "}"
    else:
        body = '{"Pod": ' + inner + ', "NodeNames": ["n1"]}'
    before = ledger_state()
    response = Client().post(path, data=body, content_type="application/json")
    assert response.status_code == 400, response.content
    assert f"nested deeper than {MAX_JSON_DEPTH} levels" in response.json()[key]
    assert ledger_state() == before


@pytest.mark.django_db
def test_a_real_review_and_filter_pass_the_limit() -> None:
    make_node("n1", cards=1)
    pod = fixture_pod()
    review = Client().post(
        "/webhook/mutate", data=admission_review(pod), content_type="application/json"
    )
    assert review.status_code == 200, review.content
    args = {"Pod": pod, "NodeNames": ["n1"]}
    filtered = Client().post("/scheduler/filter", data=args, content_type="application/json")
    assert filtered.status_code == 200 and filtered.json()["Error"] == ""
    inventory = token_client("n1", Role.NODE).put(
        "/api/v1/nodes/n1/inventory",
        data={"plugin_version": "x", "cards": [card_json("GPU-n1-0")]},
        format="json",
    )
    assert inventory.status_code == 200, inventory.content
