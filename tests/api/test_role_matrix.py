"""The role check of the schema sweep judges answers the way the docs' role table says."""

from __future__ import annotations

import pytest

from tests.api.role_matrix import (
    NONE,
    Answer,
    may_call,
    must_show,
    route_parameters,
    violation,
)

QUOTAS = ("POST", "/api/v1/quotas/")
NODE = ("GET", "/api/v1/nodes/{name}/")
INVENTORY = ("PUT", "/api/v1/nodes/{name}/inventory")
ALLOCATION = ("GET", "/api/v1/allocations/{namespace}/{name}")
ALLOCATED = ("POST", "/api/v1/allocations/{pod_uid}/containers/{container}/allocated")


def answer(role: str, status: int, body: object = None, **parameters: str) -> Answer:
    return Answer(role, status, parameters, body)


def test_the_router_reads_one_decoded_segment_per_parameter() -> None:
    url = "http://127.0.0.1:8000/api/v1/nodes/gpu-1/"
    assert route_parameters("/api/v1/nodes/{name}/", url) == {"name": "gpu-1"}
    assert route_parameters("/api/v1/nodes/{name}/", url.replace("gpu-1", "a%2Fb")) is None
    assert route_parameters("/api/v1/nodes/{name}/", url.replace("gpu-1/", "/")) is None


@pytest.mark.parametrize(
    ("operation", "seen", "problem"),
    [
        (QUOTAS, answer(NONE, 401), None),
        (QUOTAS, answer(NONE, 201), "expected 401"),
        (QUOTAS, answer("viewer", 403), None),
        (QUOTAS, answer("viewer", 201), "expected 403"),
        (QUOTAS, answer("viewer", 400), "expected 403"),  # the role check comes before the input
        (QUOTAS, answer("operator", 409), None),
        (QUOTAS, answer("operator", 403), "got 403"),
        (QUOTAS, answer("admin", 401), "refused with 401"),
        (NODE, answer("node", 403, name="n1"), None),  # a machine identity holds no human right
        (NODE, answer("node", 200, name="n1"), "expected 403"),
        (("OPTIONS", "/api/v1/nodes/{name}/cordon/"), answer("operator", 200, name="n1"), None),
        (("OPTIONS", "/api/v1/nodes/{name}/cordon/"), answer("viewer", 200, name="n1"), "403"),
        (INVENTORY, answer("node", 201, name="gpu-node-1"), None),
        (INVENTORY, answer("node", 403, name="gpu-node-1"), "refused its own node"),
        (INVENTORY, answer("node", 403, name="gpu-node-2"), None),
        (INVENTORY, answer("node", 201, name="gpu-node-2"), "for node 'gpu-node-2'"),
        (INVENTORY, answer("admin", 201, name="gpu-node-2"), None),
        (INVENTORY, answer("operator", 201, name="gpu-node-2"), "expected 403"),
        (ALLOCATION, answer("node", 200, {"node": "gpu-node-1"}), None),
        (ALLOCATION, answer("node", 200, {"node": "gpu-node-2"}), "on node 'gpu-node-2'"),
        (ALLOCATION, answer("node", 403), None),
        (ALLOCATION, answer("viewer", 200, {"node": "gpu-node-2"}), None),
        (ALLOCATED, answer("node", 404, pod_uid="uid-2"), None),
        (ALLOCATED, answer("node", 409, pod_uid="uid-2"), "a pod of another node"),
        (ALLOCATED, answer("node", 409, pod_uid="uid-1"), None),
        (ALLOCATED, answer("node", 403, pod_uid="uid-1"), "are 404s"),
        (ALLOCATED, answer("operator", 200, pod_uid="uid-1"), "expected 403"),
    ],
)
def test_an_answer_is_judged_by_the_documented_access(operation, seen, problem) -> None:
    found = violation(operation, seen, "gpu-node-1", frozenset({"uid-2"}))
    assert (found is None) if problem is None else (problem in (found or "")), found


def test_each_role_must_show_the_sides_of_each_boundary_it_has() -> None:
    assert not may_call(NONE, ("GET", "/api/v1/quotas/"))
    assert must_show("viewer", ("GET", "/api/v1/quotas/")) == (True, False)
    assert must_show("viewer", QUOTAS) == (False, True)
    assert must_show("node", INVENTORY) == (True, True)  # its own node, and another one
    assert must_show("admin", INVENTORY) == (True, False)
