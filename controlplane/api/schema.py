"""The OpenAPI schema says what the API refuses, not only what it answers when all goes well.

`AutoSchema` (settings: DEFAULT_SCHEMA_CLASS) adds to every operation the error answers the
API gives, each with the one error body (`Error`, see `controlplane.api.errors`): 400 (bad
input, naming the field), 401 (no or bad credentials), 403 (role), 404 on object routes and on
paginated lists (a page past the end), 413 and 415 on writes (body too large, not JSON). A view
documents a 409 where it can conflict (`conflict()`). Path parameters get the pattern and length
of the name rule they are checked against (`controlplane.ledger.validation`); body fields carry
theirs through their field classes, and every request body refuses keys it does not list
(`additionalProperties: false`, as `StrictSerializer` does). A body's string says what its field
refuses besides its length: an empty string where blank is refused (`minLength: 1`), U+0000
where DRF refuses it (a pattern without it; PostgreSQL cannot store the character).

Answers that name objects link to the operations that take those names (OpenAPI links, `LINKS`,
added by `add_links` after generation): a client, or a stateful test, can walk from a list to its
objects and from a report to what it created. Path parameters carry an example from one small
cluster (`EXAMPLE`), and so do the request bodies that the views document with examples.
"""

from __future__ import annotations

from typing import Any

from django.core.validators import ProhibitNullCharactersValidator
from drf_spectacular import openapi
from drf_spectacular.extensions import OpenApiSerializerExtension
from drf_spectacular.utils import OpenApiResponse
from rest_framework import serializers

from controlplane.ledger import validation as v


class ErrorSerializer(serializers.Serializer):
    """Every error answer of the API."""

    error = serializers.CharField(help_text="What went wrong and how to fix it, in one sentence.")
    fields = serializers.DictField(
        child=serializers.CharField(),
        required=False,
        help_text="Each field, path or query parameter at fault (`body`: the body as a whole), "
        "with what is wrong with it. Present on 400s.",
    )


def _name(pattern: str, max_length: int, description: str) -> dict[str, Any]:
    return {
        "type": "string",
        "pattern": pattern,
        "minLength": 1,
        "maxLength": max_length,
        "description": description,
    }


# Path parameter name -> its schema: the rule the views check it with (controlplane.api.names).
PATH_PARAMETERS: dict[str, dict[str, Any]] = {
    "namespace": _name(v.NAMESPACE_PATTERN, v.MAX_LABEL, "Kubernetes namespace (DNS label)."),
    "name": _name(
        v.NODE_NAME_PATTERN, v.MAX_SUBDOMAIN, "Node or pod name (DNS subdomain), as the route says."
    ),
    "uuid": _name(v.CARD_UUID_PATTERN, v.MAX_CARD_UUID, "The card's NVML UUID."),
    "container": _name(v.CONTAINER_PATTERN, v.MAX_LABEL, "Container name (DNS label)."),
    "pod_uid": {"type": "string", "minLength": 1, "maxLength": 64, "description": "Pod UID."},
}

ERRORS = {
    400: "Bad input; nothing changed. `fields` names each field, path or query parameter at fault.",
    401: "No credentials, or a token that is unknown, revoked or malformed.",
    403: "The caller's role may not do this.",
    404: "Not found: no such object, or a page past the last one.",
    413: "The body is over the size limit.",
    415: "The body is not JSON: send Content-Type: application/json.",
}
WRITES = {"POST", "PUT", "PATCH"}
NO_NUL = "^[^\\u0000]*$"


# One small cluster that the examples describe, end to end: node gpu-node-1 holds the card, and
# pod team-a/train-0 (container trainer) is bound to it. tests/api/test_schemathesis.py builds it.
EXAMPLE = {
    "node": "gpu-node-1",
    "card": "GPU-8f3c2d1e-5b7a-4c9e-9f0d-1a2b3c4d5e6f",
    "namespace": "team-a",
    "pod": "train-0",
    "pod_uid": "7a1e6c52-3d0b-4f6e-9a8c-2b1d4e5f6a7b",
    "container": "trainer",
}
KINDS = {"namespace": "namespace", "uuid": "card", "pod_uid": "pod_uid", "container": "container"}


def parameter_kind(parameter: str, path: str) -> str:
    """What a path parameter names, as an EXAMPLE key: `name` is a pod after a namespace, else a
    node."""
    if parameter == "name":
        return "pod" if "{namespace}/{name}" in path else "node"
    return KINDS[parameter]


def conflict(description: str) -> OpenApiResponse:
    """A documented 409 answer, with the error body."""
    return OpenApiResponse(ErrorSerializer, description=description)


class AutoSchema(openapi.AutoSchema):
    def get_operation(
        self, path: str, path_regex: str, path_prefix: str, method: str, registry: Any
    ) -> dict[str, Any] | None:
        operation = super().get_operation(path, path_regex, path_prefix, method, registry)
        if operation is None:
            return None
        has_path_parameters = False
        for parameter in operation.get("parameters", []):
            if parameter["in"] == "path":
                has_path_parameters = True
                rule = PATH_PARAMETERS.get(parameter["name"], {})
                parameter["schema"] = {**parameter["schema"], **rule}
                parameter["example"] = EXAMPLE[parameter_kind(parameter["name"], path)]
        codes = [400, 401, 403]
        paginated = self.method == "GET" and getattr(self.view, "pagination_class", None)
        if has_path_parameters or paginated:
            codes.append(404)
        if self.method in WRITES:
            codes += [413, 415]
        error = self.resolve_serializer(ErrorSerializer, "response").ref
        responses = operation.setdefault("responses", {})
        for code in codes:
            responses.setdefault(
                str(code),
                {"description": ERRORS[code], "content": {"application/json": {"schema": error}}},
            )
        operation["responses"] = dict(sorted(responses.items()))
        return operation


