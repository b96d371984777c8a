"""Node plugins in a cluster authenticate with their projected ServiceAccount token.

The control plane asks the API server (TokenReview, audience `tessera`) who the token belongs
to. It is accepted as a node identity only when it is the token of a configured node-plugin
ServiceAccount (`TESSERA_NODE_SERVICE_ACCOUNTS`, e.g. `tessera-system:tessera-nodeplugin`) and
the API server vouches for the node the pod runs on (the `authentication.kubernetes.io/node-name`
extra of bound tokens, Kubernetes >= 1.30): so a node plugin can report only its own node, and
no pod owner can pass for one. Outside a cluster, `createtoken <node> --role node` tokens serve.

Successful reviews are cached per process for `TOKEN_REVIEW_CACHE_S` (60 s): an accelerator
only; a revoked token stops working within that time.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from django.conf import settings
from django.contrib.auth import get_user_model
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from controlplane.access.models import TOKEN_PREFIX, digest
from controlplane.access.roles import Role, role_of
from controlplane.access.services import grant_role
from controlplane.kube import adapter
from controlplane.kube.base import KubeError
from controlplane.ledger.validation import is_node_name

AUDIENCE = "tessera"
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
TOKEN_REVIEW_CACHE_S = 60.0

_cache: dict[str, tuple[float, str]] = {}
_cache_lock = threading.Lock()


def allowed_service_accounts() -> set[str]:
    """`system:serviceaccount:<ns>:<name>` usernames of the node plugin's ServiceAccounts."""
    raw = settings.TESSERA.get("NODE_SERVICE_ACCOUNTS", "")
    return {
        f"system:serviceaccount:{item.strip()}" for item in raw.split(",") if ":" in item.strip()
    }


def node_of_review(status: dict[str, Any]) -> str:
    """The node a reviewed token speaks for; raises AuthenticationFailed saying why not."""
    if not status.get("authenticated"):
        reason = status.get("error") or "the API server does not know this token"
        raise exceptions.AuthenticationFailed(f"Invalid token: {reason}.")
    user = status.get("user") or {}
    username = str(user.get("username", ""))
    if username not in allowed_service_accounts():
        raise exceptions.AuthenticationFailed(
            f"{username or 'this identity'} is not a Tessera node plugin ServiceAccount."
        )
    nodes = (user.get("extra") or {}).get(NODE_NAME_EXTRA) or []
    if len(nodes) != 1 or not is_node_name(str(nodes[0])):
        raise exceptions.AuthenticationFailed(
            "The token is not bound to a node (Kubernetes >= 1.30 adds the node name to "
            "projected ServiceAccount tokens); mount a projected token with audience 'tessera'."
        )
    return str(nodes[0])


class ServiceAccountTokenAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer <projected ServiceAccount token>` -> the node's identity."""

    def authenticate(self, request: Request) -> tuple[Any, None] | None:
        header = authentication.get_authorization_header(request).decode("latin-1").split()
        if len(header) != 2 or header[0].lower() != "bearer" or header[1].startswith(TOKEN_PREFIX):
            return None
        if settings.TESSERA["KUBE_MODE"] == "embedded" or not allowed_service_accounts():
            raise exceptions.AuthenticationFailed("Invalid, revoked or expired token.")
        node = self._review(header[1])
        return _node_user(node), None

    def _review(self, token: str) -> str:
        key, now = digest(token), time.monotonic()
        with _cache_lock:
            hit = _cache.get(key)
            if hit and hit[0] > now:
                return hit[1]
        try:
            status = adapter.get_kube().review_token(token, [AUDIENCE])  # type: ignore[attr-defined]
        except KubeError as exc:
            raise exceptions.AuthenticationFailed(
                f"Cannot check the token with the API server: {exc.message}"
            ) from None
        node = node_of_review(status)
        with _cache_lock:
            if len(_cache) > 10_000:
                _cache.clear()
            _cache[key] = (now + TOKEN_REVIEW_CACHE_S, node)
        return node

    def authenticate_header(self, request: Request) -> str:
        return "Bearer"


def _node_user(node: str) -> Any:
    user = get_user_model().objects.filter(username=node).first()
    if user is None:
        return grant_role(node, Role.NODE)
    if role_of(user) is not Role.NODE:
        # Never turn a person's account into a machine identity (or the reverse).
        raise exceptions.AuthenticationFailed(
            f"The user {node!r} exists and is not a node identity; rename it to let node "
            f"{node}'s plugin authenticate."
        )
    return user


def clear_cache() -> None:
    with _cache_lock:
        _cache.clear()
