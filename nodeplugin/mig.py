"""MIG on this node through NVML (pynvml): turn it on, list, create, adopt and destroy instances.

A container's MIG slice is one GPU instance of a profile at a placement on the card's memory
slices (the control plane chose both) plus one compute instance filling it; the container sees
the MIG device of that compute instance. The plugin records the instances it created in its
state directory (``<state>/mig/<card>-<start>-<size>.json``): those, and only those, it
destroys when their binding ends or, after a restart, when no container holds their devices
any more. Instances someone else made are left alone and reported.

NVML's calls block and are not meant to race each other on one card, so every call here holds
one lock; callers on the event loop go through ``asyncio.to_thread``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import re
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pynvml

from nodeplugin.allocation import MigPlacement
from nodeplugin.dra_slices import MigLayout, MigOffer
from nodeplugin.store import atomic_write

log = logging.getLogger(__name__)

MIG_MINORS = Path("driver/nvidia-caps/mig-minors")
CAPABILITIES = Path("driver/nvidia/capabilities")
# NVML's nvml.h: the GPU and compute instance profile index ranges, and the engine profile.
GI_PROFILE_COUNT = 0x12
CI_PROFILE_COUNT = 0x9
CI_ENGINE_SHARED = 0
# A profile has at most one placement per memory slice, and a card at most this many slices
# (the most counters DRA's counter set holds, docs/dra.md).
MAX_PLACEMENTS = 32
_PROFILE_NAME = re.compile(r"^(MIG\s+)?(?P<name>\S+)$")


class MigError(RuntimeError):
    """A MIG step NVML refused, or a placement that cannot be served; the message says which."""


@dataclass(frozen=True)
class MigStatus:
    capable: bool
    enabled: bool  # on now, not pending a reset
    pending: bool  # a mode change waits for a GPU reset


@dataclass(frozen=True)
class MigInstance:
    card: str  # the parent card's UUID
    profile: str
    start: int
    size: int
    gi: int
    ci: int | None  # None: a GPU instance without a compute instance
    uuid: str  # the MIG device's UUID ("" without a compute instance)

    def report(self) -> dict[str, object]:
        """The inventory's instance object (docs/card-modes.md)."""
        return {"profile": self.profile, "start": self.start, "size": self.size, "uuid": self.uuid}


@dataclass(frozen=True)
class Owned:
    """An instance this plugin created, and for which allocation (the names store's digest of
    the device IDs) it did so."""

    card: str
    profile: str
    start: int
    size: int
    gi: int
    ci: int
    uuid: str
    digest: str
    pod_uid: str
    container: str

    @classmethod
    def of(cls, inst: MigInstance, digest: str, pod_uid: str, container: str) -> Owned:
        """The record of ``inst``, created for ``digest`` (an allocation's or a claim's plan)."""
        fields = {**asdict(inst), "ci": inst.ci if inst.ci is not None else 0}
        return cls(**fields, digest=digest, pod_uid=pod_uid, container=container)


def _err(exc: pynvml.NVMLError) -> str:
    return str(exc) or f"NVML error {exc.value}"


def cap_minors(proc_root: Path, gpu_minor: int, gi: int, ci: int) -> tuple[int, int]:
    """The ``/dev/nvidia-caps/nvidia-cap<N>`` minors of a GPU instance and a compute instance,
    as NVIDIA's container toolkit finds them: the driver's table in
    ``/proc/driver/nvidia-caps/mig-minors`` (``gpu<minor>/gi<G>/access N`` and
    ``gpu<minor>/gi<G>/ci<C>/access N``), else the ``DeviceFileMinor:`` line of the capability's
    own ``access`` file under ``/proc/driver/nvidia/capabilities``."""
    gi_cap = f"gpu{gpu_minor}/gi{gi}/access"
    ci_cap = f"gpu{gpu_minor}/gi{gi}/ci{ci}/access"
    table: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in (proc_root / MIG_MINORS).read_text().splitlines():
            cap, _, number = line.strip().partition(" ")
            if number.strip().isdigit():
                table[cap] = int(number)
    out = []
    for cap in (gi_cap, ci_cap):
        if cap in table:
            out.append(table[cap])
            continue
        path = proc_root / CAPABILITIES / cap.replace(f"gpu{gpu_minor}/", f"gpu{gpu_minor}/mig/")
        found: int | None = None
        with contextlib.suppress(OSError):
            for line in path.read_text().splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "DeviceFileMinor" and value.strip().isdigit():
                    found = int(value.strip())
        if found is None:
            raise MigError(
                f"no device minor for MIG capability {cap}: neither {proc_root / MIG_MINORS} "
                f"nor {path} names it (is the NVIDIA driver's nvidia-caps support loaded?)"
            )
        out.append(found)
    return out[0], out[1]


