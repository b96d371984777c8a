"""Where the plugin gets a pod's allocation record: the control plane, or a signed annotation,
or the control plane with the signed annotation when the control plane does not answer.

Either way the record is checked against what the kubelet says (pod name, namespace) and this
node's name before anything is written.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from nodeplugin import allocation
from nodeplugin.allocation import Allocation, AllocationError
from nodeplugin.controlplane import ControlPlane, ControlPlaneError
from nodeplugin.http import HttpUnavailable
from nodeplugin.kubeapi import KubeApi, KubeApiError

log = logging.getLogger(__name__)


class SourceUnavailable(RuntimeError):
    """The source could not answer before the deadline (the caller refuses; kubelet retries)."""


class NoAllocation(RuntimeError):
    """The pod has no active Tessera allocation."""


class AllocationSource(Protocol):
    async def fetch(self, namespace: str, name: str, deadline: float) -> Allocation: ...


async def _retry(what: str, deadline: float, attempt: object) -> object:
    delay = 0.05
    last = ""
    while True:
        try:
            return await attempt()  # type: ignore[operator]
        except HttpUnavailable as exc:
            last = str(exc)
        if time.monotonic() + delay >= deadline:
            raise SourceUnavailable(
                f"{what}: {last}; gave up at the deadline (will be retried "
                "when the kubelet starts the container again)"
            )
        log.warning("%s: %s; retrying in %.2fs", what, last, delay)
        await asyncio.sleep(delay)
        delay = min(delay * 2, 1.0)


class ControlPlaneSource:
    def __init__(self, cp: ControlPlane, node: str) -> None:
        self.cp = cp
        self.node = node

    async def fetch(self, namespace: str, name: str, deadline: float) -> Allocation:
        async def attempt() -> Allocation | None:
            return await self.cp.get_allocation(namespace, name)

        try:
            result = await _retry(f"GET allocation of {namespace}/{name}", deadline, attempt)
        except ControlPlaneError as exc:
            raise AllocationError(str(exc)) from None
        if result is None:
            raise NoAllocation(
                f"the control plane has no active allocation for pod {namespace}/{name} "
                "(was it scheduled by tessera-scheduler?)"
            )
        assert isinstance(result, Allocation)
        allocation.check_identity(result, namespace, name, self.node)
        return result


class AnnotationSource:
    def __init__(self, kube: KubeApi, key: bytes, node: str) -> None:
        self.kube = kube
        self.key = key
        self.node = node

    async def fetch(self, namespace: str, name: str, deadline: float) -> Allocation:
        async def attempt() -> object:
            return await self.kube.get_pod(namespace, name)

        try:
            pod = await _retry(f"GET pod {namespace}/{name}", deadline, attempt)
        except KubeApiError as exc:
            raise SourceUnavailable(str(exc)) from None
        if pod is None:
            raise NoAllocation(f"pod {namespace}/{name} is not in the API server")
        from nodeplugin.kubeapi import PodMeta

        assert isinstance(pod, PodMeta)
        record = allocation.from_annotations(pod.annotations, self.key)
        if record is None:
            raise NoAllocation(
                f"pod {namespace}/{name} carries no {allocation.ANNOTATION} annotation"
            )
        allocation.check_identity(record, namespace, name, self.node)
        if record.pod_uid != pod.uid:
            raise AllocationError(
                f"the signed record of {namespace}/{name} is for pod UID {record.pod_uid}, "
                f"not the current pod {pod.uid}"
            )
        return record


class FallbackSource:
    """The control plane first; when it does not answer within ``wait_s``, the pod's signed
    annotation. So GPU containers start and restart while the control plane is away: the
    same record is on the pod, signed with the control plane's key. An answer from the
    control plane is final, whatever it says: a pod the ledger has no binding for (released,
    never scheduled by Tessera) is not started from an older annotation."""

    def __init__(
        self, primary: AllocationSource, fallback: AllocationSource, wait_s: float
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.wait_s = wait_s

    async def fetch(self, namespace: str, name: str, deadline: float) -> Allocation:
        soon = min(deadline, time.monotonic() + self.wait_s)
        try:
            return await self.primary.fetch(namespace, name, soon)
        except SourceUnavailable as exc:
            if time.monotonic() >= deadline:
                raise
            log.warning(
                "the control plane did not answer for %s/%s (%s); taking the pod's signed "
                "allocation annotation from the API server",
                namespace,
                name,
                exc,
            )
        return await self.fallback.fetch(namespace, name, deadline)
