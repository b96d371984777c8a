"""Strict JSON: a machine interface takes the shapes and types it documents, not look-alikes.

DRF's stock fields accept "12" for an integer and "yes" for a boolean, trim the whitespace around
a string before they measure it, and its serializers drop keys they do not know and read-only
fields without a word; a body that sends those is wrong, and saying so early beats storing a
guess. `StrictSerializer` is the base of every serializer that
reads a request body.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from django.core.validators import RegexValidator
from rest_framework import serializers
from rest_framework.settings import api_settings

from controlplane.scheduling import FACTOR_PATTERN


class StrictIntegerField(serializers.IntegerField):
    default_error_messages = {"invalid": "Must be a JSON integer (not a string, float or bool)."}

    def to_internal_value(self, data: Any) -> int:
        if isinstance(data, bool) or not isinstance(data, int):
            self.fail("invalid")
        return super().to_internal_value(data)  # type: ignore[no-any-return]


class StrictBooleanField(serializers.BooleanField):
    default_error_messages = {"invalid": "Must be a JSON boolean: true or false."}

    def to_internal_value(self, data: Any) -> bool:
        if not isinstance(data, bool):
            self.fail("invalid")
        return data


class StrictCharField(serializers.CharField):
    """A string taken exactly as sent: trimmed, a 501-character reason would pass a 500-character
    limit and be stored as another string than the caller's."""

    default_error_messages = {"invalid": "Must be a JSON string."}

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("trim_whitespace", False)
        super().__init__(**kwargs)

    def to_internal_value(self, data: Any) -> str:
        if not isinstance(data, str):
            self.fail("invalid")
        return super().to_internal_value(data)  # type: ignore[no-any-return]


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else type(value).__name__


class StrictSerializer(serializers.Serializer):
    """A request body's serializer: a JSON object whose every key is a field the caller may
    send. Unknown keys (a typo such as `gpu_mem` must not silently mean "unlimited") and
    read-only fields (`usage` is the server's to compute) are refused with a 400 naming each."""

    def run_validation(self, data: Any = serializers.empty) -> Any:
        if data is not serializers.empty and not isinstance(data, Mapping):
            message = f"Must be a JSON object, not {_json_kind(data)}."
            raise serializers.ValidationError({api_settings.NON_FIELD_ERRORS_KEY: [message]})
        return super().run_validation(data)

    def to_internal_value(self, data: Any) -> Any:
        writable = sorted(name for name, field in self.fields.items() if not field.read_only)
        refused = {}
        for key in data:
            if key in writable:
                continue
            if key in self.fields:
                refused[str(key)] = "Read-only: the server fills it in; leave it out."
            else:
                refused[str(key)] = f"Unknown field; expected only {', '.join(writable)}."
        if refused:
            raise serializers.ValidationError(refused)
        return super().to_internal_value(data)


class FactorField(StrictCharField):
    """An oversubscription factor (docs/virtual-memory.md): a JSON string holding a decimal from
    "1" to "16" with at most two decimal places (`parse_factor` turns it into hundredths). The
    pattern is the core's, so the schema says exactly what the field takes."""

    def __init__(self, **kwargs: Any) -> None:
        kwargs.setdefault("max_length", 5)
        super().__init__(**kwargs)
        self.validators.append(
            RegexValidator(
                FACTOR_PATTERN,
                'Must be a decimal from "1" to "16" with at most two decimal places, such as '
                '"1.5".',
            )
        )
