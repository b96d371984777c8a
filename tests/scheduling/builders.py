"""Plain builder functions for the scheduling core's tests."""

from __future__ import annotations

from typing import Any

from controlplane.scheduling import CardState, ContainerRequest, NodeState, PodRequest
from tests import pods

A100 = "NVIDIA A100-SXM4-80GB"
A100_MIB = 81920


def card(uuid: str = "GPU-0", index: int = 0, **kw: Any) -> CardState:
    """A healthy, empty 80 GiB card with 10 slots unless told otherwise."""
    values: dict[str, Any] = {
        "model": A100,
        "memory_mib": A100_MIB,
        "compute_units": 100,
        "slots": 10,
        "numa_node": 0,
        "healthy": True,
        "health_reason": "",
        "cordoned": False,
    }
    values.update(kw)
    return CardState(uuid=uuid, index=index, **values)


def node(name: str = "node-a", *cards: CardState, **kw: Any) -> NodeState:
    """A ready node holding ``cards`` (default: two empty A100s)."""
    if not cards:
        cards = (card(f"GPU-{name}-0", 0), card(f"GPU-{name}-1", 1))
    return NodeState(
        name=name,
        ready=kw.get("ready", True),
        cordoned=kw.get("cordoned", False),
        cards=tuple(cards),
    )


def container(
    name: str = "main",
    *,
    gpus: int = 1,
    memory_mib: int | None = 1024,
    memory_percent: int | None = None,
    cores: int = 0,
    index: int = 0,
    init: bool = False,
    sidecar: bool = False,
    priority: int | None = None,
) -> ContainerRequest:
    """One container's GPU ask (1 GPU, 1024 MiB, no compute limit by default)."""
    return ContainerRequest(
        name=name,
        index=index,
        init=init,
        gpus=gpus,
        memory_mib=memory_mib,
        memory_percent=memory_percent,
        cores=cores,
        sidecar=sidecar,
        priority=priority,
    )


def pod(*containers: ContainerRequest, **kw: Any) -> PodRequest:
    """A pod request; ``kw`` sets filters and policies."""
    return PodRequest(
        uid=kw.pop("uid", "uid-1"),
        namespace=kw.pop("namespace", "team-a"),
        name=kw.pop("name", "pod-1"),
        containers=containers or (container(),),
        **kw,
    )


def pod_json(
    *containers: dict[str, Any],
    init: tuple[dict[str, Any], ...] = (),
    annotations: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Kubernetes Pod JSON of the pod ml/trainer with these containers, init containers and
    annotations."""
    return pods.pod_json("trainer", "ml", "4f1c", list(containers), annotations, list(init))
