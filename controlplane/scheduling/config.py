"""Configuration of the scheduling core: resource names and defaults.

Both classes are plain frozen values so the control plane can build them once from its
settings and pass them around; nothing here reads the environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BINPACK = "binpack"
SPREAD = "spread"
#: The node policies, and the GPU policies that order cards by the room they leave.
POLICIES: tuple[str, ...] = (BINPACK, SPREAD)
#: What else a GPU policy may name (HAMi's words; docs/scheduling.md section 1): ``numa`` orders
#: cards by NUMA node, ``mutex`` keeps the pod off cards that hold any slice, ``topology-aware``
#: asks for the best-connected cards (Tessera has no link data: it places as without it).
NUMA = "numa"
MUTEX = "mutex"
TOPOLOGY_AWARE = "topology-aware"
GPU_POLICY_WORDS: tuple[str, ...] = (BINPACK, SPREAD, NUMA, MUTEX, TOPOLOGY_AWARE)

#: Upper bounds that turn obviously wrong input into an error instead of a pod that can
#: never be placed (or an integer overflow in a downstream C shim).
MAX_GPUS_PER_CONTAINER = 64
MAX_MEMORY_MIB = 16 * 1024 * 1024  # 16 TiB expressed in MiB


@dataclass(frozen=True, slots=True)
class ResourceNames:
    """Names of the extended resources Tessera manages; the defaults match HAMi."""

    gpu: str = "nvidia.com/gpu"
    gpumem: str = "nvidia.com/gpumem"
    gpumem_percentage: str = "nvidia.com/gpumem-percentage"
    gpucores: str = "nvidia.com/gpucores"
    # A container's task priority (HAMi: 0 high, 1 low). Not a GPU ask by itself, but
    # kube-scheduler must ignore it like the others: no node advertises it.
    priority: str = "nvidia.com/priority"

    def __post_init__(self) -> None:
        names = self.all()
        if any(not n for n in names):
            raise ValueError("resource names must be non-empty strings")
        if len(set(names)) != len(names):
            raise ValueError(f"resource names must be distinct, got {names}")

    def all(self) -> tuple[str, ...]:
        """Every managed name, in a fixed order (gpu, gpumem, gpumem-percentage, gpucores,
        priority): what the scheduler profile lists as managedResources."""
        return (self.gpu, self.gpumem, self.gpumem_percentage, self.gpucores, self.priority)


@dataclass(frozen=True, slots=True)
class SchedulingConfig:
    """Cluster-wide defaults applied when a pod does not say.

    ``default_memory_mib`` wins over ``default_memory_percent``; when both are ``None`` a
    slice without a memory request takes the whole card's memory (HAMi's behaviour).
    ``default_cores`` 0 means "no compute limit": the slice shares compute best effort.
    ``default_vgpu_modes``: the card modes (HAMi's names) of a pod without
    ``nvidia.com/vgpu-mode``; empty means "hami-core". ``mig_resources``: whether NVIDIA's
    ``nvidia.com/mig-<profile>`` resources are Tessera's to serve (docs/card-modes.md).
    """

    resources: ResourceNames = field(default_factory=ResourceNames)
    default_memory_mib: int | None = None
    default_memory_percent: int | None = None
    default_cores: int = 0
    default_node_policy: str = BINPACK
    default_gpu_policy: str = SPREAD
    default_vgpu_modes: tuple[str, ...] = ()
    mig_resources: bool = False

    def __post_init__(self) -> None:
        known = ("hami-core", "mig", "mps")
        if any(m not in known for m in self.default_vgpu_modes):
            raise ValueError(
                f"default_vgpu_modes must be among {', '.join(known)}, "
                f"got {self.default_vgpu_modes}"
            )
        if self.default_memory_mib is not None and not (
            1 <= self.default_memory_mib <= MAX_MEMORY_MIB
        ):
            raise ValueError(
                f"default_memory_mib must be between 1 and {MAX_MEMORY_MIB}, "
                f"got {self.default_memory_mib}"
            )
        if self.default_memory_percent is not None and not (
            1 <= self.default_memory_percent <= 100
        ):
            raise ValueError(
                f"default_memory_percent must be between 1 and 100, "
                f"got {self.default_memory_percent}"
            )
        if not 0 <= self.default_cores <= 100:
            raise ValueError(f"default_cores must be between 0 and 100, got {self.default_cores}")
        for label, value in (
            ("default_node_policy", self.default_node_policy),
            ("default_gpu_policy", self.default_gpu_policy),
        ):
            if value not in POLICIES:
                raise ValueError(f"{label} must be one of {POLICIES}, got {value!r}")