@dataclass(frozen=True)
class _Profile:
    index: int  # NVML_GPU_INSTANCE_PROFILE_*
    id: int  # the profile ID NVML's create/list calls take
    name: str
    slices: int  # compute slices
    instances: int  # most instances of it on one card
    memory_mib: int


class Mig:
    """MIG on the node's cards; ``handles`` maps card UUID to NVML device handle."""

    def __init__(self, handles: dict[str, Any], state_dir: Path) -> None:
        self.handles = handles
        self.dir = state_dir / "mig"
        self._lock = threading.Lock()
        self._profiles: dict[str, dict[str, _Profile]] = {}

    # -- mode ------------------------------------------------------------------------------

    def status(self, card: str) -> MigStatus:
        with self._lock:
            return self._status(card)

    def _status(self, card: str) -> MigStatus:
        try:
            current, pending = pynvml.nvmlDeviceGetMigMode(self.handles[card])
        except pynvml.NVMLError:
            return MigStatus(False, False, False)
        on = current == pynvml.NVML_DEVICE_MIG_ENABLE
        return MigStatus(True, on, pending != current)

    def enable(self, card: str) -> MigStatus:
        """Turn MIG on (idempotent). Where the driver needs a GPU reset the mode stays
        pending: the status says so and the card is not usable for MIG until the reset."""
        with self._lock:
            st = self._status(card)
            if not st.capable:
                raise MigError(f"card {card} cannot do MIG (NVML: MIG mode not supported)")
            if st.enabled or st.pending:
                return st
            try:
                activation = pynvml.nvmlDeviceSetMigMode(
                    self.handles[card], pynvml.NVML_DEVICE_MIG_ENABLE
                )
            except pynvml.NVMLError as exc:
                raise MigError(f"card {card}: turning MIG on failed: {_err(exc)}") from None
            st = self._status(card)
            if activation != pynvml.NVML_SUCCESS and not st.enabled:
                log.warning(
                    "card %s: MIG mode set but not active (%s): it needs a GPU reset",
                    card,
                    _err(pynvml.NVMLError(activation)),
                )
            return st

    # -- profiles and instances ------------------------------------------------------------

    def _profile_table(self, card: str) -> dict[str, _Profile]:
        cached = self._profiles.get(card)
        if cached is not None:
            return cached
        table: dict[str, _Profile] = {}
        h = self.handles[card]
        for index in range(GI_PROFILE_COUNT):
            try:
                info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
            except pynvml.NVMLError:
                continue  # a profile this card does not have
            raw = info.name.decode() if isinstance(info.name, bytes) else str(info.name)
            m = _PROFILE_NAME.match(raw.strip())
            if m is None:
                continue
            name = m.group("name")
            table[name] = _Profile(
                index,
                int(info.id),
                name,
                int(info.sliceCount),
                int(info.instanceCount),
                int(info.memorySizeMB),
            )
        if table:  # an empty answer may be a passing NVML error: ask again next time
            self._profiles[card] = table
        return table

    def layout(self, card: str) -> MigLayout | None:
        """Every placement of every profile the card offers, as DRA mode publishes them; None
        while MIG is not on (NVML gives no placements then). The card's memory slices are the
        span of its placements: the whole-card profile covers them all."""
        with self._lock:
            if not self._status(card).enabled:
                return None
            h = self.handles[card]
            offers: list[MigOffer] = []
            for prof in self._profile_table(card).values():
                # Not the instance count: a profile may have more starts than instances.
                arr = (pynvml.c_nvmlGpuInstancePlacement_t * MAX_PLACEMENTS)()
                count = ctypes.c_uint(MAX_PLACEMENTS)
                try:
                    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(
                        h, prof.id, arr, ctypes.byref(count)
                    )
                except pynvml.NVMLError as exc:
                    raise MigError(
                        f"card {card}: reading the placements of MIG {prof.name} failed: "
                        f"{_err(exc)}"
                    ) from None
                offers += [
                    MigOffer(prof.name, int(arr[k].start), int(arr[k].size), prof.memory_mib)
                    for k in range(count.value)
                ]
            if not offers:
                return None  # an empty answer may be a passing NVML error: ask again
            return MigLayout(max(o.start + o.size for o in offers), tuple(offers))

    def instances(self, card: str) -> list[MigInstance]:
        with self._lock:
            return self._instances(card)

    def _mig_uuids(self, card: str) -> dict[tuple[int, int], str]:
        h = self.handles[card]
        out: dict[tuple[int, int], str] = {}
        try:
            count = pynvml.nvmlDeviceGetMaxMigDeviceCount(h)
        except pynvml.NVMLError:
            return out
        for i in range(count):
            try:
                mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, i)
            except pynvml.NVMLError:
                continue  # no MIG device at this index
            try:
                gi = int(pynvml.nvmlDeviceGetGpuInstanceId(mh))
                ci = int(pynvml.nvmlDeviceGetComputeInstanceId(mh))
                out[(gi, ci)] = str(pynvml.nvmlDeviceGetUUID(mh))
            except pynvml.NVMLError as exc:
                log.warning("card %s: MIG device %d cannot be read: %s", card, i, _err(exc))
        return out

    def _gpu_instances(self, card: str) -> list[tuple[_Profile, Any, Any]]:
        """(profile, GPU instance handle, nvmlGpuInstanceInfo_t) of every GPU instance."""
        h = self.handles[card]
        out = []
        for prof in self._profile_table(card).values():
            n = max(prof.instances, 1)
            arr = (pynvml.c_nvmlGpuInstance_t * n)()
            count = ctypes.c_uint(n)
            try:
                pynvml.nvmlDeviceGetGpuInstances(h, prof.id, arr, ctypes.byref(count))
            except pynvml.NVMLError as exc:
                raise MigError(f"card {card}: listing MIG instances failed: {_err(exc)}") from None
            for k in range(count.value):
                info = pynvml.nvmlGpuInstanceGetInfo(arr[k])
                out.append((prof, arr[k], info))
        return out

    @staticmethod
    def _ci_profiles(gi_handle: Any) -> list[Any]:
        """The compute instance profiles a GPU instance has (nvmlComputeInstanceProfileInfo)."""
        out = []
        for index in range(CI_PROFILE_COUNT):
            try:
                out.append(
                    pynvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                        gi_handle, index, CI_ENGINE_SHARED
                    )
                )
            except pynvml.NVMLError:
                continue  # a profile this GPU instance does not have
        return out

    def _compute_instances(self, gi_handle: Any) -> list[Any]:
        """(compute instance handle, info) of every compute instance of a GPU instance."""
        out = []
        for pinfo in self._ci_profiles(gi_handle):
            n = max(int(pinfo.instanceCount), 1)
            arr = (pynvml.c_nvmlComputeInstance_t * n)()
            count = ctypes.c_uint(n)
            pynvml.nvmlGpuInstanceGetComputeInstances(
                gi_handle, int(pinfo.id), arr, ctypes.byref(count)
            )
            for k in range(count.value):
                out.append((arr[k], pynvml.nvmlComputeInstanceGetInfo(arr[k])))
        return out

    def _instances(self, card: str) -> list[MigInstance]:
        if not self._status(card).enabled:
            return []
        uuids = self._mig_uuids(card)
        out = []
        try:
            for prof, gih, info in self._gpu_instances(card):
                gi = int(info.id)
                start, size = int(info.placement.start), int(info.placement.size)
                cis = self._compute_instances(gih)
                if not cis:
                    out.append(MigInstance(card, prof.name, start, size, gi, None, ""))
                for _, cinfo in cis:
                    ci = int(cinfo.id)
                    out.append(
                        MigInstance(card, prof.name, start, size, gi, ci, uuids.get((gi, ci), ""))
                    )
        except pynvml.NVMLError as exc:
            raise MigError(f"card {card}: listing MIG instances failed: {_err(exc)}") from None
        return sorted(out, key=lambda i: (i.start, i.gi, i.ci or 0))

    def ensure(
        self,
        card: str,
        want: MigPlacement,
        on_created: Callable[[MigInstance], None] | None = None,
    ) -> tuple[MigInstance, bool]:
        """The instance of ``want`` on ``card``: the one that exists at that placement (adopted),
        else a new GPU instance and one compute instance filling it. Returns it and whether it
        was created now. Raises MigError naming the placement when NVML refuses.

        ``on_created`` records a new instance as this plugin's before anything else may look
        (under the lock); if it fails, the instance is destroyed again, so none is ever left
        that the plugin made but does not know it made."""
        with self._lock:
            where = f"MIG {want.profile} at placement start={want.start} size={want.size}"
            st = self._status(card)
            if not st.enabled:
                why = "pending a GPU reset" if st.pending else "off"
                raise MigError(f"card {card}: MIG mode is {why}; cannot give {where}")
            prof = self._profile_table(card).get(want.profile)
            if prof is None:
                raise MigError(
                    f"card {card} has no MIG profile {want.profile} (it has "
                    f"{', '.join(sorted(self._profile_table(card))) or 'none'})"
                )
            existing = self._instances(card)
            for inst in existing:
                if (inst.start, inst.size) != (want.start, want.size):
                    continue
                if inst.profile != want.profile:
                    raise MigError(
                        f"card {card}: {where} is taken by a {inst.profile} instance (GPU "
                        f"instance {inst.gi}) that the allocation does not name"
                    )
                if inst.ci is not None:
                    return inst, False
                return self._fill(card, prof, want, inst.gi), False
            h = self.handles[card]
            placement = pynvml.c_nvmlGpuInstancePlacement_t()
            placement.start, placement.size = want.start, want.size
            try:
                gih = pynvml.nvmlDeviceCreateGpuInstanceWithPlacement(
                    h, prof.id, ctypes.byref(placement)
                )
            except pynvml.NVMLError as exc:
                others = ", ".join(
                    sorted({f"{i.profile} at start={i.start} size={i.size}" for i in existing})
                )
                raise MigError(
                    f"card {card}: NVML refused to create {where}: {_err(exc)}"
                    + (f" (instances on the card: {others})" if others else "")
                ) from None
            gi = int(pynvml.nvmlGpuInstanceGetInfo(gih).id)
            try:
                inst = self._fill(card, prof, want, gi, gih)
            except MigError:
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlGpuInstanceDestroy(gih)  # no half instance left behind
                raise
            if on_created is not None:
                try:
                    on_created(inst)
                except OSError as exc:
                    with contextlib.suppress(pynvml.NVMLError):
                        for cih, _ in self._compute_instances(gih):
                            pynvml.nvmlComputeInstanceDestroy(cih)
                        pynvml.nvmlGpuInstanceDestroy(gih)
                    raise MigError(
                        f"card {card}: {where} created but not recorded ({exc}); destroyed again"
                    ) from None
            return inst, True

    def _gi_handle(self, card: str, gi: int) -> Any:
        return pynvml.nvmlDeviceGetGpuInstanceById(self.handles[card], gi)

    def _fill(
        self, card: str, prof: _Profile, want: MigPlacement, gi: int, gih: Any = None
    ) -> MigInstance:
        """One compute instance taking all of GPU instance ``gi``'s compute slices."""
        where = f"MIG {want.profile} at placement start={want.start} size={want.size}"
        try:
            gih = gih if gih is not None else self._gi_handle(card, gi)
            fills = [p for p in self._ci_profiles(gih) if int(p.sliceCount) == prof.slices]
            if not fills:
                raise MigError(f"card {card}: no compute instance profile fills {where}")
            cih = pynvml.nvmlGpuInstanceCreateComputeInstance(gih, int(fills[0].id))
            ci = int(pynvml.nvmlComputeInstanceGetInfo(cih).id)
        except pynvml.NVMLError as exc:
            raise MigError(
                f"card {card}: NVML refused the compute instance of {where}: {_err(exc)}"
            ) from None
        uuid = self._mig_uuids(card).get((gi, ci), "")
        if not uuid:
            raise MigError(f"card {card}: NVML lists no MIG device for {where} (gi {gi}, ci {ci})")
        return MigInstance(card, prof.name, want.start, want.size, gi, ci, uuid)

    def destroy(self, card: str, gi: int) -> None:
        """The compute instances of GPU instance ``gi`` and then the GPU instance."""
        with self._lock:
            try:
                gih = self._gi_handle(card, gi)
            except pynvml.NVMLError_NotFound:
                return  # already gone
            except pynvml.NVMLError as exc:
                raise MigError(f"card {card}: GPU instance {gi}: {_err(exc)}") from None
            try:
                for cih, _ in self._compute_instances(gih):
                    pynvml.nvmlComputeInstanceDestroy(cih)
                pynvml.nvmlGpuInstanceDestroy(gih)
            except pynvml.NVMLError as exc:
                raise MigError(
                    f"card {card}: destroying MIG GPU instance {gi} failed: {_err(exc)}"
                ) from None

    # -- what this plugin created ----------------------------------------------------------

    def _owned_path(self, card: str, start: int, size: int) -> Path:
        return self.dir / f"{card}-{start}-{size}.json"

    def record(self, owned: Owned) -> None:
        atomic_write(
            self._owned_path(owned.card, owned.start, owned.size),
            json.dumps(asdict(owned)).encode(),
            durable=True,  # a lost record would leak the instance
        )

    def owned(self) -> list[Owned]:
        out = []
        for path in sorted(self.dir.glob("*.json")):
            try:
                out.append(Owned(**json.loads(path.read_bytes())))
            except (OSError, ValueError, TypeError) as exc:
                log.error("MIG ownership record %s is unreadable (%s); ignored", path, exc)
        return out

    def forget(self, owned: Owned) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._owned_path(owned.card, owned.start, owned.size).unlink()

    def release(self, owned: Owned) -> None:
        """Destroy an instance this plugin created, if it is still the one it created."""
        current = [
            i
            for i in self.instances(owned.card)
            if (i.start, i.size, i.gi) == (owned.start, owned.size, owned.gi)
        ]
        if current:
            self.destroy(owned.card, owned.gi)
            log.info(
                "MIG %s at %d+%d on %s destroyed (its binding ended)",
                owned.profile,
                owned.start,
                owned.size,
                owned.card,
            )
        self.forget(owned)
