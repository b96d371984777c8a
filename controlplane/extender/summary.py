"""The sentence filter records for a pod: how many nodes can hold it and why the others cannot,
in plain words (no I/O here). Where a pod stands overall is `controlplane.ledger.why`."""

from __future__ import annotations

from collections.abc import Mapping

from controlplane.scheduling import PodRequest, ReasonCode

# code -> (one node ..., several nodes ...)
_PHRASES: dict[str, tuple[str, str]] = {
    ReasonCode.INSUFFICIENT_MEMORY: ("lacks free GPU memory", "lack free GPU memory"),
    ReasonCode.INSUFFICIENT_COMPUTE: ("lacks free GPU compute", "lack free GPU compute"),
    ReasonCode.NO_FREE_SLOT: (
        "has no free slice slot on a card with room",
        "have no free slice slot on a card with room",
    ),
    ReasonCode.EXCLUSIVE_CONFLICT: (
        "has no card free of an exclusive (100% compute) slice, or idle for a 100% or mutex ask",
        "have no card free of an exclusive (100% compute) slice, or idle for a 100% or mutex ask",
    ),
    ReasonCode.TYPE_EXCLUDED: (
        "has only GPU models the pod's gputype annotations exclude",
        "have only GPU models the pod's gputype annotations exclude",
    ),
    ReasonCode.UUID_EXCLUDED: (
        "has only GPUs the pod's gpuuuid annotations exclude",
        "have only GPUs the pod's gpuuuid annotations exclude",
    ),
    ReasonCode.UNHEALTHY: ("has only unhealthy GPUs", "have only unhealthy GPUs"),
    ReasonCode.CARD_CORDONED: ("has only cordoned GPUs", "have only cordoned GPUs"),
    ReasonCode.NODE_CORDONED: ("is cordoned", "are cordoned"),
    ReasonCode.NODE_NOT_READY: (
        "is not ready (its node plugin stopped reporting)",
        "are not ready (their node plugins stopped reporting)",
    ),
    ReasonCode.NO_CARDS: ("has no GPUs known to Tessera", "have no GPUs known to Tessera"),
    ReasonCode.TOO_FEW_CARDS: (
        "has too few cards with room for all the pod's GPUs",
        "have too few cards with room for all the pod's GPUs",
    ),
    ReasonCode.QUOTA_EXCEEDED: ("is refused by the namespace quota", "are refused by the quota"),
    ReasonCode.MODE_MISMATCH: (
        "has no card in the mode the pod's nvidia.com/vgpu-mode asks for",
        "have no card in the mode the pod's nvidia.com/vgpu-mode asks for",
    ),
    ReasonCode.CARD_DRAINING: (
        "has only GPUs draining for a mode change",
        "have only GPUs draining for a mode change",
    ),
    ReasonCode.MIG_NOT_ENABLED: (
        "has MIG-mode GPUs on which MIG is not yet enabled",
        "have MIG-mode GPUs on which MIG is not yet enabled",
    ),
    ReasonCode.NO_MIG_PLACEMENT: (
        "has no MIG card with a free placement of the profile the pod needs",
        "have no MIG card with a free placement of the profile the pod needs",
    ),
    ReasonCode.UNKNOWN_NODE: (
        "is not registered with Tessera (no node plugin reported it)",
        "are not registered with Tessera (no node plugin reported them)",
    ),
}


def memory_need(request: PodRequest) -> str:
    """The largest per-GPU memory ask, as a person wrote it ("3000 MiB", "25% of ...")."""
    absolute = [c for c in request.containers if c.memory_mib is not None]
    if absolute:
        return max(absolute, key=lambda c: c.memory_mib or 0).describe_memory()
    return request.containers[0].describe_memory()


def _count(n: int, code: str) -> str:
    one, many = _PHRASES.get(code, (f"refuse it ({code})", f"refuse it ({code})"))
    return f"{n} node {one}" if n == 1 else f"{n} nodes {many}"


def sentence(
    considered: int,
    feasible: int,
    counts: Mapping[str, int],
    *,
    need: str,
    largest_free_mib: int | None,
) -> str:
    """E.g. "0 of 1000 nodes can hold it: 940 nodes lack free GPU memory (largest free slice
    2048 MiB, it needs 3000 MiB per GPU); 60 nodes are cordoned." """
    head = f"{feasible} of {considered} node{'' if considered == 1 else 's'} can hold it"
    parts = []
    for code, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        text = _count(n, code)
        if code == ReasonCode.INSUFFICIENT_MEMORY and largest_free_mib is not None:
            text += f" (largest free slice {largest_free_mib} MiB, it needs {need} per GPU)"
        parts.append(text)
    if not parts:
        return head + "."
    return f"{head}: {'; '.join(parts)}."
