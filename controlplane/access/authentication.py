"""`Authorization: Bearer <token>` authentication for the REST API.

Also `X-Tessera-Token: <token>` when there is no `Authorization` header: a client that reaches
the control plane through the Kubernetes API server's service proxy (`kubectl tessera`) cannot
send its own `Authorization`, which the API server takes for itself and does not pass on.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from django.utils import timezone
from rest_framework import authentication, exceptions
from rest_framework.request import Request

from controlplane.access.models import TOKEN_PREFIX, ApiToken, digest

# Recording last use costs a write; once a minute per token is plenty for an operator's view.
LAST_USED_RESOLUTION = timedelta(seconds=60)


# The header a client behind the API server's service proxy sends its token in (see above).
PROXY_TOKEN_HEADER = "HTTP_X_TESSERA_TOKEN"  # noqa: S105 - a header's name


class BearerTokenAuthentication(authentication.BaseAuthentication):
    keyword = "Bearer"

    def authenticate(self, request: Request) -> tuple[Any, ApiToken] | None:
        header = authentication.get_authorization_header(request).decode("latin-1")
        if not header:
            proxied = request.META.get(PROXY_TOKEN_HEADER, "")
            if not proxied:
                return None
            header = f"{self.keyword} {proxied}"
        parts = header.split()
        if parts[0].lower() != self.keyword.lower():
            return None
        if len(parts) != 2:
            raise exceptions.AuthenticationFailed(
                "Authorization header must be 'Bearer <token>' with one token and no spaces."
            )
        if not parts[1].startswith(TOKEN_PREFIX):
            return None  # not a Tessera token: a ServiceAccount token, reviewed next
        token = (
            ApiToken.objects.select_related("user")
            .filter(key_digest=digest(parts[1]), revoked=False)
            .first()
        )
        now = timezone.now()
        if token is None or (token.expires_at is not None and token.expires_at <= now):
            raise exceptions.AuthenticationFailed("Invalid, revoked or expired token.")
        if not token.user.is_active:
            raise exceptions.AuthenticationFailed("The token's user is disabled.")
        if token.last_used_at is None or now - token.last_used_at > LAST_USED_RESOLUTION:
            ApiToken.objects.filter(pk=token.pk).update(last_used_at=now)
        return token.user, token

    def authenticate_header(self, request: Request) -> str:
        return self.keyword
