"""What a container gets: limit environment, CDI spec, host-path artifacts (pure builders).

One :class:`ContainerPlan` is computed per resolved container; the CDI and the host-path modes
render the same plan, so both give the same cards and limits.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from nodeplugin.allocation import MIG, MPS, SHARED, ContainerAllocation, MigPlacement
from nodeplugin.cards import Card

CDI_VERSION = "0.5.0"
REGION_FILE = "region"
CONFIG_FILE = "config"
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")


@dataclass(frozen=True)
class MigDevice:
    """The MIG device a container gets: its UUID and the nvidia-caps minors of its GPU and
    compute instance (``/dev/nvidia-caps/nvidia-cap<N>``)."""

    uuid: str
    gi_minor: int
    ci_minor: int


@dataclass(frozen=True)
class PlanDevice:
    card: Card
    memory_mib: int
    cores: int
    mode: str = SHARED
    mig: MigPlacement | None = None  # the record's placement (mode mig)
    mig_device: MigDevice | None = None  # the instance PreStartContainer gave it
    resident_mib: int | None = None  # the record's resident part; None: all of memory_mib

    @property
    def visible_uuid(self) -> str:
        """What CUDA and the NVIDIA runtime are told: the MIG device's UUID for a MIG slice."""
        return self.mig_device.uuid if self.mig_device is not None else self.card.uuid

    @property
    def shim_limited(self) -> bool:
        """Only shared slices are held by the shim; MIG and MPS hold themselves, and an
        exclusive card is the container's whole."""
        return self.mode == SHARED


@dataclass(frozen=True)
class ContainerPlan:
    """One container's slice, devices in container ordinal order."""

    name: str  # the per-Allocate name (CDI device name and host-path key)
    devices: tuple[PlanDevice, ...]
    namespace: str = ""
    pod: str = ""
    pod_uid: str = ""
    container: str = ""
    priority: int | None = None  # the record's task priority; None when the pod asked none


@dataclass(frozen=True)
class Layout:
    """Host and container paths the renderers need (from Settings)."""

    dev_root: Path
    region_dir: Path
    region_container_dir: str
    state_dir: Path
    config_container_dir: str
    shim_library: Path
    shim_container_path: str
    preload: bool
    container_log_level: str = ""
    mps_pipe_dir: Path = Path("/var/lib/tessera/nodeplugin/mps/pipe")
    mps_container_dir: str = "/tmp/nvidia-mps"  # noqa: S108 - MPS's own default pipe directory

    @property
    def preload_file(self) -> Path:
        return self.state_dir / "ld.so.preload"

    def region_host_dir(self, name: str) -> Path:
        return self.region_dir / name

    def paths_dir(self, name: str) -> Path:
        return self.state_dir / "paths" / name


class PlanError(ValueError):
    """The allocation names a card this node does not have, or more cards than allowed."""


# What only CDI can give: host-path mode fixes the environment at Allocate, before the pod (and
# so its MIG device or MPS limits) is known.
MODES_NEEDING_CDI = (MIG, MPS)


def make_plan(
    name: str,
    container: ContainerAllocation,
    cards: Mapping[str, Card],
    *,
    namespace: str = "",
    pod: str = "",
    pod_uid: str = "",
) -> ContainerPlan:
    devices: list[PlanDevice] = []
    for d in container.devices:
        card = cards.get(d.uuid)
        if card is None:
            raise PlanError(
                f"container {container.name!r} is allocated card {d.uuid}, which this node "
                "does not have"
            )
        devices.append(
            PlanDevice(card, d.memory_mib, d.cores, d.mode, d.mig, resident_mib=d.resident_mib)
        )
    return ContainerPlan(
        name, tuple(devices), namespace, pod, pod_uid, container.name, container.priority
    )


def limit_env(devices: Sequence[PlanDevice]) -> dict[str, str]:
    """``TESSERA_DEVICE_{MEMORY,CORE}_LIMIT_<i>`` with ``i`` the ordinal inside the container,
    for shared slices only: the shim passes an ordinal without limits through untouched.
    ``TESSERA_DEVICE_MEMORY_RESIDENT_<i>`` beside them when the record gives the slice a
    resident part (virtual device memory), and only then."""
    env: dict[str, str] = {}
    for i, d in enumerate(devices):
        if not d.shim_limited:
            continue
        env[f"TESSERA_DEVICE_MEMORY_LIMIT_{i}"] = str(d.memory_mib)
        env[f"TESSERA_DEVICE_CORE_LIMIT_{i}"] = str(d.cores)
        if d.resident_mib is not None:
            env[f"TESSERA_DEVICE_MEMORY_RESIDENT_{i}"] = str(d.resident_mib)
    return env


