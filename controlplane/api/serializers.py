"""Serializers: validate and translate, nothing else."""

from __future__ import annotations

from typing import Any

from rest_framework import serializers

from controlplane.api.fields import (
    FactorField,
    StrictBooleanField,
    StrictCharField,
    StrictIntegerField,
    StrictSerializer,
)
from controlplane.api.names import (
    CardUUIDField,
    ContainerNameField,
    NamespaceField,
    PodNameField,
)
from controlplane.ledger.models import Card
from controlplane.ledger.services.nodes import (
    MAX_MIG_INSTANCES,
    MAX_MIG_SLICES,
    CardReport,
    ContainerUsageReport,
    InventoryReport,
    MigInstanceReport,
    MigReport,
)
from controlplane.scheduling import parse_factor

MAX_CARDS_PER_NODE = 64
MAX_CARD_MEMORY_MIB = 16 * 1024 * 1024  # 16 TiB: far beyond any GPU; larger is a unit mistake
# Containers x cards one usage report may list: 64 cards of 64 slots each is already more than
# any node runs; a longer list is broken or forged.
MAX_USAGE_ENTRIES = 4096
MAX_HOST_MEMORY_MIB = 1 << 36  # 64 PiB of host memory: a larger figure is a unit mistake


class MigInstanceReportSerializer(StrictSerializer):
    """A GPU instance NVML lists on the card (display only: the ledger's slices say what is
    taken)."""

    profile = serializers.RegexField(
        r"^[0-9][A-Za-z0-9.+]{0,31}$",
        max_length=32,
        error_messages={"invalid": "Must be an NVIDIA MIG profile name such as 3g.40gb."},
    )
    start = StrictIntegerField(min_value=0, max_value=MAX_MIG_SLICES - 1)
    size = StrictIntegerField(min_value=1, max_value=MAX_MIG_SLICES)
    uuid = CardUUIDField(help_text="The MIG device's UUID (MIG-...).")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["start"] + attrs["size"] > MAX_MIG_SLICES:
            raise serializers.ValidationError(
                {"size": f"start + size ends past the card's memory slices ({MAX_MIG_SLICES})."}
            )
        return attrs