class StrictSerializerScheme(OpenApiSerializerExtension):
    """A StrictSerializer's object takes no keys but its own, and its lists say their bounds."""

    target_class = "controlplane.api.fields.StrictSerializer"
    match_subclasses = True

    def map_serializer(self, auto_schema: Any, direction: Any) -> dict[str, Any]:
        schema: dict[str, Any] = auto_schema._map_serializer(
            self.target, direction, bypass_extensions=True
        )
        schema["additionalProperties"] = False
        for name, field in self.target.fields.items():
            prop = schema["properties"].get(name)
            if prop is None or field.read_only:
                continue
            if isinstance(field, serializers.ListSerializer):  # drf-spectacular drops the bounds
                bounds = {"minItems": field.min_length, "maxItems": field.max_length}
                prop.update({k: n for k, n in bounds.items() if n})
            if isinstance(field, serializers.ListField):
                field, prop = field.child, prop.get("items", {})
            _string_rules(field, prop)
        return schema


def _string_rules(field: serializers.Field, prop: dict[str, Any]) -> None:
    """What a body's CharField refuses besides its length, where its schema does not say it yet."""
    if not isinstance(field, serializers.CharField) or prop.get("type") != "string":
        return
    if not field.allow_blank:
        prop.setdefault("minLength", 1)
    refuses_nul = any(isinstance(v, ProhibitNullCharactersValidator) for v in field.validators)
    if refuses_nul and "pattern" not in prop:
        prop["pattern"] = NO_NUL


# (method, path, status of the answer) -> the names it gives, each as {path parameter of the
# target: JSON pointer into the answer}; each becomes a link to every operation whose path
# parameters are exactly those.
LINKS: dict[tuple[str, str, str], list[dict[str, str]]] = {
    ("GET", "/api/v1/quotas/", "200"): [{"namespace": "/results/0/namespace"}],
    ("POST", "/api/v1/quotas/", "201"): [{"namespace": "/namespace"}],
    ("PUT", "/api/v1/quotas/{namespace}/", "201"): [{"namespace": "/namespace"}],
    ("GET", "/api/v1/nodes/", "200"): [
        {"name": "/results/0/name"},
        {"uuid": "/results/0/cards/0/uuid"},
    ],
    ("GET", "/api/v1/nodes/{name}/", "200"): [{"uuid": "/cards/0/uuid"}],
    ("PUT", "/api/v1/nodes/{name}/inventory", "201"): [
        {"name": "/node"},
        {"uuid": "/cards_added/0"},
    ],
    ("GET", "/api/v1/cards/", "200"): [{"uuid": "/results/0/uuid"}, {"name": "/results/0/node"}],
    ("GET", "/api/v1/cards/{uuid}/", "200"): [
        {"name": "/node"},
        {"namespace": "/slices/0/namespace", "name": "/slices/0/pod"},
        {"pod_uid": "/slices/0/pod_uid", "container": "/slices/0/container"},
    ],
    ("GET", "/api/v1/slices/", "200"): [
        {"namespace": "/results/0/namespace", "name": "/results/0/pod"},
        {"pod_uid": "/results/0/pod_uid", "container": "/results/0/container"},
        {"uuid": "/results/0/card"},
    ],
    ("GET", "/api/v1/bindings/", "200"): [
        {"namespace": "/results/0/namespace", "name": "/results/0/name"},
        {"pod_uid": "/results/0/pod_uid", "container": "/results/0/slices/0/container"},
    ],
}


def _path_parameters(operation: dict[str, Any]) -> frozenset[str]:
    return frozenset(p["name"] for p in operation.get("parameters", []) if p["in"] == "path")


def add_links(result: dict[str, Any], **kwargs: Any) -> dict[str, Any]:
    """Postprocessing hook (settings: SPECTACULAR_SETTINGS): the `LINKS` as OpenAPI links. A link
    whose answer or target is missing is an error here, not a dangling link in the schema."""
    operations = {
        (method.upper(), path): operation
        for path, item in result["paths"].items()
        for method, operation in item.items()
        if isinstance(operation, dict) and "operationId" in operation
    }
    for (method, path, status), names in LINKS.items():
        links = operations[(method, path)]["responses"][status].setdefault("links", {})
        for parameters in names:
            _link(links, operations, (method, path), parameters)
    return result


def _link(
    links: dict[str, Any],
    operations: dict[tuple[str, str], dict[str, Any]],
    source: tuple[str, str],
    parameters: dict[str, str],
) -> None:
    targets = [
        target
        for key, target in sorted(operations.items())
        if key != source and _path_parameters(target) == frozenset(parameters)
    ]
    if not targets:
        raise ValueError(f"no operation takes exactly {sorted(parameters)}")
    for target in targets:
        name = target["operationId"]
        if name in links:
            raise ValueError(f"{source} links to {name} twice")
        links[name] = {
            "operationId": name,
            "parameters": {p: f"$response.body#{pointer}" for p, pointer in parameters.items()},
        }
