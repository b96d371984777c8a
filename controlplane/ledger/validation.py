"""The one home of the name and number rules every entry point checks input against.

Kubernetes names (namespaces, nodes, pods, containers), card UUIDs and whole numbers in query
strings: the REST serializers and views, the extender's wire parser, the dashboard's forms, the
services and the management commands all ask these functions, so a name one of them accepts
cannot be refused by another (or the other way round).

Every rule matches the whole string (`re.fullmatch`): with `re.match` and `$`, a name with a
trailing newline passes (`$` also matches before a final `\\n`), and `team-a\\n` became a quota
(or a node) that lists exactly like `team-a` beside it. The patterns are ASCII only, so look-alike
letters from other scripts never pass. `*_PATTERN` are the same rules for the OpenAPI schema
(ECMA regular expressions, where `$` is the end of the string).
"""

from __future__ import annotations

import re

# RFC 1123 label: what Kubernetes accepts as a namespace or container name.
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
# RFC 1123 subdomain: what Kubernetes accepts as a node or pod name.
_SUBDOMAIN = rf"{_LABEL}(\.{_LABEL})*"
# An NVML UUID as the node plugin reports it (GPU-8f3c..., MIG-...).
_CARD_UUID = r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}"

_DNS_LABEL = re.compile(_LABEL)
_DNS_SUBDOMAIN = re.compile(_SUBDOMAIN)
_CARD_UUID_RE = re.compile(_CARD_UUID)

MAX_LABEL = 63
MAX_SUBDOMAIN = 253
MAX_CARD_UUID = 64

NAMESPACE_PATTERN = f"^{_LABEL}$"
CONTAINER_PATTERN = NAMESPACE_PATTERN
NODE_NAME_PATTERN = f"^{_SUBDOMAIN}$"
POD_NAME_PATTERN = NODE_NAME_PATTERN
CARD_UUID_PATTERN = f"^{_CARD_UUID}$"

NODE_NAME_HELP = (
    "a node name is a DNS subdomain: at most 253 lower-case letters, digits, '-' and '.', "
    "starting and ending with a letter or digit"
)
POD_NAME_HELP = NODE_NAME_HELP.replace("a node name", "a pod name")
NAMESPACE_HELP = (
    "a namespace is a DNS label: at most 63 lower-case letters, digits and '-', "
    "starting and ending with a letter or digit"
)
CONTAINER_HELP = NAMESPACE_HELP.replace("a namespace", "a container name")
CARD_UUID_HELP = (
    "a card UUID is the NVML UUID (e.g. GPU-8f3c...): at most 64 letters, digits and '-_.:', "
    "starting with a letter or digit"
)

# Whole numbers in query strings: 18 digits hold any page a database can have and stay far
# below int()'s 4,300-digit refusal.
MAX_NUMBER_DIGITS = 18


def _is_label(value: object) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_LABEL
        and _DNS_LABEL.fullmatch(value) is not None
    )


def _is_subdomain(value: object) -> bool:
    return (
        isinstance(value, str)
        and 0 < len(value) <= MAX_SUBDOMAIN
        and _DNS_SUBDOMAIN.fullmatch(value) is not None
    )


def is_namespace(value: object) -> bool:
    return _is_label(value)


def is_container_name(value: object) -> bool:
    return _is_label(value)


def is_node_name(value: object) -> bool:
    return _is_subdomain(value)


def is_pod_name(value: object) -> bool:
    return _is_subdomain(value)


def is_card_uuid(value: object) -> bool:
    return isinstance(value, str) and _CARD_UUID_RE.fullmatch(value) is not None


def whole_number(raw: str, max_digits: int = MAX_NUMBER_DIGITS) -> int | None:
    """`raw` as a whole number when it is 1 to `max_digits` ASCII digits, else None.

    `str.isdigit()` is no test for `int()`: it is true for '²' and '٣' ('²' then makes `int`
    raise, '٣' reads as 3), and `int()` itself takes '+1', ' 1', '1_000' and refuses more than
    4,300 digits.
    """
    if 0 < len(raw) <= max_digits and raw.isascii() and raw.isdigit():
        return int(raw)
    return None
