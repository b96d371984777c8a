"""Admin for API tokens: list, revoke (through the audited service); new tokens come from
`manage.py createtoken`."""

from __future__ import annotations

from django.contrib import admin
from django.db.models import QuerySet
from django.http import HttpRequest

from controlplane.access.models import ApiToken
from controlplane.access.services import revoke_token


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = (
        "prefix",
        "user",
        "label",
        "created_at",
        "last_used_at",
        "expires_at",
        "revoked",
    )
    list_filter = ("revoked",)
    search_fields = ("user__username", "label", "prefix")
    # `revoked` only through the action: the audited service is its one writer.
    readonly_fields = ("user", "prefix", "created_at", "last_used_at", "revoked")
    fields = ("user", "label", "prefix", "created_at", "last_used_at", "expires_at", "revoked")
    actions = ["revoke"]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # the token is shown once by `manage.py createtoken`

    @admin.action(description="Revoke the selected tokens")
    def revoke(self, request: HttpRequest, queryset: QuerySet[ApiToken]) -> None:
        actor = request.user.get_username()
        for token_id in queryset.values_list("pk", flat=True):
            revoke_token(token_id, actor)
