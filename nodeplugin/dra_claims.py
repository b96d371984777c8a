"""Prepared ResourceClaims: the claim's plan, and the checkpoint of what was prepared.

A claim's allocation result (``status.allocation.devices.results``) becomes the same
:class:`~nodeplugin.edits.ContainerPlan` the device plugin renders, so the device plugin's
writer puts the same CDI spec and region on disk: the consumed memory and compute of a shared
card are the shim's limits, and the results' order is the device order the container sees.

The kubelet repeats prepare and unprepare (after its own restart, say), and unprepare may reach
another plugin process than prepare did, after the claim is gone. So every prepared claim is
checkpointed on disk, and both calls are idempotent (docs/dra.md, *Prepare and unprepare*).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nodeplugin import edits
from nodeplugin.allocation import (
    EXCLUSIVE,
    MIG,
    SHARED,
    ContainerAllocation,
    MigPlacement,
    SliceDevice,
)
from nodeplugin.cards import Card
from nodeplugin.dra_slices import (
    COMPUTE,
    DRIVER,
    MEMORY,
    MigLayout,
    card_device_name,
    mig_device_name,
)
from nodeplugin.mig import Mig, MigError, MigInstance, Owned, cap_minors
from nodeplugin.store import atomic_write
from nodeplugin.writer import Writer

log = logging.getLogger(__name__)

MIB = 1 << 20
_QUANTITY = re.compile(r"^([0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_FACTOR: dict[str | None, int] = {
    None: 1,
    **{s: 1 << (10 * (i + 1)) for i, s in enumerate(("Ki", "Mi", "Gi", "Ti", "Pi", "Ei"))},
    **{s: 10 ** (3 * (i + 1)) for i, s in enumerate(("k", "M", "G", "T", "P", "E"))},
}
CHECKPOINT_VERSION = 1
# Devices one claim takes whole: an exclusive card, a MIG placement.
WHOLE = (EXCLUSIVE, MIG)


class ClaimError(ValueError):
    """A claim this plugin must not prepare; the message says which device and why."""


class CheckpointError(RuntimeError):
    """The checkpoint cannot be read: preparing on top of it could double or lose a claim."""


@dataclass(frozen=True)
class ClaimDevice:
    """One allocation result of this driver, and what it gave the container."""

    request: str
    pool: str
    device: str
    share_id: str | None
    card: str  # the card's UUID
    mode: str
    memory_mib: int
    cores: int
    # A MIG device: the instance prepare created (or adopted) for it; unprepare destroys it.
    mig_uuid: str = ""
    mig_gi: int | None = None
    mig_ci: int | None = None


def base_request(ref: str) -> str:
    """A result's request as a container names it: a prioritized list's subrequest
    (``gpu/a100``) counts as its request (``gpu``), as the kubelet strips it
    (``resourceclaim.BaseRequestRef``)."""
    return ref.split("/", 1)[0]


def request_plan_names(claim_plan_name: str, devices: Sequence[ClaimDevice]) -> dict[str, str]:
    """The CDI device (and region) name of each request of a claim, in the results' order: the
    claim's own name when it has one request, else one name per request, so that a container
    naming one request gets that request's devices and limits only (docs/dra.md, *Containers
    and requests*)."""
    requests = list(dict.fromkeys(base_request(d.request) for d in devices))
    if len(requests) == 1:
        return {requests[0]: claim_plan_name}
    return {r: f"{claim_plan_name}-{r}" for r in requests}


def split_by_request(
    plan: edits.ContainerPlan, devices: Sequence[ClaimDevice]
) -> list[edits.ContainerPlan]:
    """The claim's plan as one plan per request (:func:`request_plan_names`), each with its
    request's devices in the results' order, so each request's first device is its ordinal 0."""
    names = request_plan_names(plan.name, devices)
    if len(names) == 1:
        return [plan]
    return [
        dataclasses.replace(
            plan,
            name=name,
            devices=tuple(
                pd
                for pd, cd in zip(plan.devices, devices, strict=True)
                if base_request(cd.request) == request
            ),
        )
        for request, name in names.items()
    ]


