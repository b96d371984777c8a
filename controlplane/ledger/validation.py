"""Name and number rules shared by the API, the commands and the services."""

from __future__ import annotations

import re

# RFC 1123 subdomain: what Kubernetes accepts as a node name.
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# RFC 1123 label: what Kubernetes accepts as a namespace name.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

NODE_NAME_HELP = (
    "a node name is a DNS subdomain: at most 253 lower-case letters, digits, '-' and '.', "
    "starting and ending with a letter or digit"
)
NAMESPACE_HELP = (
    "a namespace is a DNS label: at most 63 lower-case letters, digits and '-', "
    "starting and ending with a letter or digit"
)


def is_node_name(value: str) -> bool:
    return 0 < len(value) <= 253 and bool(_DNS_SUBDOMAIN.match(value))


def is_namespace(value: str) -> bool:
    return 0 < len(value) <= 63 and bool(_DNS_LABEL.match(value))


# Whole numbers in query strings: 18 digits hold any page a database can have and stay far
# below int()'s 4,300-digit refusal.
MAX_NUMBER_DIGITS = 18


def whole_number(raw: str, max_digits: int = MAX_NUMBER_DIGITS) -> int | None:
    """`raw` as a whole number when it is 1 to `max_digits` ASCII digits, else None.

    `str.isdigit()` is no test for `int()`: it is true for '²' and '٣' ('²' then makes `int`
    raise, '٣' reads as 3), and `int()` itself takes '+1', ' 1', '1_000' and refuses more than
    4,300 digits.
    """
    if 0 < len(raw) <= max_digits and raw.isascii() and raw.isdigit():
        return int(raw)
    return None
