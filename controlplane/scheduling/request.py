"""What a pod asks for: parsing Kubernetes Pod JSON into a :class:`PodRequest`.

Every error names the offending field as a dotted path, so the admission webhook and the
extender can hand the sentence straight back to the person who wrote the manifest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from controlplane.scheduling.claims import EXCLUSIVE_CORES
from controlplane.scheduling.config import (
    BINPACK,
    GPU_POLICY_WORDS,
    MAX_GPUS_PER_CONTAINER,
    MAX_MEMORY_MIB,
    MUTEX,
    NUMA,
    POLICIES,
    SPREAD,
    SchedulingConfig,
)
from controlplane.scheduling.memory import MIB, PERCENT, WHOLE, memory_ask, sizer, slice_mib
from controlplane.scheduling.mig import GEOMETRIES
from controlplane.scheduling.quantity import parse_quantity
from controlplane.scheduling.state import EXCLUSIVE, MIG, MPS, SHARED

ANN_USE_TYPE = "nvidia.com/use-gputype"
ANN_NOUSE_TYPE = "nvidia.com/nouse-gputype"
ANN_USE_UUID = "nvidia.com/use-gpuuuid"
ANN_NOUSE_UUID = "nvidia.com/nouse-gpuuuid"
ANN_NODE_POLICY = "tessera.io/node-policy"
ANN_GPU_POLICY = "tessera.io/gpu-policy"
ANN_HAMI_NODE_POLICY = "hami.io/node-scheduler-policy"
ANN_HAMI_GPU_POLICY = "hami.io/gpu-scheduler-policy"
ANN_NUMA_BIND = "nvidia.com/numa-bind"
ANN_VGPU_MODE = "nvidia.com/vgpu-mode"
#: The pod's opt-in to virtual device memory (docs/virtual-memory.md): "true" or "false".
ANN_MEMORY_OVERSUBSCRIPTION = "tessera.io/memory-oversubscription"

#: HAMi's names for the card modes a pod accepts (nvidia.com/vgpu-mode): "hami-core" is a
#: shared card, or an exclusive one for a slice that is the whole card (docs/card-modes.md).
SHARED_MODE = "hami-core"
VGPU_MODES: tuple[str, ...] = (SHARED_MODE, "mig", "mps")
#: NVIDIA's per-profile resources (nvidia.com/mig-3g.40gb), served where the setting says.
MIG_RESOURCE_PREFIX = "nvidia.com/mig-"
#: Task priorities (nvidia.com/priority): 0 high, 1 low.
PRIORITIES: tuple[int, ...] = (0, 1)
# strconv.ParseBool's spellings, which HAMi reads nvidia.com/numa-bind with.
_TRUE = ("1", "t", "true")
_FALSE = ("0", "f", "false")

_DEFAULT_CONFIG = SchedulingConfig()


class RequestError(ValueError):
    """Bad pod input. ``field`` is a dotted path; ``message`` says what is wrong and the fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """The GPU part of one container.

    ``index`` is the position in ``spec.containers`` (or ``spec.initContainers`` when
    ``init``). Memory per slice is ``memory_mib`` if set, else ``memory_percent`` of the
    chosen card's memory (rounded down), else the whole card. ``sidecar`` marks an init
    container with ``restartPolicy: Always``: it keeps running beside every later init
    container and the app containers. ``priority`` is the task priority asked with
    ``nvidia.com/priority`` (0 high, 1 low), None when not asked.
    """

    name: str
    index: int
    init: bool
    gpus: int
    memory_mib: int | None
    memory_percent: int | None
    cores: int
    sidecar: bool = False
    priority: int | None = None
    mig_profile: str | None = None  # asked by name (nvidia.com/mig-<profile>): MIG cards only

    def __post_init__(self) -> None:
        if not 1 <= self.gpus <= MAX_GPUS_PER_CONTAINER:
            raise ValueError(f"gpus must be 1..{MAX_GPUS_PER_CONTAINER}, got {self.gpus}")
        if self.memory_mib is not None and not 1 <= self.memory_mib <= MAX_MEMORY_MIB:
            raise ValueError(f"memory_mib must be 1..{MAX_MEMORY_MIB}, got {self.memory_mib}")
        if self.memory_percent is not None and not 1 <= self.memory_percent <= 100:
            raise ValueError(f"memory_percent must be 1..100, got {self.memory_percent}")
        if not 0 <= self.cores <= 100:
            raise ValueError(f"cores must be 0..100, got {self.cores}")
        if self.index < 0:
            raise ValueError(f"index must not be negative, got {self.index}")
        if self.sidecar and not self.init:
            raise ValueError("only an init container can be a sidecar")
        if self.priority is not None and self.priority not in PRIORITIES:
            raise ValueError(f"priority must be 0 (high) or 1 (low), got {self.priority}")

    def memory_on(self, card_memory_mib: int) -> int:
        """MiB one slice of this container takes on a card with ``card_memory_mib`` in total."""
        kind, value = memory_ask(self.memory_mib, self.memory_percent)
        return slice_mib(kind, value, card_memory_mib)

    def describe_memory(self) -> str:
        """The memory ask as a person wrote it: "3000 MiB", "25% of the card", "a whole card"."""
        if self.memory_mib is not None:
            return f"{self.memory_mib} MiB"
        if self.memory_percent is not None:
            return f"{self.memory_percent}% of the card's memory"
        return "the whole card's memory"


