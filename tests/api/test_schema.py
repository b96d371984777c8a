"""The OpenAPI schema documents the refusals and the constraints, not only the happy answers."""

from __future__ import annotations

import re
from io import StringIO
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from django.core.management import call_command
from rest_framework.exceptions import ValidationError
from rest_framework.fields import CharField, ListField

from controlplane.access.roles import Role
from controlplane.api.serializers import CardReportSerializer, InventoryReportSerializer
from controlplane.dashboard.serializers import (
    CordonSerializer,
    QuotaLimitsSerializer,
    QuotaSerializer,
)
from controlplane.extender.api_views import AllocatedSerializer
from controlplane.ledger import validation as v
from tests.builders import token_client

pytestmark = pytest.mark.django_db

WRITES = {"post", "put", "patch"}
METHODS = WRITES | {"get", "delete"}
NAME_PARAMETERS = {
    "namespace": (v.NAMESPACE_PATTERN, v.MAX_LABEL),
    "name": (v.NODE_NAME_PATTERN, v.MAX_SUBDOMAIN),
    "uuid": (v.CARD_UUID_PATTERN, v.MAX_CARD_UUID),
    "container": (v.CONTAINER_PATTERN, v.MAX_LABEL),
}


@pytest.fixture
def schema() -> dict[str, Any]:
    response = token_client("vera", Role.VIEWER).get("/api/schema/", {"format": "json"})
    assert response.status_code == 200
    return response.json()


