"""The allocation ledger (DESIGN §2): the source of truth for who holds which part of which GPU.

Rows are written only by `controlplane.ledger.services`; read them through
`controlplane.ledger.selectors` (and `usage`, `why`, `allocation`).
"""

from __future__ import annotations

from typing import Any

from django.db import models
from django.db.models import F, Q
from django.utils import timezone


class StampedQuerySet(models.QuerySet):  # type: ignore[type-arg]
    """Every UPDATE of these rows moves `updated_at`, given or not."""

    def update(self, **kwargs: Any) -> int:
        kwargs.setdefault("updated_at", timezone.now())
        return super().update(**kwargs)


class Stamped(models.Model):
    """Rows whose changes the extender's snapshot cache must see: nodes, cards, bindings.

    The cache re-reads a node when its row, a card's or a binding's `updated_at` is newer than
    its last pass (`selectors.changes_since`). This is the one change stamp, and it cannot be
    forgotten: `save()` moves it even with `update_fields` that leave it out (Django's
    `auto_now` would not), and a queryset's `update()` moves it too. The hand-written writes of
    ledger/sql.py set it themselves.
    """

    updated_at = models.DateTimeField(auto_now=True)

    objects = StampedQuerySet.as_manager()

    class Meta:
        abstract = True

    def save(self, *args: Any, **kwargs: Any) -> None:
        fields = kwargs.get("update_fields")
        if fields is not None and "updated_at" not in fields:
            kwargs["update_fields"] = [*fields, "updated_at"]
        super().save(*args, **kwargs)


class Node(Stamped):
    """A Kubernetes node that runs the Tessera node plugin."""

    name = models.CharField(max_length=253, unique=True)
    ready = models.BooleanField(
        default=True, help_text="The plugin reports; false once it has been silent too long."
    )
    last_heartbeat = models.DateTimeField(null=True, blank=True)
    plugin_version = models.CharField(max_length=64, blank=True)
    cordoned = models.BooleanField(default=False, help_text="Operator flag: place nothing new.")
    created_at = models.DateTimeField(auto_now_add=True)
    # What the node's containers use right now, as its plugin last sampled it (the shim's
    # regions and NVML): observation for `kubectl tessera top` and the pod page, never read by
    # scheduling. One list per node, replaced by each heartbeat that carries one.
    usage = models.JSONField(default=list, blank=True)
    usage_at = models.DateTimeField(null=True, blank=True)
    # Virtual device memory (docs/virtual-memory.md), as the node plugin reports it: the
    # default oversubscription factor of its cards (in hundredths: 100 = 1, off), the host
    # memory set aside for what opted-in slices spill, and the node's memory in total.
    memory_factor = models.PositiveSmallIntegerField(
        default=100,
        help_text="Reported default oversubscription factor of the node's cards, in hundredths "
        "(150 = 1.5); a card's own factor, set by an operator, wins.",
    )
    spill_reserve_mib = models.PositiveBigIntegerField(
        default=0, help_text="Reported: host memory set aside for spilled slices; 0 = none."
    )
    host_memory_mib = models.PositiveBigIntegerField(
        null=True, blank=True, help_text="Reported: the node's memory (MemTotal) in MiB."
    )

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=Q(memory_factor__gte=100) & Q(memory_factor__lte=1600),
                name="node_memory_factor_1_to_16",
            ),
        ]

    def __str__(self) -> str:
        return self.name


