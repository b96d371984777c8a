"""Serializers of the operations API: validate and translate, nothing else.

Input is strict: a JSON object, JSON integers for limits (not "12", 1.5 or true), a valid
namespace name, and no fields the endpoint does not know or computes itself
(`controlplane.api.fields.StrictSerializer`).
"""

from __future__ import annotations

from rest_framework import serializers

from controlplane.api.fields import (
    FactorField,
    StrictCharField,
    StrictIntegerField,
    StrictSerializer,
)
from controlplane.api.names import NamespaceField
from controlplane.ledger.models import Card
from controlplane.ledger.services.mode_rules import MODES
from controlplane.ledger.services.modes import MAX_REASON
from controlplane.ledger.services.quotas import MAX_QUOTA, QuotaLimitsInput

LIMIT_FIELDS = ("gpumem_mib", "gpucores", "gpus")


def _limit(name: str, help_text: str) -> StrictIntegerField:
    return StrictIntegerField(
        min_value=0,
        max_value=MAX_QUOTA[name],
        allow_null=True,
        required=False,
        default=None,
        help_text=help_text + " Null = unlimited.",
    )


class UsageSerializer(serializers.Serializer):
    gpumem_mib = serializers.IntegerField()
    gpucores = serializers.IntegerField()
    gpus = serializers.IntegerField()


class QuotaSerializer(StrictSerializer):
    """A namespace quota: limits (null = unlimited) and, read-only, what the namespace holds."""

    namespace = NamespaceField(help_text="Kubernetes namespace name (DNS label).")
    gpumem_mib = _limit("gpumem_mib", "Total GPU memory in MiB over all slices.")
    gpucores = _limit("gpucores", "Sum of compute percents over all slices.")
    gpus = _limit("gpus", "Number of slices.")
    usage = UsageSerializer(read_only=True)
    updated_at = serializers.DateTimeField(read_only=True, allow_null=True)
    updated_by = serializers.CharField(read_only=True)

    def limits(self, base: QuotaLimitsInput | None = None) -> QuotaLimitsInput:
        """The validated limits; with `base` (PATCH), fields not sent keep base's values."""
        data = self.validated_data
        sent = self.initial_data if isinstance(self.initial_data, dict) else {}
        values = {}
        for name in LIMIT_FIELDS:
            if base is not None and name not in sent:
                values[name] = getattr(base, name)
            else:
                values[name] = data.get(name)
        return QuotaLimitsInput(**values)


class QuotaLimitsSerializer(QuotaSerializer):
    """PUT/PATCH body: the namespace comes from the URL (it may be repeated if it matches)."""

    namespace = NamespaceField(required=False, help_text="The URL's namespace, if repeated.")


class CordonSerializer(StrictSerializer):
    reason = StrictCharField(
        max_length=500, required=False, allow_blank=True, default="", help_text="For the audit log."
    )


class CardFactorSerializer(StrictSerializer):
    """POST body of a card's oversubscription factor (docs/virtual-memory.md)."""

    factor = FactorField(
        allow_null=True,
        help_text='A decimal string from "1" to "16" with at most two decimal places ("1" = '
        "off); null: back to the node's reported default.",
    )
    reason = StrictCharField(
        max_length=MAX_REASON,
        required=False,
        allow_blank=True,
        default="",
        help_text="For the audit log.",
    )


class CardModeSerializer(StrictSerializer):
    """POST body of a card's mode change (docs/card-modes.md)."""

    mode = serializers.ChoiceField(
        choices=Card.Mode.choices,
        error_messages={
            "invalid_choice": f"{{input!r}} is not a card mode; give one of {', '.join(MODES)}."
        },
        help_text="The mode the card should run in. The card's current mode cancels a pending "
        "change.",
    )
    reason = StrictCharField(
        max_length=MAX_REASON,
        required=False,
        allow_blank=True,
        default="",
        help_text="For the audit log.",
    )


class MigInstanceSerializer(serializers.Serializer):
    """A GPU instance on a MIG card: its profile, its placement and the pod that holds it."""

    profile = serializers.CharField(source="mig_profile")
    start = serializers.IntegerField(source="mig_start", help_text="First memory slice.")
    size = serializers.IntegerField(source="mig_size", help_text="Memory slices it spans.")
    namespace = serializers.CharField()
    pod = serializers.CharField()
    pod_uid = serializers.CharField()
    container = serializers.CharField()


# Each row says who holds it: a pod, or a ResourceClaim in DRA mode (docs/dra.md).
SOURCE_HELP = (
    "pod: a pod the extender bound; claim: a ResourceClaim kube-scheduler allocated (DRA mode), "
    "whose name `{what}` then is, its request's name the container's"
)


class SliceOnCardSerializer(serializers.Serializer):
    namespace = serializers.CharField()
    pod = serializers.CharField()
    pod_uid = serializers.CharField()
    phase = serializers.CharField()
    container = serializers.CharField()
    init = serializers.BooleanField()
    memory_mib = serializers.IntegerField()
    cores = serializers.IntegerField()
    source = serializers.CharField(help_text=SOURCE_HELP.format(what="pod"))


