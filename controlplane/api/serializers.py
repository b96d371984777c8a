"""Serializers: validate and translate, nothing else."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.api.fields import (
    StrictBooleanField,
    StrictCharField,
    StrictIntegerField,
    StrictSerializer,
)
from controlplane.api.names import CardUUIDField
from controlplane.ledger.services.nodes import CardReport, InventoryReport

MAX_CARDS_PER_NODE = 64
MAX_CARD_MEMORY_MIB = 16 * 1024 * 1024  # 16 TiB: far beyond any GPU; larger is a unit mistake


class CardReportSerializer(StrictSerializer):
    uuid = CardUUIDField()
    index = StrictIntegerField(min_value=0, max_value=MAX_CARDS_PER_NODE - 1)
    model = StrictCharField(max_length=128)
    memory_mib = StrictIntegerField(min_value=1, max_value=MAX_CARD_MEMORY_MIB)
    numa_node = StrictIntegerField(min_value=-1, max_value=1023, allow_null=True, required=False)
    healthy = StrictBooleanField()
    health_reason = StrictCharField(max_length=256, allow_blank=True, required=False, default="")


class InventoryReportSerializer(StrictSerializer):
    plugin_version = StrictCharField(max_length=64, allow_blank=True)
    cards = CardReportSerializer(
        many=True,
        max_length=MAX_CARDS_PER_NODE,
        allow_empty=True,
        error_messages={
            "max_length": f"At most {MAX_CARDS_PER_NODE} cards in one report: no node has more "
            "GPUs than that, so a longer list is a broken or forged report. Send the node's "
            "cards only."
        },
    )

    def validate_cards(self, cards: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for key in ("uuid", "index"):
            seen: dict[Any, int] = {}
            for position, card in enumerate(cards):
                value = card[key]
                if value in seen:
                    raise serializers.ValidationError(
                        {
                            f"[{position}].{key}": f"Duplicate {key} {value!r}: also reported "
                            f"at cards[{seen[value]}]; each card appears once."
                        }
                    )
                seen[value] = position
        return cards

    def to_report(self) -> InventoryReport:
        data = self.validated_data
        return InventoryReport(
            plugin_version=data["plugin_version"],
            cards=tuple(
                CardReport(
                    uuid=c["uuid"],
                    index=c["index"],
                    model=c["model"],
                    memory_mib=c["memory_mib"],
                    numa_node=None if c.get("numa_node") in (None, -1) else c["numa_node"],
                    healthy=c["healthy"],
                    health_reason=c.get("health_reason", ""),
                )
                for c in data["cards"]
            ),
        )


class InventoryResultSerializer(serializers.Serializer):
    """The answer to an inventory report (documentation of the answer; never read)."""

    node = serializers.CharField()
    created = serializers.BooleanField(help_text="This report registered the node.")
    cards = serializers.IntegerField(help_text="Cards in the report.")
    cards_added = serializers.ListField(child=serializers.CharField())
    cards_missing = serializers.ListField(
        child=serializers.CharField(), help_text="Registered cards this report left out."
    )
    last_heartbeat = serializers.DateTimeField()