class MigReportSerializer(StrictSerializer):
    """What the node plugin knows of a card's MIG (docs/card-modes.md, "Inventory")."""

    capable = StrictBooleanField(help_text="NVML supports MIG on this card.")
    enabled = StrictBooleanField(help_text="MIG mode is on now (not pending a GPU reset).")
    instances = MigInstanceReportSerializer(
        many=True,
        max_length=MAX_MIG_INSTANCES,
        allow_empty=True,
        required=False,
        default=list,
        error_messages={
            "max_length": f"At most {MAX_MIG_INSTANCES} MIG instances on one card: no GPU can be "
            "cut into more."
        },
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        if attrs["enabled"] and not attrs["capable"]:
            raise serializers.ValidationError(
                {"enabled": "A card that is not MIG-capable cannot have MIG enabled."}
            )
        if attrs["instances"] and not attrs["enabled"]:
            raise serializers.ValidationError(
                {"instances": "GPU instances exist only while MIG is enabled."}
            )
        seen: dict[str, int] = {}
        for position, instance in enumerate(attrs["instances"]):
            if instance["uuid"] in seen:
                raise serializers.ValidationError(
                    {f"instances[{position}].uuid": f"Duplicate {instance['uuid']!r}: also at "
                     f"instances[{seen[instance['uuid']]}]."}
                )  # fmt: skip
            seen[instance["uuid"]] = position
        return attrs


class CardReportSerializer(StrictSerializer):
    uuid = CardUUIDField()
    index = StrictIntegerField(min_value=0, max_value=MAX_CARDS_PER_NODE - 1)
    model = StrictCharField(max_length=128)
    memory_mib = StrictIntegerField(min_value=1, max_value=MAX_CARD_MEMORY_MIB)
    numa_node = StrictIntegerField(min_value=-1, max_value=1023, allow_null=True, required=False)
    healthy = StrictBooleanField()
    health_reason = StrictCharField(max_length=256, allow_blank=True, required=False, default="")
    mig = MigReportSerializer(
        required=False,
        allow_null=True,
        help_text="Optional (plugins that predate card modes send none): the card's MIG support, "
        "state and GPU instances.",
    )


class ContainerUsageSerializer(StrictSerializer):
    """What one container uses of one card now (the shim's region, NVML's process figures)."""

    namespace = NamespaceField()
    pod = PodNameField()
    container = ContainerNameField()
    card = CardUUIDField(help_text="The card's UUID: one of this report's cards.")
    memory_used_mib = StrictIntegerField(min_value=0, max_value=MAX_CARD_MEMORY_MIB)
    compute_used_percent = StrictIntegerField(
        min_value=0,
        max_value=100,
        allow_null=True,
        required=False,
        default=None,
        help_text="Percent of the card's SM time its processes used in the last sample period; "
        "null when NVML gives no per-process figure (MIG cards, older drivers).",
    )
    memory_resident_mib = StrictIntegerField(
        min_value=0,
        max_value=MAX_CARD_MEMORY_MIB,
        required=False,
        help_text="Optional (virtual device memory): what the container holds on the card, from "
        "the shim's region.",
    )
    memory_spilled_mib = StrictIntegerField(
        min_value=0,
        max_value=MAX_CARD_MEMORY_MIB,
        required=False,
        help_text="Optional (virtual device memory): what the container has spilled to host "
        "memory, from the shim's region.",
    )


class InventoryReportSerializer(StrictSerializer):
    plugin_version = StrictCharField(max_length=64, allow_blank=True)
    memory_oversubscription = FactorField(
        required=False,
        help_text="Optional: the default oversubscription factor of the node's cards, a string "
        'from "1" to "16" with at most two decimal places (absent: "1", off). A card\'s own '
        "factor, set by an operator, wins (docs/virtual-memory.md).",
    )
    spill_reserve_mib = StrictIntegerField(
        min_value=0,
        max_value=MAX_HOST_MEMORY_MIB,
        required=False,
        help_text="Optional: host memory (MiB) set aside for what opted-in slices spill; absent: "
        "0, none.",
    )
    host_memory_mib = StrictIntegerField(
        min_value=1,
        max_value=MAX_HOST_MEMORY_MIB,
        required=False,
        help_text="Optional: the node's memory (MemTotal) in MiB; the spill reserve may not "
        "exceed it.",
    )
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

    usage = ContainerUsageSerializer(
        many=True,
        max_length=MAX_USAGE_ENTRIES,
        allow_empty=True,
        required=False,
        help_text="Optional: what each container uses of each card now (sent by plugins that "
        "sample it; `kubectl tessera top` shows it). Absent: the last one stands, and goes stale.",
        error_messages={
            "max_length": f"At most {MAX_USAGE_ENTRIES} usage entries in one report: no node "
            "runs that many containers on its cards."
        },
    )

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        reserve, host = attrs.get("spill_reserve_mib"), attrs.get("host_memory_mib")
        if reserve is not None and host is not None and reserve > host:
            raise serializers.ValidationError(
                {"spill_reserve_mib": f"{reserve} MiB is more than the node's memory "
                 f"(host_memory_mib {host} MiB): set aside at most what the node has."}
            )  # fmt: skip
        uuids = {c["uuid"] for c in attrs["cards"]}
        seen: dict[tuple[str, ...], int] = {}
        for position, u in enumerate(attrs.get("usage") or []):
            if u["card"] not in uuids:
                raise serializers.ValidationError(
                    {f"usage[{position}].card": f"{u['card']!r} is not one of this report's "
                     "cards: a node reports usage of its own cards only."}
                )  # fmt: skip
            key = (u["namespace"], u["pod"], u["container"], u["card"])
            if key in seen:
                raise serializers.ValidationError(
                    {f"usage[{position}]": f"Duplicate entry for {'/'.join(key[:3])} on "
                     f"{key[3]}: also at usage[{seen[key]}]."}
                )  # fmt: skip
            seen[key] = position
        return attrs

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
                    mig=_mig(c.get("mig")),
                )
                for c in data["cards"]
            ),
            usage=None
            if "usage" not in data
            else tuple(ContainerUsageReport(**u) for u in data["usage"]),
            memory_factor=None
            if data.get("memory_oversubscription") is None
            else parse_factor(data["memory_oversubscription"]),
            spill_reserve_mib=data.get("spill_reserve_mib"),
            host_memory_mib=data.get("host_memory_mib"),
        )


def _mig(data: dict[str, Any] | None) -> MigReport | None:
    if data is None:
        return None
    return MigReport(
        capable=data["capable"],
        enabled=data["enabled"],
        instances=tuple(
            MigInstanceReport(i["profile"], i["start"], i["size"], i["uuid"])
            for i in data["instances"]
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
    modes = serializers.DictField(
        child=serializers.ChoiceField(choices=Card.Mode.choices),
        help_text="Each of the node's cards by UUID: the mode it is in (docs/card-modes.md); the "
        "node plugin sets the card up for it.",
    )
