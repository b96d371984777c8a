"""ResourceClaims mirrored into the ledger (docs/dra.md, *One ledger for claims*).

In DRA mode kube-scheduler allocates Tessera's devices; the API server holds the allocation in
the claim's `status.allocation`. Each reconcile pass makes the ledger say the same: a row of
source `claim` for every allocated claim with Tessera's devices, updated when the allocation
changes, released when the claim is deleted or deallocated. The repairs go through the ledger's
services and the pod passes' bulk release (`services.apply_repairs`), level-based like them.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterable, Mapping
from datetime import datetime

from controlplane.kube.sources import (
    COMPUTE,
    DRA_DRIVER,
    MEMORY,
    ClaimView,
    PublishedDevice,
    whole_quantity,
)
from controlplane.ledger import selectors
from controlplane.ledger.services import audit
from controlplane.ledger.services.claims import ClaimRecord, ClaimSlice, mirror_claims
from controlplane.reconciler.services import REPAIR_CHUNK, SYSTEM, Repair, apply_repairs

log = logging.getLogger(__name__)
MIB = 1 << 20

Devices = Mapping[tuple[str, str], PublishedDevice]
# Drift counted per mirror's outcome: a claim the ledger lacked, one whose allocation changed.
MIRRORED = {"created": "claims_mirrored", "updated": "claims_updated"}


class ClaimProblem(ValueError):
    """A claim's allocation the ledger cannot record as it stands (a device no ResourceSlice
    publishes, a consumption that is not whole MiB or percent): reported, never guessed."""


def claim_record(claim: ClaimView, devices: Devices) -> ClaimRecord | None:
    """The ledger's row for an allocated claim: one slice per result of Tessera's driver (its
    pool is the node, its device a card or a MIG placement of one, `devices` says which card).
    None for a claim that is not allocated or holds none of Tessera's devices. Raises
    ClaimProblem for an allocation that cannot be recorded as it is."""
    if not claim.allocated:
        return None
    ours = [r for r in claim.results if r.driver == DRA_DRIVER]
    if not ours:
        return None
    where = f"claim {claim.namespace}/{claim.name}"
    nodes = {r.pool for r in ours}
    if len(nodes) != 1:
        raise ClaimProblem(f"{where}: devices in several pools ({', '.join(sorted(nodes))}); "
                           "Tessera's pool is one node")  # fmt: skip
    slices = []
    for index, result in enumerate(ours):
        device = devices.get((result.pool, result.device))
        if device is None:
            raise ClaimProblem(
                f"{where}: no ResourceSlice publishes device {result.pool}/{result.device}"
            )
        if device.mig_profile:
            memory_mib, compute = device.memory_mib, 0  # a MIG instance: its memory, own SMs
        elif not device.shared:
            memory_mib, compute = device.memory_mib, 100  # an exclusive card: all of it
        else:
            memory_mib, compute = _consumed(result.consumed, where, result.device, device)
        slices.append(
            ClaimSlice(device.uuid, result.request, index, memory_mib, compute,
                       device.mig_profile, device.mig_start, device.mig_size)
        )  # fmt: skip
    if len({s.card_uuid for s in slices}) != len(slices):
        raise ClaimProblem(f"{where}: two results on one card")
    return ClaimRecord(claim.uid, claim.namespace, claim.name, nodes.pop(), tuple(slices))


def _consumed(
    consumed: Mapping[str, str], where: str, name: str, device: PublishedDevice
) -> tuple[int, int]:
    """A shared device's consumed memory (whole MiB, at least 1, at most the card's) and
    compute (whole percent, at most 100)."""
    memory = whole_quantity(consumed.get(MEMORY, ""))
    compute = whole_quantity(consumed.get(COMPUTE, ""))
    if memory is None or compute is None or memory % MIB:
        raise ClaimProblem(
            f"{where}: device {name} carries no whole consumedCapacity memory and compute "
            f"({dict(consumed)}); was it allocated without DRAConsumableCapacity?"
        )
    if not 1 <= memory // MIB <= device.memory_mib or compute > 100:
        raise ClaimProblem(f"{where}: device {name} consumes {memory // MIB} MiB and {compute}% "
                           f"of a card of {device.memory_mib} MiB")  # fmt: skip
    return memory // MIB, compute


def reconcile_claims(
    claims: Iterable[ClaimView],
    devices: Devices,
    *,
    listed_at: datetime,
    complete: bool,
    deleted_uids: Iterable[str] = (),
) -> Counter[str]:
    """Make the ledger's claim rows say what `claims`, as listed at `listed_at`, say.

    `complete`: the claims are every claim of the cluster, so a row whose claim is absent is
    released; otherwise only the rows of `claims` and of `deleted_uids` are looked at. A row
    created after `listed_at` is left alone, as a pod's is (its claim may be newer than the
    list). A claim naming a device or card the ledger cannot place is reported (audit
    `claim-unmirrored`, drift `flagged_claim`), not invented.
    """
    drift: Counter[str] = Counter()
    by_uid = {c.uid: c for c in claims}
    deleted = set(deleted_uids) - set(by_uid)
    mirrored = selectors.mirrored_claims(None if complete else [*by_uid, *deleted])
    wanted: dict[str, ClaimRecord] = {}
    flagged: set[str] = set()  # allocated, but not recordable now: a row it has stays as it is
    for claim in by_uid.values():
        try:
            record = claim_record(claim, devices)
        except ClaimProblem as exc:
            # E.g. the node's slices are gone for now (the kubelet withdraws them 30 s after
            # its plugin stops): the allocation stands, and so does its row.
            drift[_flag(claim, str(exc))] += 1
            flagged.add(claim.uid)
            continue
        if record is not None:
            wanted[record.uid] = record
    writes = [
        record
        for record in wanted.values()
        if (held := mirrored.get(record.uid)) is None
        or held.node != record.node
        or held.slices != set(record.slices)
    ]
    # A transaction per chunk, as the releases go: a first pass over thousands of claims
    # writes them in a few statements per chunk, not ten per claim.
    for start in range(0, len(writes), REPAIR_CHUNK):
        batch = mirror_claims(writes[start : start + REPAIR_CHUNK], SYSTEM)
        for done in batch.done:
            drift[MIRRORED.get(done.outcome, "")] += 1
        for record, reason in batch.refused:
            drift[_flag(by_uid[record.uid], reason)] += 1
            flagged.add(record.uid)
    repairs = []
    for uid, held in mirrored.items():
        if uid in wanted or uid in flagged or held.created_at >= listed_at:
            continue
        listed = by_uid.get(uid)
        if listed is None and (complete or uid in deleted):
            repairs.append((uid, GONE))
        elif listed is not None:  # listed, but holding none of Tessera's devices any more
            repairs.append((uid, DEALLOCATED))
    drift += apply_repairs(repairs, listed_at)
    drift.pop("", None)
    return drift


GONE = Repair("released_claim_deleted", "release", "the claim no longer exists")
DEALLOCATED = Repair("released_claim_deallocated", "release", "the claim was deallocated")


def _flag(claim: ClaimView, reason: str) -> str:
    audit.record_event(
        SYSTEM, "claim-unmirrored", "claim", f"{claim.namespace}/{claim.name}",
        uid=claim.uid, reason=reason,
    )  # fmt: skip
    log.warning("claim %s/%s is not mirrored: %s", claim.namespace, claim.name, reason)
    return "flagged_claim"