@dataclass(frozen=True)
class PreparedClaim:
    uid: str
    namespace: str
    name: str
    plan_name: str  # the claim's CDI device name; a request's is derived from it
    cdi_id: str  # <kind>=<plan_name>
    devices: tuple[ClaimDevice, ...]

    def plan_names(self) -> dict[str, str]:
        """The CDI device names this claim's specs have on disk, by request."""
        return request_plan_names(self.plan_name, self.devices)

    def cdi_ids(self) -> dict[str, str]:
        """The CDI ID of each request's spec."""
        kind = self.cdi_id.partition("=")[0]
        return {r: f"{kind}={name}" for r, name in self.plan_names().items()}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> PreparedClaim:
        return cls(**{**data, "devices": tuple(ClaimDevice(**d) for d in data["devices"])})


def quantity(value: object, where: str) -> int:
    """A whole-number Kubernetes quantity as the allocator writes consumed capacity (``80Gi``,
    ``8448Mi``, ``30``); anything else is refused rather than guessed."""
    m = _QUANTITY.match(str(value)) if isinstance(value, (str, int)) else None
    if m is None or isinstance(value, bool):
        raise ClaimError(f"{where}: {value!r} is not a whole-number quantity")
    return int(m.group(1)) * _FACTOR[m.group(2)]


def plan_name(uid: str) -> str:
    """Never reused with other content: a claim's UID is unique and its allocation immutable."""
    return f"claim-{uid}"