class ContainerPlan:
    """One container's ask in the shape the filter's loops want (internal to the core).

    ``kind`` and ``value``: the memory ask (:func:`~controlplane.scheduling.memory.memory_ask`);
    ``need(card_mib)``: the MiB one slice takes on a card of that size
    (:func:`~controlplane.scheduling.memory.sizer`).
    ``strict``: the slice takes only a card that holds no slice yet (it asks 100% compute, or
    the pod's GPU policy is ``mutex``). ``whole``: memory and compute of the whole card (the
    one slice an exclusive-mode card takes).
    """

    __slots__ = (
        "cores", "gpus", "init", "kind", "mig_profile", "need", "oversub", "request", "sidecar",
        "strict", "value", "whole",
    )  # fmt: skip

    def __init__(
        self, request: ContainerRequest, mutex: bool = False, oversub: bool = False
    ) -> None:
        self.request = request
        self.init = request.init
        self.sidecar = request.sidecar
        self.gpus = request.gpus
        self.cores = request.cores
        self.strict = request.cores >= EXCLUSIVE_CORES or mutex
        self.kind, self.value = memory_ask(request.memory_mib, request.memory_percent)
        self.need: Callable[[int], int] = sizer(self.kind, self.value)
        self.whole = self.kind != MIB and self.value == 100 and self.cores >= EXCLUSIVE_CORES
        self.mig_profile = request.mig_profile
        # The container's slices may spill (the pod opted in to virtual device memory). Not an
        # ordinary init container's: it runs alone, briefly, and is resident in full, so what a
        # pod spills on a node is what its app containers and sidecars spill together.
        self.oversub = oversub and (not request.init or request.sidecar)


@dataclass(frozen=True, slots=True)
class Policy:
    """How the pod's cards are chosen and its nodes scored (``gpu_policy``, ``node_policy``,
    numa-bind), in the form the greedy reads.

    ``numa_order`` 0: no NUMA key; 1: NUMA node before the room left; 2: after it.
    ``numa_bind``: a container's slices on one NUMA node (only set when some container has 2+
    GPUs). ``mutex``: every slice takes only a card that holds none.
    """

    gpu_binpack: bool
    node_binpack: bool
    numa_order: int
    numa_bind: bool
    mutex: bool

    @classmethod
    def of(cls, request: PodRequest) -> Policy:
        words = request.gpu_policy.split(",")
        binpack = BINPACK in words
        if NUMA not in words:
            order = 0
        else:
            room = words.index(BINPACK if binpack else SPREAD)
            order = 1 if words.index(NUMA) < room else 2
        numa_bind = request.numa_bind and any(c.gpus > 1 for c in request.containers)
        return cls(binpack, request.node_policy == BINPACK, order, numa_bind, MUTEX in words)


