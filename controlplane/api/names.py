"""Names at the REST boundary: body fields and path parameters, by the validation module's rules.

A name is taken exactly as sent: no trimming, so `"team-a\\n"` or `"team-a "` is refused with a
400 naming the field rather than quietly read as another string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from drf_spectacular.utils import extend_schema_field
from rest_framework.exceptions import ValidationError

from controlplane.api.fields import StrictCharField
from controlplane.ledger import validation as v

# kind -> (rule, what it is called, what a valid one looks like)
RULES: dict[str, tuple[Callable[[object], bool], str, str]] = {
    "namespace": (v.is_namespace, "namespace name", v.NAMESPACE_HELP),
    "node": (v.is_node_name, "node name", v.NODE_NAME_HELP),
    "pod": (v.is_pod_name, "pod name", v.POD_NAME_HELP),
    "container": (v.is_container_name, "container name", v.CONTAINER_HELP),
    "card": (v.is_card_uuid, "card UUID", v.CARD_UUID_HELP),
}


def refusal(kind: str, value: object) -> str | None:
    """Why `value` is no valid `kind` name, or None when it is one."""
    rule, called, help_text = RULES[kind]
    if rule(value):
        return None
    return f"{value!r} is not a valid {called}: {help_text}"


def check_path(**names: tuple[str, str]) -> None:
    """400 naming every path parameter that breaks its rule: `check_path(name=("node", x))`."""
    errors = {}
    for field, (kind, value) in names.items():
        reason = refusal(kind, value)
        if reason is not None:
            errors[field] = reason
    if errors:
        raise ValidationError(errors)


class _NameField(StrictCharField):
    kind = ""
    max_chars = 0

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", self.max_chars)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        value = super().to_internal_value(data)
        reason = refusal(self.kind, value)
        if reason is not None:
            raise ValidationError(reason)
        return value


def _schema(pattern: str, max_length: int) -> dict[str, Any]:
    return {"type": "string", "pattern": pattern, "minLength": 1, "maxLength": max_length}


@extend_schema_field(_schema(v.NAMESPACE_PATTERN, v.MAX_LABEL))
class NamespaceField(_NameField):
    """A Kubernetes namespace (DNS label)."""

    kind = "namespace"
    max_chars = v.MAX_LABEL


@extend_schema_field(_schema(v.CARD_UUID_PATTERN, v.MAX_CARD_UUID))
class CardUUIDField(_NameField):
    """A card's NVML UUID."""

    kind = "card"
    max_chars = v.MAX_CARD_UUID


@extend_schema_field(_schema(v.POD_NAME_PATTERN, v.MAX_SUBDOMAIN))
class PodNameField(_NameField):
    """A pod's name (DNS subdomain)."""

    kind = "pod"
    max_chars = v.MAX_SUBDOMAIN


@extend_schema_field(_schema(v.CONTAINER_PATTERN, v.MAX_LABEL))
class ContainerNameField(_NameField):
    """A container's name (DNS label)."""

    kind = "container"
    max_chars = v.MAX_LABEL
