"""Name rules shared by the API, the commands and the services (Kubernetes naming)."""

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