def _meta(claim: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = claim.get("metadata") or {}
    uid, ns, name = meta.get("uid"), meta.get("namespace", ""), meta.get("name", "")
    if not uid:
        raise ClaimError("the ResourceClaim has no metadata.uid")
    return str(uid), str(ns), str(name)


def _consumed(result: Mapping[str, Any], card: Card, where: str) -> tuple[int, int]:
    consumed = result.get("consumedCapacity")
    if not isinstance(consumed, Mapping) or MEMORY not in consumed or COMPUTE not in consumed:
        raise ClaimError(
            f"{where}: a shared card's allocation carries no consumedCapacity memory and compute "
            "(was it allocated by a scheduler without the DRAConsumableCapacity feature?)"
        )
    memory = quantity(consumed[MEMORY], f"{where} consumedCapacity.memory")
    if memory % MIB:
        raise ClaimError(
            f"{where}: consumed memory {consumed[MEMORY]} is not a whole number of MiB"
        )
    memory_mib = memory // MIB
    cores = quantity(consumed[COMPUTE], f"{where} consumedCapacity.compute")
    if not 1 <= memory_mib <= card.memory_mib:
        raise ClaimError(
            f"{where}: consumes {memory_mib} MiB of card {card.uuid}, which has "
            f"{card.memory_mib} MiB"
        )
    if cores > 100:
        raise ClaimError(f"{where}: consumes {cores}% compute of card {card.uuid}; at most 100")
    return memory_mib, cores


@dataclass(frozen=True)
class Published:
    """What this node publishes: the cards, their modes and MIG layouts, under which driver
    (the same inputs the ResourceSlice was built from)."""

    node: str
    cards: tuple[Card, ...]
    modes: Mapping[str, str] = field(default_factory=dict)
    mig: Mapping[str, MigLayout] = field(default_factory=dict)
    driver: str = DRIVER


def claim_devices(
    claim: Mapping[str, Any], published: Published
) -> tuple[tuple[ClaimDevice, ...], tuple[SliceDevice, ...]]:
    """This driver's results of an allocated claim, in the results' order, checked against the
    node's cards; results of other drivers are theirs to prepare. Raises :class:`ClaimError`
    for a device of another node, one this node does not publish, a claim with none of this
    driver's devices, or a consumption the card cannot hold."""
    node, modes, driver = published.node, published.modes, published.driver
    _, ns, name = _meta(claim)
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        raise ClaimError(f"claim {ns}/{name}: not allocated")
    results = (allocation.get("devices") or {}).get("results") or []
    by_name: dict[str, tuple[Card, MigPlacement | None, int]] = {}
    for card in published.cards:
        mode = modes.get(card.uuid, SHARED)
        if mode == MIG:
            for o in published.mig.get(card.uuid, MigLayout(0, ())).offers:
                by_name[mig_device_name(card, o)] = (
                    card,
                    MigPlacement(o.profile, o.start, o.size),
                    o.memory_mib,
                )
        else:
            by_name[card_device_name(card)] = (card, None, card.memory_mib)
    out: list[ClaimDevice] = []
    slices: list[SliceDevice] = []
    for r in results:
        if r.get("driver") != driver:
            continue
        where = f"claim {ns}/{name} device {r.get('pool')}/{r.get('device')}"
        if r.get("pool") != node:
            raise ClaimError(
                f"{where}: the device is in pool {r.get('pool')!r}, not this node's ({node})"
            )
        found = by_name.get(str(r.get("device")))
        if found is None:
            raise ClaimError(f"{where}: this node publishes no such device (now)")
        card, placement, mig_memory = found
        mode = modes.get(card.uuid, SHARED)
        if any(d.card == card.uuid for d in out):
            raise ClaimError(
                f"{where}: a second allocation on card {card.uuid}; a container sees each card "
                "once, so ask distinct cards (constraints: distinctAttribute "
                f"{driver}/uuid)"
            )
        if mode == MIG:
            memory_mib, cores = mig_memory, 0
        elif mode == EXCLUSIVE:
            memory_mib, cores = card.memory_mib, 100
        else:
            memory_mib, cores = _consumed(r, card, where)
        share = r.get("shareID")
        out.append(
            ClaimDevice(
                str(r.get("request", "")),
                node,
                str(r["device"]),
                str(share) if share else None,
                card.uuid,
                mode,
                memory_mib,
                cores,
            )
        )
        slices.append(SliceDevice(card.uuid, memory_mib, cores, mode, placement))
    if not out:
        raise ClaimError(f"claim {ns}/{name}: no device of driver {driver} is allocated to it")
    return tuple(out), tuple(slices)


def _consumer_pod(claim: Mapping[str, Any]) -> tuple[str, str]:
    for ref in (claim.get("status") or {}).get("reservedFor") or []:
        if ref.get("resource") == "pods":
            return str(ref.get("name", "")), str(ref.get("uid", ""))
    return "", ""


def claim_plan(
    claim: Mapping[str, Any], published: Published
) -> tuple[edits.ContainerPlan, tuple[ClaimDevice, ...]]:
    """The plan the device plugin's writer renders for this claim, and its devices."""
    uid, ns, _ = _meta(claim)
    devices, slices = claim_devices(claim, published)
    pod, pod_uid = _consumer_pod(claim)
    container = ContainerAllocation("", 0, False, slices)
    plan = edits.make_plan(
        plan_name(uid),
        container,
        {c.uuid: c for c in published.cards},
        namespace=ns,
        pod=pod,
        pod_uid=pod_uid,
    )
    return plan, devices


class ClaimStore:
    """The checkpoint of prepared claims, one JSON file written atomically and fsynced."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / "dra" / "claims.json"
        self._claims = self._load()

    def _load(self) -> dict[str, PreparedClaim]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(raw)
            if data.get("version") != CHECKPOINT_VERSION:
                raise ValueError(f"version {data.get('version')!r}, expected {CHECKPOINT_VERSION}")
            return {uid: PreparedClaim.from_json(c) for uid, c in data["claims"].items()}
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"the DRA checkpoint {self.path} cannot be read ({exc}); drain the node's GPU "
                "pods and remove the file, or restore it"
            ) from None

    def _save(self) -> None:
        data = {
            "version": CHECKPOINT_VERSION,
            "claims": {uid: c.to_json() for uid, c in sorted(self._claims.items())},
        }
        atomic_write(self.path, json.dumps(data, sort_keys=True).encode(), 0o600, durable=True)

    def get(self, uid: str) -> PreparedClaim | None:
        return self._claims.get(uid)

    def all(self) -> list[PreparedClaim]:
        return list(self._claims.values())

    def put(self, claim: PreparedClaim) -> None:
        self._claims[claim.uid] = claim
        self._save()

    def remove(self, uid: str) -> None:
        if self._claims.pop(uid, None) is not None:
            self._save()


class ClaimPreparer:
    """Prepare and unprepare of claims: the spec and region through the device plugin's
    writer, MIG instances through :class:`~nodeplugin.mig.Mig` (the one owner of MIG's NVML
    calls, shared with the device plugin mode), the record through the checkpoint."""

    def __init__(
        self,
        writer: Writer,
        store: ClaimStore,
        mig: Mig | None = None,
        proc_root: Path = Path("/proc"),
    ) -> None:
        self.writer = writer
        self.store = store
        self.mig = mig
        self.proc_root = proc_root  # the driver's nvidia-caps minors, for a MIG device's nodes

    def _check_free(self, uid: str, devices: Sequence[ClaimDevice], cards: Sequence[Card]) -> None:
        """The last line of defence against two unrelated claims on one device: the scheduler
        should never allocate it, but if it did, the second is refused."""
        memory = {c.uuid: c.memory_mib for c in cards}
        others = [d for c in self.store.all() if c.uid != uid for d in c.devices]
        for d in devices:
            same = [o for o in others if o.device == d.device]
            if not same:
                continue
            if d.mode in WHOLE or any(o.mode in WHOLE for o in same):
                raise ClaimError(
                    f"device {d.device} ({d.card}) is already prepared for another claim"
                )
            used = sum(o.memory_mib for o in same)
            if used + d.memory_mib > memory.get(d.card, 0):
                raise ClaimError(
                    f"device {d.device} ({d.card}): {d.memory_mib} MiB asked, {used} MiB of "
                    f"{memory.get(d.card, 0)} MiB already prepared for other claims"
                )

    def _owned(self, name: str) -> list[Owned]:
        return [o for o in self.mig.owned() if o.digest == name] if self.mig else []

    def _check_placements(self, plan: edits.ContainerPlan, devices: Sequence[ClaimDevice]) -> None:
        """A MIG placement overlapping any instance on its card is refused, unless that
        instance is exactly the one this claim's earlier prepare created (a repeat, a restart):
        an instance of another claim, of the device plugin mode or of an operator is never
        adopted. Only reads, so a refused claim leaves nothing behind."""
        ours = {(o.card, o.start, o.size, o.gi) for o in self._owned(plan.name)}
        for pd, cd in zip(plan.devices, devices, strict=True):
            want = pd.mig
            if pd.mode != MIG or want is None:
                continue
            if self.mig is None:
                raise ClaimError(f"device {cd.device}: this plugin runs without MIG support")
            try:
                found = self.mig.instances(pd.card.uuid)
            except MigError as exc:
                raise ClaimError(f"device {cd.device}: {exc}") from None
            for inst in found:
                if inst.start >= want.start + want.size or want.start >= inst.start + inst.size:
                    continue
                placed = (inst.profile, inst.start, inst.size)
                mine = (pd.card.uuid, inst.start, inst.size, inst.gi) in ours
                if mine and placed == (want.profile, want.start, want.size):
                    continue
                raise ClaimError(
                    f"device {cd.device}: MIG {want.profile} at placement start={want.start} "
                    f"size={want.size} is taken on card {pd.card.uuid} by a {inst.profile} "
                    f"instance at start={inst.start} size={inst.size} (GPU instance {inst.gi}) "
                    "that this claim did not create"
                )

    def _give_mig(
        self, plan: edits.ContainerPlan, devices: tuple[ClaimDevice, ...]
    ) -> tuple[edits.ContainerPlan, tuple[ClaimDevice, ...]]:
        """Each MIG device's GPU and compute instance, created at its placement (recorded as
        this claim's under the MIG lock, so a crash right after cannot leak it), or the one
        this claim created before adopted; the spec then names that instance."""
        if not any(d.mode == MIG for d in plan.devices):
            return plan, devices
        if self.mig is None:
            raise ClaimError(f"claim plan {plan.name}: this plugin runs without MIG support")
        mig = self.mig
        plan_devices: list[edits.PlanDevice] = []
        claim_devices: list[ClaimDevice] = []
        for pd, cd in zip(plan.devices, devices, strict=True):
            if pd.mode != MIG or pd.mig is None:
                plan_devices.append(pd)
                claim_devices.append(cd)
                continue
            where = f"device {cd.device}"

            def record(inst: MigInstance) -> None:
                mig.record(Owned.of(inst, plan.name, plan.pod_uid, ""))

            try:
                inst, created = mig.ensure(pd.card.uuid, pd.mig, record)
                if inst.ci is None:
                    raise MigError(f"MIG GPU instance {inst.gi} has no compute instance")
                gi_minor, ci_minor = cap_minors(self.proc_root, pd.card.minor, inst.gi, inst.ci)
            except MigError as exc:
                raise ClaimError(f"{where}: {exc}") from None
            if created:
                log.info("MIG %s created for %s: %s", where, plan.name, inst.uuid)
            plan_devices.append(
                dataclasses.replace(pd, mig_device=edits.MigDevice(inst.uuid, gi_minor, ci_minor))
            )
            claim_devices.append(
                dataclasses.replace(cd, mig_uuid=inst.uuid, mig_gi=inst.gi, mig_ci=inst.ci)
            )
        return dataclasses.replace(plan, devices=tuple(plan_devices)), tuple(claim_devices)

    def prepare(self, claim: Mapping[str, Any], published: Published) -> PreparedClaim:
        """Idempotent: a claim prepared before keeps its one checkpoint entry and its MIG
        instances; its spec is written again only when missing (the writer skips an identical
        rewrite), e.g. after a reboot emptied the CDI directory. The checkpoint comes first,
        so whatever is on disk or in NVML for a claim is in it, and an unprepare in another
        process finds it."""
        plan, devices = claim_plan(claim, published)
        uid, ns, name = _meta(claim)
        self._check_free(uid, devices, published.cards)
        cdi_id = f"{self.writer.cdi_kind}={plan.name}"
        self._check_placements(plan, devices)
        new = self.store.get(uid) is None
        if new:
            self.store.put(PreparedClaim(uid, ns, name, plan.name, cdi_id, devices))
        try:
            plan, devices = self._give_mig(plan, devices)
        except ClaimError:
            if new and not self._owned(plan.name):
                self.store.remove(uid)  # NVML refused before making anything: nothing to undo
            raise
        prepared = PreparedClaim(uid, ns, name, plan.name, cdi_id, devices)
        if self.store.get(uid) != prepared:
            self.store.put(prepared)
        for request_plan in split_by_request(plan, devices):
            self.writer.write(request_plan)
        return prepared

    def unprepare(self, uid: str) -> None:
        """Removes the claim's spec and region, destroys the MIG instances prepare created for
        it, then removes its checkpoint entry; a claim not prepared (or unprepared already) is
        not an error. An instance NVML does not let go keeps the entry, so the kubelet's retry
        tries again."""
        prepared = self.store.get(uid)
        if prepared is None:
            return
        for name in prepared.plan_names().values():
            self.writer.remove(name)
        if self.mig is not None and any(d.mode == MIG for d in prepared.devices):
            for owned in self._owned(prepared.plan_name):
                try:
                    self.mig.release(owned)
                except MigError as exc:
                    raise ClaimError(f"claim {uid}: {exc}") from None
        self.store.remove(uid)