def mps_env(devices: Sequence[PlanDevice], layout: Layout) -> dict[str, str]:
    """The MPS client settings of a container with ``mps`` slices: the daemon's pipe directory,
    the pinned memory per device ordinal, and the compute share. MPS takes one active thread
    percentage per client, so a container with several mps slices gets the smallest (it
    stays within each of them); 0 (no compute share asked) sets none."""
    mps = [(i, d) for i, d in enumerate(devices) if d.mode == MPS]
    if not mps:
        return {}
    env = {
        "CUDA_MPS_PIPE_DIRECTORY": layout.mps_container_dir,
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": ",".join(f"{i}={d.memory_mib}M" for i, d in mps),
    }
    cores = [d.cores for _, d in mps if d.cores > 0]
    if cores:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(min(cores))
    return env


def priority_env(priority: int | None) -> dict[str, str]:
    """``TESSERA_TASK_PRIORITY`` only when the pod asked for one: without it the shim behaves
    exactly as it does for every other container."""
    return {} if priority is None else {"TESSERA_TASK_PRIORITY": str(priority)}


def visible_env(cards: Sequence[Card], uuids: Sequence[str] | None = None) -> dict[str, str]:
    """Card UUIDs in ordinal order: CUDA numbers devices in this order, and the NVIDIA runtime
    hook (where it is in play) injects exactly these cards instead of an image's ``all``.

    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: CUDA's default order puts the fastest card first, NVML's
    is always PCI order; with PCI order anything that numbers cards by index (a program that
    overrides ``CUDA_VISIBLE_DEVICES`` with indices, a tool that takes NVML's index for CUDA's)
    means the same card in both. ``uuids`` replaces a card's UUID where the container gets a
    MIG device of it."""
    visible = ",".join(uuids if uuids is not None else [c.uuid for c in cards])
    return {
        "NVIDIA_VISIBLE_DEVICES": visible,
        "CUDA_VISIBLE_DEVICES": visible,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
    }


def container_env(plan: ContainerPlan, layout: Layout) -> dict[str, str]:
    env = {
        **visible_env([d.card for d in plan.devices], [d.visible_uuid for d in plan.devices]),
        **limit_env(plan.devices),
        **mps_env(plan.devices, layout),
        **priority_env(plan.priority),
        "TESSERA_SHARED_REGION": f"{layout.region_container_dir}/{REGION_FILE}",
        "TESSERA_ALLOCATION": plan.name,
    }
    if layout.container_log_level:
        env["TESSERA_LOG_LEVEL"] = layout.container_log_level
    return env


def _shim_mounts(layout: Layout) -> list[dict[str, object]]:
    mounts: list[dict[str, object]] = [
        {
            "hostPath": str(layout.shim_library),
            "containerPath": layout.shim_container_path,
            "type": "bind",
            "options": ["ro", "nosuid", "nodev", "bind"],
        }
    ]
    if layout.preload:
        mounts.append(
            {
                "hostPath": str(layout.preload_file),
                "containerPath": "/etc/ld.so.preload",
                "type": "bind",
                "options": ["ro", "nosuid", "nodev", "bind"],
            }
        )
    return mounts


