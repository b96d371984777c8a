"""Django admin for the ledger: the columns, filters and searches an operator reaches for.

Allocation rows (bindings, slices, decisions, audit events) are read-only here. What an admin may
change (a node's or a card's cordon, a card's slots) goes through the ledger's services, the only
writers of its rows: under the node lock, audited, with the change stamp the snapshot cache
reads. Nodes and cards are never deleted here (their plugin reports them; slices refer to them).
"""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import Count, Q, QuerySet, Sum
from django.forms import BaseInlineFormSet, ModelForm
from django.http import HttpRequest

from controlplane.ledger import models
from controlplane.ledger.services import cordons, nodes


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class CardInline(admin.TabularInline):
    model = models.Card
    extra = 0
    can_delete = False
    fields = ("index", "uuid", "model", "memory_mib", "slots", "healthy", "cordoned", "present")
    readonly_fields = ("index", "uuid", "model", "memory_mib", "slots", "healthy", "present")
    show_change_link = True


@admin.register(models.Node)
class NodeAdmin(admin.ModelAdmin):
    list_display = (
        "name",
        "ready",
        "cordoned",
        "card_count",
        "last_heartbeat",
        "plugin_version",
    )
    list_filter = ("ready", "cordoned", "plugin_version")
    search_fields = ("name", "cards__uuid")
    readonly_fields = ("name", "ready", "last_heartbeat", "plugin_version", "created_at")
    fields = ("name", "cordoned", "ready", "last_heartbeat", "plugin_version", "created_at")
    inlines = [CardInline]

    def get_queryset(self, request: HttpRequest) -> QuerySet[models.Node]:
        return super().get_queryset(request).annotate(_cards=Count("cards", distinct=True))

    @admin.display(description="cards", ordering="_cards")
    def card_count(self, obj: models.Node) -> int:
        return obj._cards  # type: ignore[attr-defined, no-any-return]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # nodes come from their plugin's first inventory report

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(
        self, request: HttpRequest, obj: models.Node, form: ModelForm, change: bool
    ) -> None:
        cordons.set_node_cordon(obj.name, obj.cordoned, request.user.get_username(), "admin")

    def save_formset(
        self, request: HttpRequest, form: ModelForm, formset: BaseInlineFormSet, change: bool
    ) -> None:
        for card in formset.save(commit=False):
            cordons.set_card_cordon(card.uuid, card.cordoned, request.user.get_username(), "admin")


@admin.register(models.Card)
class CardAdmin(admin.ModelAdmin):
    list_display = (
        "uuid",
        "node",
        "index",
        "model",
        "memory_mib",
        "allocated_mib",
        "active_slices",
        "slots",
        "healthy",
        "cordoned",
        "present",
    )
    list_filter = ("healthy", "cordoned", "present", "model", "node")
    search_fields = ("uuid", "model", "node__name")
    list_select_related = ("node",)
    readonly_fields = (
        "node",
        "uuid",
        "index",
        "model",
        "memory_mib",
        "compute_units",
        "numa_node",
        "healthy",
        "health_reason",
        "present",
        "last_seen",
    )
    fields = (*readonly_fields, "slots", "cordoned")

    def get_queryset(self, request: HttpRequest) -> QuerySet[models.Card]:
        active = Q(slices__active=True)
        return (
            super()
            .get_queryset(request)
            .annotate(
                _allocated=Sum("slices__memory_mib", filter=active),
                _slices=Count("slices", filter=active),
            )
        )

    @admin.display(description="allocated MiB", ordering="_allocated")
    def allocated_mib(self, obj: models.Card) -> int:
        return obj._allocated or 0  # type: ignore[attr-defined, no-any-return]

    @admin.display(description="active slices", ordering="_slices")
    def active_slices(self, obj: models.Card) -> int:
        return obj._slices  # type: ignore[attr-defined, no-any-return]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def save_model(
        self, request: HttpRequest, obj: models.Card, form: ModelForm, change: bool
    ) -> None:
        actor = request.user.get_username()
        nodes.set_card_slots(obj.uuid, obj.slots, actor)
        cordons.set_card_cordon(obj.uuid, obj.cordoned, actor, "admin")


class SliceInline(admin.TabularInline):
    model = models.Slice
    extra = 0
    can_delete = False
    fields = ("container_name", "init_container", "card", "memory_mib", "compute_percent", "active")
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(models.PodBinding)
class PodBindingAdmin(ReadOnlyAdmin):
    list_display = ("namespace", "name", "node", "phase", "reserved_at", "bound_at", "released_at")
    list_filter = ("phase", "namespace", "node")
    search_fields = ("name", "namespace", "pod_uid", "slices__card__uuid")
    list_select_related = ("node",)
    date_hierarchy = "created_at"
    inlines = [SliceInline]


@admin.register(models.Slice)
class SliceAdmin(ReadOnlyAdmin):
    list_display = (
        "binding",
        "container_name",
        "card",
        "memory_mib",
        "compute_percent",
        "active",
    )
    list_filter = ("active", "init_container", "card__node")
    search_fields = ("binding__name", "binding__namespace", "card__uuid", "container_name")
    list_select_related = ("binding", "card")


@admin.register(models.NamespaceQuota)
class NamespaceQuotaAdmin(ReadOnlyAdmin):
    # Quotas change through the quota service (audit log, validation); the REST API and the
    # dashboard are the places to edit them.
    list_display = ("namespace", "gpumem_mib", "gpucores", "gpus", "updated_at", "updated_by")
    search_fields = ("namespace",)


@admin.register(models.SchedulingDecision)
class SchedulingDecisionAdmin(ReadOnlyAdmin):
    list_display = ("namespace", "name", "outcome", "nodes_considered", "decided_at")
    list_filter = ("outcome", "namespace")
    search_fields = ("name", "namespace", "pod_uid", "summary")
    date_hierarchy = "decided_at"


@admin.register(models.AuditEvent)
class AuditEventAdmin(ReadOnlyAdmin):
    list_display = ("at", "actor", "action", "target_type", "target")
    list_filter = ("action", "target_type")
    search_fields = ("actor", "target", "action")
    date_hierarchy = "at"
