"""OpenAPI: describe Tessera's bearer tokens so the schema says how to authenticate."""

from __future__ import annotations

from typing import Any

from drf_spectacular.extensions import OpenApiAuthenticationExtension


class BearerTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.access.authentication.BearerTokenAuthentication"
    name = "bearerToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A token from `manage.py createtoken <user> --role <role>`.",
        }


class ServiceAccountTokenScheme(OpenApiAuthenticationExtension):
    target_class = "controlplane.access.serviceaccount.ServiceAccountTokenAuthentication"
    name = "serviceAccountToken"

    def get_security_definition(self, auto_schema: Any) -> dict[str, str]:
        return {
            "type": "http",
            "scheme": "bearer",
            "description": "A node plugin's projected ServiceAccount token (audience 'tessera'), "
            "reviewed with the API server; it speaks for the node it is bound to.",
        }