def cdi_spec(
    kind: str, plan: ContainerPlan, layout: Layout, control_devices: Sequence[str]
) -> dict[str, object]:
    """A CDI spec with one device, ``<kind>=<plan.name>``, giving exactly the plan's cards."""
    nodes: list[dict[str, object]] = [
        {
            "path": f"/dev/nvidia{d.card.minor}",
            "hostPath": str(layout.dev_root / f"nvidia{d.card.minor}"),
            "permissions": "rw",
        }
        for d in plan.devices
    ]
    nodes += [
        {"path": f"/dev/{c}", "hostPath": str(layout.dev_root / c), "permissions": "rw"}
        for c in control_devices
    ]
    for d in plan.devices:
        if d.mig_device is None:
            continue
        for minor in (d.mig_device.gi_minor, d.mig_device.ci_minor):
            cap = f"nvidia-caps/nvidia-cap{minor}"
            nodes.append(
                {"path": f"/dev/{cap}", "hostPath": str(layout.dev_root / cap), "permissions": "rw"}
            )
    env = container_env(plan, layout)
    mounts = [
        *_shim_mounts(layout),
        {
            "hostPath": str(layout.region_host_dir(plan.name)),
            "containerPath": layout.region_container_dir,
            "type": "bind",
            "options": ["rw", "nosuid", "nodev", "bind"],
        },
    ]
    if any(d.mode == MPS for d in plan.devices):
        mounts.append(
            {
                "hostPath": str(layout.mps_pipe_dir),
                "containerPath": layout.mps_container_dir,
                "type": "bind",
                "options": ["rw", "nosuid", "nodev", "bind"],
            }
        )
    return {
        "cdiVersion": CDI_VERSION,
        "kind": kind,
        "devices": [
            {
                "name": plan.name,
                "containerEdits": {
                    "env": [f"{k}={v}" for k, v in sorted(env.items())],
                    "deviceNodes": nodes,
                    "mounts": mounts,
                },
            }
        ],
    }


def cdi_file_name(kind: str, name: str) -> str:
    return f"{kind.replace('/', '_')}-{name}.json"


# --- host-path mode (runtimes without CDI) ---------------------------------------------------


@dataclass(frozen=True)
class PathsResponse:
    """What Allocate returns in host-path mode (before the pod is known)."""

    envs: dict[str, str]
    mounts: list[tuple[str, str, bool]]  # container path, host path, read-only
    devices: list[tuple[str, str, str]]  # container path, host path, permissions


def paths_order(cards: Sequence[Card]) -> list[Card]:
    """In host-path mode the ordinals are fixed at Allocate, before the pod is known: by index."""
    return sorted(cards, key=lambda c: c.index)


def paths_allocate(
    name: str, cards: Sequence[Card], layout: Layout, control_devices: Sequence[str]
) -> PathsResponse:
    """Allocate's answer: every card-specific or limit-carrying path is under the per-Allocate
    directory that only PreStartContainer creates, after it has verified the pod's record. If it
    refuses, those paths do not exist and the runtime fails to create the container."""
    ordered = paths_order(cards)
    base = layout.paths_dir(name)
    devices = [
        (f"/dev/nvidia{c.minor}", str(base / "dev" / f"nvidia{c.minor}"), "rw") for c in ordered
    ]
    devices += [(f"/dev/{c}", str(layout.dev_root / c), "rw") for c in control_devices]
    mounts = [
        (layout.config_container_dir, str(base / "config"), True),
        (layout.region_container_dir, str(layout.region_host_dir(name)), False),
        (layout.shim_container_path, str(layout.shim_library), True),
    ]
    if layout.preload:
        mounts.append(("/etc/ld.so.preload", str(layout.preload_file), True))
    envs = {
        "TESSERA_CONFIG": f"{layout.config_container_dir}/{CONFIG_FILE}",
        "TESSERA_SHARED_REGION": f"{layout.region_container_dir}/{REGION_FILE}",
        **visible_env(ordered),
        "TESSERA_ALLOCATION": name,
    }
    return PathsResponse(envs, mounts, devices)


def paths_config(plan: ContainerPlan, layout: Layout) -> str:
    """The ``TESSERA_CONFIG`` file for host-path mode: limits in the index order Allocate fixed."""
    by_uuid = {d.card.uuid: d for d in plan.devices}
    ordered = [by_uuid[c.uuid] for c in paths_order([d.card for d in plan.devices])]
    env = {**limit_env(ordered), **priority_env(plan.priority)}
    env["TESSERA_SHARED_REGION"] = f"{layout.region_container_dir}/{REGION_FILE}"
    if layout.container_log_level:
        env["TESSERA_LOG_LEVEL"] = layout.container_log_level
    lines = [f"# Tessera allocation {plan.name} for {plan.namespace}/{plan.pod} {plan.container}"]
    lines += [f"{k}={v}" for k, v in sorted(env.items())]
    return "\n".join(lines) + "\n"