def operations(schema: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    return [
        (path, method, op)
        for path, item in schema["paths"].items()
        for method, op in item.items()
        if method in METHODS
    ]


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref") or (node.get("allOf") or [{}])[0].get("$ref")
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else node


def test_every_operation_lists_its_error_answers_with_the_error_body(schema: dict) -> None:
    ops = operations(schema)
    assert len(ops) >= 20  # every REST operation, the node plugins' ones included
    error = {"$ref": "#/components/schemas/Error"}
    for path, method, op in ops:
        expected = {"400", "401", "403"}
        parameters = {p["name"] for p in op.get("parameters", [])}
        if "{" in path or "page" in parameters:  # object routes; lists: a page past the end
            expected.add("404")
        if method in WRITES:
            expected |= {"413", "415"}
        where = f"{method.upper()} {path}"
        assert expected <= set(op["responses"]), (where, sorted(op["responses"]))
        assert any(code.startswith("2") for code in op["responses"]), where
        for code, answer in op["responses"].items():
            if code >= "400":
                assert answer["content"]["application/json"]["schema"] == error, (where, code)
                assert answer["description"], (where, code)
    body = schema["components"]["schemas"]["Error"]
    assert body["required"] == ["error"] and set(body["properties"]) == {"error", "fields"}


@pytest.mark.parametrize(
    ("path", "method"),
    [
        ("/api/v1/quotas/", "post"),
        ("/api/v1/nodes/{name}/inventory", "put"),
        ("/api/v1/allocations/{pod_uid}/containers/{container}/allocated", "post"),
    ],
)
def test_conflicts_are_documented_where_they_happen(schema: dict, path: str, method: str) -> None:
    assert "409" in schema["paths"][path][method]["responses"]


def test_path_names_carry_the_rule_they_are_checked_with(schema: dict) -> None:
    seen = set()
    for path, method, op in operations(schema):
        for parameter in op.get("parameters", []):
            if parameter["in"] != "path":
                continue
            schema_ = parameter["schema"]
            assert schema_.get("maxLength"), (method, path, parameter)
            if parameter["name"] in NAME_PARAMETERS:
                pattern, max_length = NAME_PARAMETERS[parameter["name"]]
                assert schema_["pattern"] == pattern, (method, path, parameter)
                assert schema_["maxLength"] == max_length
                seen.add(parameter["name"])
    assert seen == set(NAME_PARAMETERS)


def test_the_documented_patterns_are_whole_string_rules() -> None:
    for pattern, _ in NAME_PARAMETERS.values():
        assert pattern.startswith("^") and pattern.endswith("$")
        body = re.compile(pattern[1:-1])
        assert body.fullmatch("team-a") and not body.fullmatch("team-a\n")


def request_components(schema: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for _, _, op in operations(schema):
        content = op.get("requestBody", {}).get("content", {}).get("application/json")
        if content:
            ref = content["schema"]["$ref"].rsplit("/", 1)[1]
            out[ref] = schema["components"]["schemas"][ref]
    return out


def test_request_bodies_carry_their_constraints(schema: dict) -> None:
    bodies = request_components(schema)
    assert {"Quota", "QuotaLimits", "Cordon", "InventoryReport", "Allocated"} <= set(bodies)
    components = schema["components"]["schemas"]
    bodies["CardReport"] = components["CardReport"]  # inside InventoryReport
    for name, body in bodies.items():
        assert body["additionalProperties"] is False, name  # unknown keys are refused
        for field, prop in body["properties"].items():
            if prop.get("readOnly"):
                continue
            prop = resolve(schema, prop)
            if prop.get("type") == "integer":
                assert "minimum" in prop and "maximum" in prop, (name, field)
            if prop.get("type") == "string":  # bounded by a length or a list of values
                assert prop.get("maxLength") or prop.get("enum"), (name, field)
            if prop.get("type") == "array":
                assert prop.get("maxItems") and resolve(schema, prop["items"]), (name, field)
    for component in ("Quota", "QuotaLimits", "PatchedQuotaLimits"):
        assert components[component]["properties"]["namespace"]["pattern"] == v.NAMESPACE_PATTERN
    assert components["CardReport"]["properties"]["uuid"]["pattern"] == v.CARD_UUID_PATTERN


def test_query_numbers_carry_their_bounds(schema: dict) -> None:
    for path in ["/api/v1/quotas/", "/api/v1/nodes/", "/api/v1/bindings/"]:
        params = {p["name"]: p["schema"] for p in schema["paths"][path]["get"]["parameters"]}
        assert params["page"]["minimum"] == 1
        assert (params["page_size"]["minimum"], params["page_size"]["maximum"]) == (1, 500)


def test_the_schema_generates_without_warnings_and_validates(tmp_path: Path) -> None:
    out = tmp_path / "schema.yaml"
    call_command(
        "spectacular", "--fail-on-warn", "--validate", "--file", str(out), stderr=StringIO()
    )
    assert out.stat().st_size > 0


# Each request body's serializer, by the component the schema names it with.
BODY_SERIALIZERS = {
    "Quota": QuotaSerializer,
    "QuotaLimits": QuotaLimitsSerializer,
    "PatchedQuotaLimits": QuotaLimitsSerializer,
    "Cordon": CordonSerializer,
    "InventoryReport": InventoryReportSerializer,
    "CardReport": CardReportSerializer,
    "Allocated": AllocatedSerializer,
}
STRINGS = ["", "\x00", "a\x00b", " ", " GPU ", "GPU-0", "\n", "x" * 500, "x" * 501]


def string_fields(schema: dict[str, Any]) -> list[tuple[str, str, Any, dict[str, Any]]]:
    """(component, field, serializer field, its string schema) of every body string, list items
    included."""
    components = schema["components"]["schemas"]
    out = []
    for component, serializer in BODY_SERIALIZERS.items():
        for name, field in serializer().fields.items():
            prop = components[component]["properties"].get(name)
            if field.read_only or prop is None:
                continue
            if isinstance(field, ListField):
                field, prop = field.child, prop["items"]
            if isinstance(field, CharField):
                out.append((component, name, field, prop))
    return out


def test_a_body_string_is_valid_by_the_schema_exactly_when_its_field_takes_it(
    schema: dict,
) -> None:
    fields = string_fields(schema)
    assert {(c, n) for c, n, _, _ in fields} >= {
        ("Cordon", "reason"),
        ("CardReport", "model"),
        ("InventoryReport", "plugin_version"),
        ("Allocated", "devices"),
        ("Quota", "namespace"),
    }
    for component, name, field, prop in fields:
        for value in STRINGS:
            by_schema = jsonschema.Draft4Validator(prop).is_valid(value)
            try:
                field.run_validation(value)
                by_field = True
            except ValidationError:
                by_field = False
            assert by_schema == by_field, (component, name, value, prop)


def walk(schema: dict[str, Any], node: dict[str, Any], pointer: str) -> dict[str, Any]:
    """The schema of what `pointer` (`/results/0/name`) names in a value of schema `node`."""
    for segment in pointer.strip("/").split("/"):
        node = resolve(schema, node)
        node = node["items"] if segment.isdigit() else node["properties"][segment]
    return resolve(schema, node)


def test_links_lead_from_an_answer_to_the_operations_that_take_its_names(schema: dict) -> None:
    by_id = {op["operationId"]: (path, op) for path, _, op in operations(schema)}
    followed = set()
    for path, method, op in operations(schema):
        for answer in op["responses"].values():
            for name, link in answer.get("links", {}).items():
                target_path, target = by_id[link["operationId"]]
                taken = {p["name"] for p in target["parameters"] if p["in"] == "path"}
                assert set(link["parameters"]) == taken, (method, path, name)
                body = answer["content"]["application/json"]["schema"]
                for parameter, expression in link["parameters"].items():
                    assert expression.startswith("$response.body#/")
                    named = walk(schema, body, expression.removeprefix("$response.body#"))
                    assert named["type"] == "string", (method, path, name, parameter)
                followed.add((method.upper(), path, target_path))
    assert ("GET", "/api/v1/nodes/", "/api/v1/nodes/{name}/") in followed
    assert ("POST", "/api/v1/quotas/", "/api/v1/quotas/{namespace}/") in followed
    assert (
        "GET",
        "/api/v1/bindings/",
        "/api/v1/allocations/{pod_uid}/containers/{container}/allocated",
    ) in followed


def test_examples_are_valid_by_the_schema_they_illustrate(schema: dict) -> None:
    bodies, illustrated = set(), set()
    for path, method, op in operations(schema):
        for parameter in op.get("parameters", []):
            if parameter["in"] == "path":
                assert jsonschema.Draft4Validator(parameter["schema"]).is_valid(
                    parameter["example"]
                ), (method, path, parameter)
        content = op.get("requestBody", {}).get("content", {}).get("application/json", {})
        if content:
            bodies.add((method, path))
        for example in content.get("examples", {}).values():
            body = {**resolve(schema, content["schema"]), "components": schema["components"]}
            read_only = {k for k, prop in body["properties"].items() if prop.get("readOnly")}
            body["required"] = [k for k in body.get("required", []) if k not in read_only]
            errors = list(jsonschema.Draft4Validator(body).iter_errors(example["value"]))
            assert not errors, (method, path, errors)
            illustrated.add((method, path))
    assert bodies == illustrated and len(bodies) == 11  # every request body has an example