@dataclass(frozen=True, slots=True)
class CardFilter:
    """The pod's include/exclude annotations on cards (use/nouse-gputype, use/nouse-gpuuuid).

    Models repeat across a cluster, and so do whole nodes' lists of models: ``type_memo``
    keeps the verdict per lower-cased model, ``mask_memo`` per node's models (the filter's
    per-card masks).
    """

    use_types: tuple[str, ...]
    nouse_types: tuple[str, ...]
    use_uuids: frozenset[str]
    nouse_uuids: frozenset[str]
    type_memo: dict[str, bool] = field(default_factory=dict)
    mask_memo: dict[str, tuple[bool, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, request: PodRequest) -> CardFilter | None:
        """The pod's card filter; None when it names no card."""
        if not (
            request.use_types or request.nouse_types or request.use_uuids or request.nouse_uuids
        ):
            return None
        return cls(
            request.use_types,
            request.nouse_types,
            frozenset(request.use_uuids),
            frozenset(request.nouse_uuids),
        )

    def type_allowed(self, model_l: str) -> bool:
        """Whether a card model (lower-cased) passes use-gputype / nouse-gputype."""
        hit = self.type_memo.get(model_l)
        if hit is None:
            hit = (not self.use_types or any(t in model_l for t in self.use_types)) and not any(
                t in model_l for t in self.nouse_types
            )
            self.type_memo[model_l] = hit
        return hit


@dataclass(frozen=True, slots=True)
class Stack:
    """One slice of EVERY app container on one card at once: what a card must hold for the
    filter to prove a node feasible in one pass over its cards (fastcheck.py).

    ``mib`` sums the absolute asks, ``percents`` lists the percent asks, ``wholes`` counts the
    whole-card asks. ``cores`` keeps 1% over for an app container that asks 0% after the
    others took theirs: a card whose compute ends up fully booked takes no 0% slice after
    that. ``exclusive``: some app container is strict (no stack can hold it). ``cards``: the
    most GPUs one app container asks.
    """

    mib: int
    percents: tuple[int, ...]
    wholes: int
    cores: int
    exclusive: bool
    cards: int

    @classmethod
    def of(cls, apps: tuple[ContainerPlan, ...]) -> Stack:
        cores = before = 0
        for c in apps:
            if c.cores == 0:
                cores = before + 1  # the prefix only grows: the last 0% container decides
            before += c.cores
        return cls(
            mib=sum(c.value for c in apps if c.kind == MIB),
            percents=tuple(c.value for c in apps if c.kind == PERCENT),
            wholes=sum(1 for c in apps if c.kind == WHOLE),
            cores=max(cores, before),
            exclusive=any(c.strict for c in apps),
            cards=max((c.gpus for c in apps), default=0),
        )


@dataclass(frozen=True, slots=True)
class AbsApps:
    """Two or more app containers, all with absolute memory, none exclusive, plain
    binpack/spread: the common multi-container shape, which the filter runs on packed keys.

    ``asks``: (MiB, cores, GPUs) per app container; the rest are the node-wide necessary
    conditions: the largest ask and the totals.
    """

    asks: tuple[tuple[int, int, int], ...]
    max_mib: int
    total_mib: int
    slices: int
    max_cores: int
    compute: int

    @classmethod
    def of(cls, apps: tuple[ContainerPlan, ...]) -> AbsApps:
        return cls(
            asks=tuple((c.value, c.cores, c.gpus) for c in apps),
            max_mib=max(c.value for c in apps),
            total_mib=sum(c.value * c.gpus for c in apps),
            slices=sum(c.gpus for c in apps),
            max_cores=max(c.cores for c in apps),
            compute=sum(c.cores * c.gpus for c in apps),
        )


class Plan:
    """A :class:`PodRequest` compiled once for the filter's hot loops (internal to the core).

    Per-container shapes, and named records of what the filter reads: ``policy`` (how cards
    are chosen), ``cards`` (the card filter, None when the pod names no card), ``stack`` (one
    slice of every app container on one card, which lets the filter prove most nodes feasible
    with one pass over their cards), ``abs_apps`` (the packed-keys shape, None for others) and
    ``single`` (the container of a one-container, one-slice pod on plain binpack/spread).

    The rarer asks turn the fast shapes off: ``mutex``, a NUMA order of cards, numa-bind and
    sidecar init containers make the filter take the general path or the greedy itself
    (``greedy_only``: numa-bind or a sidecar).

    ``lanes``: the card modes the pod may use, in the order they are tried (a pod's slices all
    go to cards of one mode): from ``nvidia.com/vgpu-mode``, "hami-core" being the shared
    lane, preceded by the exclusive lane when every slice is the whole card.
    """

    __slots__ = (
        "abs_apps",
        "apps",
        "cards",
        "containers",
        "greedy_only",
        "inits",
        "lanes",
        "oversub",
        "policy",
        "single",
        "stack",
    )

    def __init__(self, request: PodRequest) -> None:
        policy = self.policy = Policy.of(request)
        opted = request.memory_oversubscription
        self.containers = tuple(ContainerPlan(c, policy.mutex, opted) for c in request.containers)
        # Some slice may spill: on a node with a card whose factor is above 1 the filter runs
        # the greedy with the three budgets (fastcheck.py); elsewhere nothing changes.
        self.oversub = any(c.oversub for c in self.containers)
        self.inits = tuple(c for c in self.containers if c.init)
        self.apps = apps = tuple(c for c in self.containers if not c.init)
        self.greedy_only = policy.numa_bind or any(c.sidecar for c in self.containers)
        self.lanes = _lanes(request.vgpu_modes, self.containers)
        self.cards = CardFilter.of(request)
        # The fast shapes below assume plain binpack/spread over independent cards, and
        # ignore card filters: with filters the filter first works out which cards the pod
        # may use, and uses these shapes when that is all of them.
        plain = not (policy.mutex or policy.numa_order or self.greedy_only)
        only = self.containers[0] if len(self.containers) == 1 else None
        self.single = only if plain and only is not None and only.gpus == 1 else None
        self.stack = Stack.of(apps)
        simple = plain and all(c.kind == MIB and not c.strict for c in apps)
        self.abs_apps = AbsApps.of(apps) if simple and len(apps) >= 2 else None

    def peak(self, value: Callable[[ContainerPlan], int]) -> int:
        """The most of ``value`` (a per-container amount) the pod holds at any one time.

        Kubernetes' rule for a pod's effective request, sidecars included: the app phase
        holds every app container and every sidecar; an ordinary init container runs alone
        beside the sidecars started before it. So the peak is the larger of (app containers +
        sidecars) and, over ordinary init containers, (that container + earlier sidecars).
        Per card, claims.claims_per_card folds recorded slices by the same rule.
        """
        steady = sidecars = init_peak = 0
        for c in self.containers:
            amount = value(c)
            if not c.init or c.sidecar:
                steady += amount
                if c.sidecar:
                    sidecars += amount
            else:
                init_peak = max(init_peak, amount + sidecars)
        return max(steady, init_peak)

    @property
    def shared_only(self) -> bool:
        """The pod uses shared cards only (every pod that does not say otherwise)."""
        return self.lanes == _SHARED_LANE


_SHARED_LANE = (SHARED,)


def _lanes(vgpu_modes: tuple[str, ...], containers: tuple[ContainerPlan, ...]) -> tuple[str, ...]:
    """The card modes a pod may use, in the order tried (Plan.lanes)."""
    if any(c.mig_profile for c in containers):
        return (MIG,)
    if not vgpu_modes or vgpu_modes == (SHARED_MODE,):
        if all(c.whole for c in containers):
            return (EXCLUSIVE, SHARED)
        return _SHARED_LANE
    lanes: list[str] = []
    for mode in vgpu_modes:
        if mode == SHARED_MODE:
            if all(c.whole for c in containers):
                lanes.append(EXCLUSIVE)
            lanes.append(SHARED)
        else:
            lanes.append(MIG if mode == "mig" else MPS)
    return tuple(lanes)


@dataclass(frozen=True, slots=True)
class PodRequest:
    """Everything the core needs to know about a pod's GPU ask.

    ``containers`` holds only containers that ask for a managed resource, init containers
    first (``init=True``) in spec order, then app containers. Type filters are lower-cased
    substrings of the card model; uuid filters are lower-cased exact uuids. ``gpu_policy`` is
    a comma list in canonical form (:func:`gpu_policy_chain`): exactly one of binpack/spread,
    with numa, mutex and topology-aware where asked. ``numa_bind``: each container's cards on
    one NUMA node. ``vgpu_modes``: the card modes the pod accepts (empty: any).
    ``memory_oversubscription``: the pod opted in to virtual device memory (its slices may
    spill to host memory past their resident part, docs/virtual-memory.md).
    """

    uid: str
    namespace: str
    name: str
    containers: tuple[ContainerRequest, ...]
    use_types: tuple[str, ...] = ()
    nouse_types: tuple[str, ...] = ()
    use_uuids: tuple[str, ...] = ()
    nouse_uuids: tuple[str, ...] = ()
    node_policy: str = BINPACK
    gpu_policy: str = SPREAD
    numa_bind: bool = False
    vgpu_modes: tuple[str, ...] = ()
    # The pod's spec.priority (from its PriorityClass) and whether its preemptionPolicy is
    # Never: what preemption weighs (docs/preemption.md).
    pod_priority: int = 0
    preempt_never: bool = False
    memory_oversubscription: bool = False
    plan: Plan = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for label in (
            "containers", "use_types", "nouse_types", "use_uuids", "nouse_uuids", "vgpu_modes"
        ):  # fmt: skip
            value = getattr(self, label)
            if not isinstance(value, tuple):
                object.__setattr__(self, label, tuple(value))
        if not self.containers:
            raise ValueError("a PodRequest needs at least one container")
        if self.node_policy not in POLICIES:
            raise ValueError(f"node_policy must be one of {POLICIES}, got {self.node_policy!r}")
        policy = self.gpu_policy
        if policy not in POLICIES and gpu_policy_chain(policy, SPREAD) != policy:
            raise ValueError(
                f"gpu_policy must be a canonical chain of {', '.join(GPU_POLICY_WORDS)} naming "
                f"one of binpack and spread, got {self.gpu_policy!r}"
            )
        for label in ("use_types", "nouse_types", "use_uuids", "nouse_uuids"):
            if any(v != v.lower() or not v for v in getattr(self, label)):
                raise ValueError(f"{label} must hold non-empty lower-case strings")
        if self.vgpu_modes and any(m not in VGPU_MODES for m in self.vgpu_modes):
            raise ValueError(f"vgpu_modes must be among {VGPU_MODES}, got {self.vgpu_modes}")
        object.__setattr__(self, "plan", Plan(self))

    @property
    def shape(self) -> tuple[Any, ...]:
        """Everything the pod asks but who it is and its priority: every node gives two pods of
        one shape the same answer (the key of the filter's per-snapshot memos)."""
        return tuple(getattr(self, label) for label in _SHAPE_FIELDS)

    @property
    def total_slices(self) -> int:
        """Number of slices over all containers, init ones included."""
        return sum(c.gpus for c in self.containers)

    def peak(self, value: Callable[[ContainerRequest], int]) -> int:
        """The most of ``value`` (a per-container amount) the pod holds at any one time
        (:meth:`Plan.peak`: app containers with sidecars, or an init container with the
        sidecars before it)."""
        return self.plan.peak(lambda cp: value(cp.request))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able form, stored in the ledger; :meth:`from_dict` reads it back."""
        return {
            "uid": self.uid,
            "namespace": self.namespace,
            "name": self.name,
            "containers": [
                {
                    "name": c.name,
                    "index": c.index,
                    "init": c.init,
                    "sidecar": c.sidecar,
                    "gpus": c.gpus,
                    "memory_mib": c.memory_mib,
                    "memory_percent": c.memory_percent,
                    "cores": c.cores,
                    "priority": c.priority,
                    **({"mig_profile": c.mig_profile} if c.mig_profile else {}),
                }
                for c in self.containers
            ],
            "use_types": list(self.use_types),
            "nouse_types": list(self.nouse_types),
            "use_uuids": list(self.use_uuids),
            "nouse_uuids": list(self.nouse_uuids),
            "node_policy": self.node_policy,
            "gpu_policy": self.gpu_policy,
            "numa_bind": self.numa_bind,
            "vgpu_modes": list(self.vgpu_modes),
            "pod_priority": self.pod_priority,
            "preempt_never": self.preempt_never,
            # only when asked: the stored request of every other pod stays as it is
            **({"memory_oversubscription": True} if self.memory_oversubscription else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PodRequest:
        """Rebuild a request from :meth:`to_dict` output; RequestError names a bad key.

        Keys added after the first version (``sidecar``, ``priority``, ``numa_bind``,
        ``vgpu_modes``, ``pod_priority``, ``preempt_never``, ``memory_oversubscription``) may
        be missing: requests stored before them still load.
        """
        if not isinstance(d, Mapping):
            raise RequestError("", "a stored pod request must be a JSON object")
        containers_raw = _get_typed(d, "containers", list, "")
        containers = []
        for i, raw in enumerate(containers_raw):
            path = f"containers[{i}]"
            if not isinstance(raw, Mapping):
                raise RequestError(path, "must be an object")
            try:
                containers.append(
                    ContainerRequest(
                        name=_get_typed(raw, "name", str, path),
                        index=_get_typed(raw, "index", int, path),
                        init=_get_typed(raw, "init", bool, path),
                        gpus=_get_typed(raw, "gpus", int, path),
                        memory_mib=_get_optional_int(raw, "memory_mib", path),
                        memory_percent=_get_optional_int(raw, "memory_percent", path),
                        cores=_get_typed(raw, "cores", int, path),
                        sidecar=_get_typed(raw, "sidecar", bool, path, False),
                        priority=_get_optional_int(raw, "priority", path),
                        mig_profile=_get_typed(raw, "mig_profile", str, path, None),
                    )
                )
            except ValueError as exc:
                if isinstance(exc, RequestError):
                    raise
                raise RequestError(path, str(exc)) from exc
        lists = {
            key: tuple(_get_str_list(d, key))
            for key in ("use_types", "nouse_types", "use_uuids", "nouse_uuids", "vgpu_modes")
        }
        try:
            return cls(
                uid=_get_typed(d, "uid", str, ""),
                namespace=_get_typed(d, "namespace", str, ""),
                name=_get_typed(d, "name", str, ""),
                containers=tuple(containers),
                node_policy=_get_typed(d, "node_policy", str, ""),
                gpu_policy=_get_typed(d, "gpu_policy", str, ""),
                numa_bind=_get_typed(d, "numa_bind", bool, "", False),
                pod_priority=_get_typed(d, "pod_priority", int, "", 0),
                preempt_never=_get_typed(d, "preempt_never", bool, "", False),
                memory_oversubscription=_get_typed(d, "memory_oversubscription", bool, "", False),
                **lists,
            )
        except RequestError:
            raise
        except ValueError as exc:
            raise RequestError("", str(exc)) from exc


def gpu_policy_chain(value: str, default: str) -> str:
    """A GPU policy as a canonical comma list, or ValueError saying what is accepted.

    HAMi reads ``hami.io/gpu-scheduler-policy`` as an ordered comma list (util.PolicyContains,
    policy.gpuSortKeyChain): binpack, spread and numa are sort keys in the order written,
    mutex and topology-aware are conditions. Items are trimmed and lower-cased, empty items
    and repeats dropped. Of binpack and spread the first named wins (the other could only
    break ties the first already broke); with neither, ``default`` is added at the end.
    """
    words: list[str] = []
    for part in value.split(","):
        word = part.strip().lower()
        if not word or word in words:
            continue
        if word not in GPU_POLICY_WORDS:
            raise ValueError(
                f"{part.strip()!r} is not a GPU policy; use one of {', '.join(GPU_POLICY_WORDS)}, "
                "or several separated by commas (e.g. 'binpack,numa')"
            )
        if word in POLICIES and any(w in POLICIES for w in words):
            continue
        words.append(word)
    if not words:
        raise ValueError(f"names no policy; use one of {', '.join(GPU_POLICY_WORDS)}")
    if not any(w in POLICIES for w in words):
        words.append(default)
    return ",".join(words)


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


_REQUIRED: Any = object()


def _get_typed(
    d: Mapping[str, Any], key: str, kind: type[Any], prefix: str, default: Any = _REQUIRED
) -> Any:
    if key not in d:
        if default is not _REQUIRED:
            return default
        raise RequestError(_join(prefix, key), "is missing")
    value = d[key]
    # bool is an int subclass; an int field must not silently accept true/false.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(_join(prefix, key), f"must be a {kind.__name__}")
    return value


def _get_optional_int(d: Mapping[str, Any], key: str, prefix: str) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise RequestError(_join(prefix, key), "must be an integer or null")
    return value


def _get_str_list(d: Mapping[str, Any], key: str) -> list[str]:
    value = d.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RequestError(key, "must be a list of strings")
    return value


# --------------------------------------------------------------------------- parsing


def parse_pod(
    pod: Mapping[str, Any], config: SchedulingConfig = _DEFAULT_CONFIG
) -> PodRequest | None:
    """Parse Kubernetes Pod JSON; None when no container asks for a managed resource.

    Raises :class:`RequestError` (naming the field) for malformed or impossible asks.
    """
    if not isinstance(pod, Mapping):
        raise RequestError("", "the pod must be a JSON object")
    metadata = _mapping(pod, "metadata", "")
    spec = _mapping(pod, "spec", "")
    annotations = _mapping(metadata, "annotations", "metadata")

    containers: list[ContainerRequest] = []
    for list_key, init in (("initContainers", True), ("containers", False)):
        raw_list = spec.get(list_key)
        if raw_list is None:
            continue
        if not isinstance(raw_list, Sequence) or isinstance(raw_list, str):
            raise RequestError(f"spec.{list_key}", "must be a list of containers")
        for i, raw in enumerate(raw_list):
            parsed = _parse_container(raw, f"spec.{list_key}[{i}]", i, init, config)
            if parsed is not None:
                containers.append(parsed)
    if not containers:
        return None

    def text(key: str) -> str:
        value = _annotation(annotations, key)
        return "" if value is None else value

    asked = _vgpu_modes(annotations)
    if any(c.mig_profile for c in containers) and asked and "mig" not in asked:
        raise RequestError(
            f"metadata.annotations.{ANN_VGPU_MODE}",
            f"is {','.join(asked)} but a container asks for a {MIG_RESOURCE_PREFIX}<profile> "
            "resource, which only a MIG card serves; add mig or remove the annotation",
        )

    return PodRequest(
        uid=_optional_str(metadata, "uid", "metadata"),
        namespace=_optional_str(metadata, "namespace", "metadata") or "default",
        name=_optional_str(metadata, "name", "metadata")
        or _optional_str(metadata, "generateName", "metadata"),
        containers=tuple(containers),
        use_types=_split(text(ANN_USE_TYPE)),
        nouse_types=_split(text(ANN_NOUSE_TYPE)),
        use_uuids=_split(text(ANN_USE_UUID)),
        nouse_uuids=_split(text(ANN_NOUSE_UUID)),
        node_policy=_policy(
            annotations, ANN_NODE_POLICY, ANN_HAMI_NODE_POLICY, config.default_node_policy
        ),
        gpu_policy=_gpu_policy(annotations, config.default_gpu_policy),
        numa_bind=_numa_bind(annotations),
        vgpu_modes=asked or config.default_vgpu_modes,
        pod_priority=_pod_priority(spec),
        preempt_never=_preempt_never(spec),
        memory_oversubscription=_memory_oversubscription(annotations),
    )


# A PriorityClass value is an int32; the API server fills spec.priority from it.
_INT32 = (-(1 << 31), (1 << 31) - 1)


def _pod_priority(spec: Mapping[str, Any]) -> int:
    value = spec.get("priority")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not _INT32[0] <= value <= _INT32[1]:
        raise RequestError("spec.priority", f"must be a 32-bit integer, got {value!r}")
    return value


def _preempt_never(spec: Mapping[str, Any]) -> bool:
    value = spec.get("preemptionPolicy")
    if value is None or value == "PreemptLowerPriority":
        return False
    if value == "Never":
        return True
    raise RequestError(
        "spec.preemptionPolicy", f"must be PreemptLowerPriority or Never, got {value!r}"
    )


def _mapping(parent: Mapping[str, Any], key: str, prefix: str) -> Mapping[str, Any]:
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError(_join(prefix, key), "must be an object")
    return value


def _optional_str(parent: Mapping[str, Any], key: str, prefix: str) -> str:
    value = parent.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise RequestError(_join(prefix, key), "must be a string")
    return value


def _annotation(annotations: Mapping[str, Any], key: str) -> str | None:
    value = annotations.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise RequestError(f"metadata.annotations.{key}", "must be a string")
    return value


def _split(value: str) -> tuple[str, ...]:
    """A comma list, trimmed and lower-cased, empties and repeats dropped, order kept."""
    seen: dict[str, None] = {}
    for part in value.split(","):
        item = part.strip().lower()
        if item:
            seen[item] = None
    return tuple(seen)


def _policy(annotations: Mapping[str, Any], own: str, alias: str, default: str) -> str:
    # Tessera's own annotation wins; HAMi's spelling keeps existing manifests working.
    for key in (own, alias):
        value = _annotation(annotations, key)
        if value is None:
            continue
        policy = value.strip().lower()
        if policy not in POLICIES:
            raise RequestError(
                f"metadata.annotations.{key}",
                f"must be 'binpack' or 'spread', got {value!r}",
            )
        return policy
    return default


def _gpu_policy(annotations: Mapping[str, Any], default: str) -> str:
    for key in (ANN_GPU_POLICY, ANN_HAMI_GPU_POLICY):
        value = _annotation(annotations, key)
        if value is None:
            continue
        plain = value.strip().lower()
        if plain in POLICIES:  # the common case, already canonical
            return plain
        try:
            return gpu_policy_chain(value, default)
        except ValueError as exc:
            raise RequestError(f"metadata.annotations.{key}", str(exc)) from None
    return default


def _numa_bind(annotations: Mapping[str, Any]) -> bool:
    value = _annotation(annotations, ANN_NUMA_BIND)
    if value is None:
        return False
    word = value.strip().lower()
    if word in _TRUE or word in _FALSE:
        return word in _TRUE
    raise RequestError(
        f"metadata.annotations.{ANN_NUMA_BIND}",
        f"must be 'true' or 'false', got {value!r}",
    )


def _memory_oversubscription(annotations: Mapping[str, Any]) -> bool:
    """The pod's opt-in: exactly "true" or "false" (any case, spaces trimmed); anything else is
    refused, since a typo that silently kept a pod resident (or let it spill) would surprise
    its owner."""
    value = _annotation(annotations, ANN_MEMORY_OVERSUBSCRIPTION)
    if value is None:
        return False
    word = value.strip().lower()
    if word in ("true", "false"):
        return word == "true"
    raise RequestError(
        f"metadata.annotations.{ANN_MEMORY_OVERSUBSCRIPTION}",
        f'must be "true" or "false", got {value!r}',
    )


def _vgpu_modes(annotations: Mapping[str, Any]) -> tuple[str, ...]:
    value = _annotation(annotations, ANN_VGPU_MODE)
    if value is None:
        return ()
    modes = _split(value)
    unknown = [m for m in modes if m not in VGPU_MODES]
    if unknown or not modes:
        raise RequestError(
            f"metadata.annotations.{ANN_VGPU_MODE}",
            f"must name card modes among {', '.join(VGPU_MODES)} (comma-separated), got {value!r}",
        )
    return modes


def _parse_container(
    raw: object, path: str, index: int, init: bool, config: SchedulingConfig
) -> ContainerRequest | None:
    if not isinstance(raw, Mapping):
        raise RequestError(path, "must be an object")
    resources = _mapping(raw, "resources", path)
    limits = _mapping(resources, "limits", f"{path}.resources")
    requests = _mapping(resources, "requests", f"{path}.resources")
    names = config.resources

    def lookup(resource: str) -> tuple[int, str] | None:
        # Per resource: limits first, then requests (Kubernetes copies one into the other
        # for extended resources, but a manifest may set only one of them).
        for source, table in (("limits", limits), ("requests", requests)):
            if resource in table:
                where = f"{path}.resources.{source}.{resource}"
                try:
                    return parse_quantity(table[resource]), where
                except ValueError as exc:
                    raise RequestError(where, str(exc)) from exc
        return None

    gpu = lookup(names.gpu)
    profile = _mig_profile(limits, requests, path, lookup) if config.mig_resources else None
    if profile is not None and profile[1] == 0:
        profile = None  # "nvidia.com/mig-1g.10gb: 0" asks for nothing
    if profile is not None:
        gpu = _gpus_for_profile(gpu, profile)
    mem = lookup(names.gpumem)
    pct = lookup(names.gpumem_percentage)
    cores = lookup(names.gpucores)
    others = [
        resource
        for resource, found in (
            (names.gpumem, mem),
            (names.gpumem_percentage, pct),
            (names.gpucores, cores),
        )
        if found is not None
    ]
    if gpu is not None and gpu[0] == 0:
        if not others:
            return None  # "nvidia.com/gpu: 0" alone asks for nothing
        raise RequestError(
            gpu[1],
            f"is 0 while {', '.join(others)} is set; "
            "ask for at least 1 GPU or remove the other GPU resources",
        )
    if gpu is None and not others:
        return None
    if profile is not None and others:
        raise RequestError(
            f"{path}.resources.limits.{MIG_RESOURCE_PREFIX}{profile[0]}",
            f"names a MIG profile, whose memory and compute are fixed; remove {', '.join(others)}",
        )

    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError(f"{path}.name", "a container that asks for GPUs needs a name")
    # A restartable init container (Kubernetes' sidecar) keeps running beside every later init
    # container and the app containers: its slices are held to the end (PodRequest.peak).
    sidecar = init and raw.get("restartPolicy") == "Always"
    # The priority is no GPU ask on its own: a container that names only it gets no GPU (HAMi
    # hands it none either), so it is read once the container is known to ask for one.
    asked = lookup(names.priority)
    if asked is not None and asked[0] not in PRIORITIES:
        raise RequestError(asked[1], f"must be 0 (high) or 1 (low), got {asked[0]}")

    gpus = 1 if gpu is None else gpu[0]
    if gpu is not None and gpus > MAX_GPUS_PER_CONTAINER:
        raise RequestError(
            gpu[1], f"asks for {gpus} GPUs; at most {MAX_GPUS_PER_CONTAINER} per container"
        )
    memory_mib: int | None = None
    memory_percent: int | None = None
    if mem is not None:
        if mem[0] < 1:
            raise RequestError(mem[1], "must be at least 1 (MiB per GPU)")
        if mem[0] > MAX_MEMORY_MIB:
            raise RequestError(
                mem[1],
                f"asks for {mem[0]} MiB per GPU, more than {MAX_MEMORY_MIB} MiB (16 TiB); "
                "the value is in MiB, so write 1024 for 1 GiB",
            )
        memory_mib = mem[0]
    elif pct is not None and pct[0] != 0:
        if not 1 <= pct[0] <= 100:
            raise RequestError(pct[1], f"must be a percentage from 0 to 100, got {pct[0]}")
        memory_percent = pct[0]
    else:
        # gpumem-percentage 0 counts as not given (HAMi: the whole card, or the default).
        memory_mib = config.default_memory_mib
        if memory_mib is None:
            memory_percent = config.default_memory_percent
    if cores is not None and not 0 <= cores[0] <= 100:
        raise RequestError(cores[1], f"must be a percentage from 0 to 100, got {cores[0]}")
    return ContainerRequest(
        name=name,
        index=index,
        init=init,
        gpus=gpus,
        memory_mib=memory_mib,
        memory_percent=memory_percent,
        cores=config.default_cores if cores is None else cores[0],
        sidecar=sidecar,
        priority=None if asked is None else asked[0],
        mig_profile=None if profile is None else profile[0],
    )


def _mig_profile(
    limits: Mapping[str, Any],
    requests: Mapping[str, Any],
    path: str,
    lookup: Callable[[str], tuple[int, str] | None],
) -> tuple[str, int, str] | None:
    """The container's ``nvidia.com/mig-<profile>: N`` as (profile, N, field), or None."""
    keys = sorted({k for k in (*limits, *requests) if k.startswith(MIG_RESOURCE_PREFIX)})
    if not keys:
        return None
    if len(keys) > 1:
        raise RequestError(
            f"{path}.resources",
            f"asks for {', '.join(keys)}; a container takes instances of one MIG profile",
        )
    found = lookup(keys[0])
    assert found is not None
    name = keys[0][len(MIG_RESOURCE_PREFIX) :].lower()
    if not _known_profile(name):
        raise RequestError(
            found[1], f"names MIG profile {name!r}, which no GPU model Tessera knows has"
        )
    return name, found[0], found[1]


def _known_profile(name: str) -> bool:
    return any(g.profile(name) is not None for g in GEOMETRIES)


def _gpus_for_profile(
    gpu: tuple[int, str] | None, profile: tuple[str, int, str]
) -> tuple[int, str] | None:
    """The container's GPU count given its MIG profile ask: N instances are N GPUs. The
    webhook adds ``nvidia.com/gpu: N`` beside it; a different count is a contradiction."""
    name, count, where = profile
    if gpu is not None and gpu[0] != count:
        raise RequestError(
            gpu[1], f"is {gpu[0]} but {MIG_RESOURCE_PREFIX}{name} asks for {count} instances"
        )
    return (count, where) if gpu is None else gpu


# PodRequest's fields that say what is asked (a field added later is in unless named here).
_SHAPE_FIELDS = tuple(
    f.name
    for f in fields(PodRequest)
    if f.init and f.name not in {"uid", "namespace", "name", "pod_priority", "preempt_never"}
)