class Card(Stamped):
    """One physical GPU of a node, identified by its NVML UUID."""

    class Mode(models.TextChoices):
        """How the card is shared (docs/card-modes.md); set by an operator, audited."""

        SHARED = "shared", "shared"  # Tessera's slices, held by the shim
        MIG = "mig", "MIG"  # hardware instances, created per binding by the node plugin
        MPS = "mps", "MPS"  # NVIDIA's MPS daemon, limits from the slice
        EXCLUSIVE = "exclusive", "exclusive"  # whole-card pods only

    node = models.ForeignKey(Node, on_delete=models.PROTECT, related_name="cards")
    uuid = models.CharField(max_length=64, unique=True)
    index = models.PositiveSmallIntegerField()
    model = models.CharField(max_length=128)
    memory_mib = models.PositiveIntegerField()
    compute_units = models.PositiveSmallIntegerField(default=100, help_text="100 = whole card.")
    slots = models.PositiveSmallIntegerField(help_text="Most slices the card holds at once.")
    numa_node = models.SmallIntegerField(null=True, blank=True)
    healthy = models.BooleanField(default=True)
    health_reason = models.CharField(max_length=256, blank=True)
    cordoned = models.BooleanField(default=False, help_text="Operator flag: place nothing new.")
    present = models.BooleanField(
        default=True, help_text="In the node's latest report; absent cards take no new slices."
    )
    last_seen = models.DateTimeField(null=True, blank=True)
    mode = models.CharField(max_length=16, choices=Mode.choices, default=Mode.SHARED)
    pending_mode = models.CharField(
        max_length=16,
        choices=Mode.choices,
        blank=True,
        help_text="A mode change waiting for the card to drain; blank: none. A draining card "
        "takes no new slices.",
    )
    mig_capable = models.BooleanField(default=False, help_text="Reported: NVML supports MIG.")
    mig_enabled = models.BooleanField(
        default=False, help_text="Reported: MIG mode is on in the GPU (current, not pending)."
    )
    mig_instances = models.JSONField(
        default=list,
        blank=True,
        help_text="Reported: the GPU instances NVML lists ({profile, start, size, uuid}).",
    )
    memory_factor = models.PositiveSmallIntegerField(
        null=True,
        blank=True,
        help_text="Operator's oversubscription factor of the card, in hundredths (150 = 1.5); "
        "null: the node's reported default (docs/virtual-memory.md).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["node__name", "index"]
        constraints = [
            models.CheckConstraint(
                condition=Q(memory_factor__isnull=True)
                | (Q(memory_factor__gte=100) & Q(memory_factor__lte=1600)),
                name="card_memory_factor_1_to_16",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.uuid} ({self.model}, {self.node_id}#{self.index})"

    @property
    def schedulable(self) -> bool:
        return self.healthy and self.present and not self.cordoned and not self.pending_mode


class PodBinding(Stamped):
    """A pod's claim on a node's cards: reserved at bind, mirrored to the API server."""

    class Phase(models.TextChoices):
        RESERVED = "reserved", "reserved"  # ledger written, Binding not yet confirmed
        BOUND = "bound", "bound"  # the API server accepted the Binding
        ALLOCATED = "allocated", "allocated"  # the node plugin handed the cards to the container
        RELEASED = "released", "released"  # the pod ended; its slices are free again
        FAILED = "failed", "failed"  # bind failed; nothing is held

    class Source(models.TextChoices):
        """Who allocated: the extender's bind (a pod), or kube-scheduler in DRA mode (a
        ResourceClaim the reconciler mirrors; docs/dra.md, *One ledger for claims*)."""

        POD = "pod", "pod"
        CLAIM = "claim", "claim"

    ACTIVE_PHASES = (Phase.RESERVED, Phase.BOUND, Phase.ALLOCATED)

    # For a claim's row: the ResourceClaim's UID, namespace and name (a claim is never a pod,
    # so the reconciler's pod passes leave these rows alone).
    pod_uid = models.CharField(max_length=64, unique=True)
    namespace = models.CharField(max_length=63)
    name = models.CharField(max_length=253)
    node = models.ForeignKey(
        Node, on_delete=models.PROTECT, related_name="bindings", null=True, blank=True
    )
    phase = models.CharField(max_length=16, choices=Phase.choices, default=Phase.RESERVED)
    source = models.CharField(
        max_length=8,
        choices=Source.choices,
        default=Source.POD,
        db_default=Source.POD,
        help_text="pod: the extender bound a pod; claim: a ResourceClaim allocated by "
        "kube-scheduler, mirrored by the reconciler.",
    )
    reason = models.TextField(blank=True)
    request = models.JSONField(help_text="The parsed request (scheduling core PodRequest).")
    deadline = models.DateTimeField(
        null=True, blank=True, help_text="A reservation not confirmed by then is reconciled."
    )
    reserved_at = models.DateTimeField(null=True, blank=True)
    bound_at = models.DateTimeField(null=True, blank=True)
    allocated_at = models.DateTimeField(null=True, blank=True)
    released_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [
            models.Index(fields=["namespace", "name"]),
            models.Index(fields=["phase"]),
        ]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} ({self.phase})"

    @property
    def active(self) -> bool:
        return self.phase in self.ACTIVE_PHASES


class Slice(models.Model):
    """A part of one card held by one container of a bound pod."""

    binding = models.ForeignKey(PodBinding, on_delete=models.CASCADE, related_name="slices")
    card = models.ForeignKey(Card, on_delete=models.PROTECT, related_name="slices")
    container_name = models.CharField(max_length=253)
    container_index = models.PositiveSmallIntegerField()
    init_container = models.BooleanField(default=False)
    sidecar = models.BooleanField(
        default=False,
        help_text="An init container with restartPolicy Always: held beside later containers.",
    )
    memory_mib = models.PositiveIntegerField()
    compute_percent = models.PositiveSmallIntegerField()
    priority = models.PositiveSmallIntegerField(
        null=True, blank=True, help_text="The container's nvidia.com/priority; null: not asked."
    )
    active = models.BooleanField(default=True)
    # A slice on a MIG card is one GPU instance: the profile and its placement on the card's
    # memory slices (NVML's nvmlGpuInstancePlacement_t). Blank/null on other cards.
    mig_profile = models.CharField(max_length=32, blank=True, default="", db_default="")
    mig_start = models.PositiveSmallIntegerField(null=True, blank=True)
    mig_size = models.PositiveSmallIntegerField(null=True, blank=True)
    resident_mib = models.PositiveIntegerField(
        null=True,
        blank=True,
        help_text="The part that stays on the card when the pod opted in to virtual device "
        "memory (docs/virtual-memory.md); null: all of it.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["binding_id", "container_index", "id"]
        indexes = [models.Index(fields=["active", "card"])]
        constraints = [
            models.UniqueConstraint(
                fields=["binding", "init_container", "container_index", "card"],
                name="one_slice_per_container_and_card",
            ),
            models.CheckConstraint(
                condition=Q(compute_percent__lte=100), name="slice_compute_at_most_100"
            ),
            models.CheckConstraint(
                condition=Q(sidecar=False) | Q(init_container=True),
                name="slice_sidecar_is_an_init_container",
            ),
            models.CheckConstraint(
                condition=Q(priority__isnull=True) | Q(priority__lte=1),
                name="slice_priority_0_or_1",
            ),
            models.CheckConstraint(
                condition=Q(resident_mib__isnull=True)
                | (Q(resident_mib__gte=1) & Q(resident_mib__lt=F("memory_mib"))),
                name="slice_resident_below_memory",
            ),
            models.CheckConstraint(
                condition=(Q(mig_profile="") & Q(mig_start__isnull=True) & Q(mig_size__isnull=True))
                | (~Q(mig_profile="") & Q(mig_start__isnull=False) & Q(mig_size__gt=0)),
                name="slice_mig_placement_whole",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.container_name} on {self.card_id}: {self.memory_mib} MiB"


class NamespaceQuota(models.Model):
    """Limits on what one namespace may hold at once; a null limit is unlimited."""

    namespace = models.CharField(max_length=63, unique=True)
    gpumem_mib = models.PositiveBigIntegerField(null=True, blank=True)
    gpucores = models.PositiveIntegerField(null=True, blank=True, help_text="Sum of percents.")
    gpus = models.PositiveIntegerField(null=True, blank=True, help_text="Number of slices.")
    updated_at = models.DateTimeField(auto_now=True)
    updated_by = models.CharField(max_length=150, blank=True)

    class Meta:
        ordering = ["namespace"]

    def __str__(self) -> str:
        return self.namespace


class SchedulingDecision(models.Model):
    """The latest filter outcome for one pod, bounded in size, to answer "why pending?"."""

    class Outcome(models.TextChoices):
        FEASIBLE = "feasible", "feasible"
        UNSCHEDULABLE = "unschedulable", "unschedulable"
        INVALID = "invalid", "invalid request"
        BOUND = "bound", "bound"
        BIND_FAILED = "bind_failed", "bind failed"

    pod_uid = models.CharField(max_length=64, unique=True)
    namespace = models.CharField(max_length=63)
    name = models.CharField(max_length=253)
    outcome = models.CharField(max_length=16, choices=Outcome.choices)
    summary = models.TextField(help_text="One paragraph in plain words.")
    feasible_nodes = models.JSONField(default=list, help_text="Bounded list of node names.")
    node_reasons = models.JSONField(default=dict, help_text="Bounded: node -> reason sentence.")
    reason_counts = models.JSONField(default=dict, help_text="Reason code -> number of nodes.")
    nodes_considered = models.PositiveIntegerField(default=0)
    decided_at = models.DateTimeField()
    # What Tessera's preemption last did for the pod (kept when the filter rewrites the row).
    preemption = models.TextField(blank=True, default="", db_default="")

    class Meta:
        ordering = ["-decided_at"]
        indexes = [models.Index(fields=["namespace", "name"])]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}: {self.outcome}"


class AuditEvent(models.Model):
    """Who changed what: quotas, cordons, tokens, reconciler repairs."""

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.CharField(max_length=150, help_text="Username, node name or 'system'.")
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=32)
    target = models.CharField(max_length=253)
    details = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["target_type", "target"])]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.target}"


class Nomination(models.Model):
    """Room held on a node for a pod whose preemption is under way (docs/preemption.md).

    Written with the victims' evictions; counted as taken for every other pod by filter and
    bind until the nominated pod binds, or the deadline passes.
    """

    pod_uid = models.CharField(max_length=64, unique=True)
    namespace = models.CharField(max_length=63)
    name = models.CharField(max_length=253)
    node = models.ForeignKey(Node, on_delete=models.CASCADE, related_name="nominations")
    priority = models.IntegerField(help_text="The nominated pod's spec.priority.")
    claims = models.JSONField(
        help_text="Card UUID -> [memory MiB, compute, slots, exclusive, MIG mask]: the room it "
        "holds."
    )
    victims = models.JSONField(default=list, help_text="The pods evicted for it: namespace/name.")
    created_at = models.DateTimeField(auto_now_add=True)
    deadline = models.DateTimeField(db_index=True)

    class Meta:
        ordering = ["deadline"]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name} on {self.node_id} until {self.deadline:%H:%M:%S}"