class CardSerializer(serializers.Serializer):
    uuid = serializers.CharField()
    node = serializers.CharField(source="node_name")
    index = serializers.IntegerField()
    model = serializers.CharField()
    memory_mib = serializers.IntegerField()
    compute_units = serializers.IntegerField()
    slots = serializers.IntegerField()
    healthy = serializers.BooleanField()
    health_reason = serializers.CharField()
    cordoned = serializers.BooleanField()
    present = serializers.BooleanField()
    memory_allocated_mib = serializers.IntegerField(source="usage.memory_mib")
    compute_allocated = serializers.IntegerField(source="usage.cores")
    slots_allocated = serializers.IntegerField(source="usage.slots")
    exclusive = serializers.BooleanField(source="usage.exclusive")
    mode = serializers.ChoiceField(choices=Card.Mode.choices)
    pending_mode = serializers.CharField(
        help_text="The mode (one of `mode`'s) a requested change applies when the card's slices "
        "end; blank: none.",
    )
    draining = serializers.BooleanField(
        help_text="A mode change waits for the card's slices to end: it takes no new slices."
    )
    mode_status = serializers.CharField(
        help_text='The mode in words, e.g. "draining: becomes MIG when its 2 slices end".'
    )
    mig_capable = serializers.BooleanField(help_text="The node plugin reports MIG support.")
    mig_enabled = serializers.BooleanField(help_text="MIG is on in the GPU now.")
    mig_instances = MigInstanceSerializer(many=True, help_text="Its active MIG slices.")
    memory_oversubscription = serializers.CharField(
        source="factor_text",
        help_text='The oversubscription factor that applies, e.g. "1" (off) or "1.5": the '
        "card's own, else its node's reported default (docs/virtual-memory.md).",
    )
    memory_oversubscription_own = serializers.CharField(
        source="own_factor_text",
        allow_null=True,
        help_text="The factor an operator set on the card; null: it follows its node's.",
    )
    memory_virtual_mib = serializers.IntegerField(
        source="virtual_mib", help_text="f x memory_mib: what the card's slices may add up to."
    )
    memory_resident_allocated_mib = serializers.IntegerField(
        source="resident_allocated_mib",
        help_text="What the card's slices keep on the card; memory_allocated_mib less this may "
        "spill to host memory.",
    )


class CardDetailSerializer(CardSerializer):
    slices = SliceOnCardSerializer(many=True)


class NodeSerializer(serializers.Serializer):
    name = serializers.CharField()
    ready = serializers.BooleanField()
    cordoned = serializers.BooleanField()
    last_heartbeat = serializers.DateTimeField(allow_null=True)
    plugin_version = serializers.CharField()
    memory_mib = serializers.IntegerField()
    memory_allocated_mib = serializers.IntegerField()
    cards = CardSerializer(many=True)


class SliceSerializer(serializers.Serializer):
    namespace = serializers.CharField()
    pod = serializers.CharField()
    source = serializers.CharField(help_text=SOURCE_HELP.format(what="pod"))
    pod_uid = serializers.CharField()
    phase = serializers.CharField()
    container = serializers.CharField()
    container_index = serializers.IntegerField()
    init = serializers.BooleanField()
    node = serializers.CharField()
    card = serializers.CharField()
    memory_mib = serializers.IntegerField()
    compute_percent = serializers.IntegerField()
    active = serializers.BooleanField()
    memory_used_mib = serializers.IntegerField(
        allow_null=True,
        help_text="Device memory the container holds on the card now (the shim's region, as its "
        "node plugin last reported it); null when not known or the report is stale.",
    )
    compute_used_percent = serializers.IntegerField(
        allow_null=True,
        help_text="Percent of the card's SM time the container used in the plugin's last sample "
        "(NVML); null when not known.",
    )
    resident_mib = serializers.IntegerField(
        allow_null=True,
        help_text="The slice's resident part: what stays on the card when its pod opted in to "
        "virtual device memory (docs/virtual-memory.md); null: all of memory_mib.",
    )
    memory_resident_mib = serializers.IntegerField(
        allow_null=True,
        help_text="Of memory_used_mib, what the container holds on the card now (the shim's "
        "region); null when not known.",
    )
    memory_spilled_mib = serializers.IntegerField(
        allow_null=True,
        help_text="What the container has spilled to host memory now (the shim's region); null "
        "when not known.",
    )
    used_at = serializers.DateTimeField(
        allow_null=True, help_text="When the node plugin reported the two figures above."
    )


class BindingSliceSerializer(serializers.Serializer):
    container = serializers.CharField()
    container_index = serializers.IntegerField()
    init = serializers.BooleanField()
    card = serializers.CharField(source="card_uuid")
    node = serializers.CharField()
    memory_mib = serializers.IntegerField()
    compute_percent = serializers.IntegerField(source="cores")
    active = serializers.BooleanField()


class BindingSerializer(serializers.Serializer):
    pod_uid = serializers.CharField()
    namespace = serializers.CharField()
    name = serializers.CharField()
    node = serializers.CharField(source="node_name", allow_null=True)
    phase = serializers.CharField()
    reason = serializers.CharField()
    created_at = serializers.DateTimeField()
    reserved_at = serializers.DateTimeField(allow_null=True)
    bound_at = serializers.DateTimeField(allow_null=True)
    released_at = serializers.DateTimeField(allow_null=True)
    source = serializers.CharField(help_text=SOURCE_HELP.format(what="name"))
    slices = BindingSliceSerializer(many=True)
