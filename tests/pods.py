"""Kubernetes Pod JSON for the tests: the one place a pod or a container is built as the API
server and kube-scheduler send it. Plain dicts, no Django, so any test can use them.

(A pod for the real cluster of the e2e harness, with its kwok node selector, is e2e/objects.py's
`gpu_pod`.)
"""

from __future__ import annotations

from typing import Any


def container(
    name: str = "main",
    limits: dict[str, Any] | None = None,
    requests: dict[str, Any] | None = None,
    *,
    image: str = "busybox",
    **extra: Any,
) -> dict[str, Any]:
    """A container with these limits and requests (each left out when None)."""
    resources: dict[str, Any] = {}
    if limits is not None:
        resources["limits"] = limits
    if requests is not None:
        resources["requests"] = requests
    return {"name": name, "image": image, "resources": resources, **extra}


def gpu_container(
    name: str = "c", gpus: int = 1, mem: int | None = None, cores: int | None = None
) -> dict[str, Any]:
    """A container asking for `gpus` slices of `mem` MiB and `cores` percent (DESIGN §3)."""
    limits: dict[str, Any] = {"nvidia.com/gpu": gpus}
    if mem is not None:
        limits["nvidia.com/gpumem"] = mem
    if cores is not None:
        limits["nvidia.com/gpucores"] = cores
    return {"name": name, "resources": {"limits": limits}}


def pod_json(
    name: str = "p",
    namespace: str = "default",
    uid: str | None = None,
    containers: list[dict[str, Any]] | None = None,
    annotations: dict[str, str] | None = None,
    init_containers: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A v1 Pod with these containers (and init containers, when given)."""
    spec: dict[str, Any] = {"containers": containers or []}
    if init_containers:
        spec["initContainers"] = init_containers
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{namespace}-{name}",
            "annotations": annotations or {},
        },
        "spec": spec,
    }


def gpu_pod(
    name: str = "p",
    namespace: str = "default",
    *,
    gpus: int = 1,
    mem: int | None = 1000,
    cores: int | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A pod of one GPU container, for Tessera's scheduler profile."""
    pod = pod_json(
        name,
        namespace,
        containers=[gpu_container("main", gpus=gpus, mem=mem, cores=cores)],
        annotations=annotations,
    )
    pod["spec"]["schedulerName"] = "tessera-scheduler"
    return pod
