"""The kubelet's PodResources API (v1): which pod and container hold a set of device IDs."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from nodeplugin.pb import pr
from nodeplugin.rpc import PodResourcesClient, unix_target


class PodResourcesError(RuntimeError):
    pass


@dataclass(frozen=True)
class ContainerHolding:
    namespace: str
    pod: str
    container: str
    device_ids: frozenset[str]


class PodResources:
    def __init__(self, socket: Path, resource_name: str) -> None:
        self.socket = socket
        self.resource = resource_name
        self._channel: grpc.aio.Channel | None = None

    def _client(self) -> PodResourcesClient:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(unix_target(str(self.socket)))
        return PodResourcesClient(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def list(self, deadline: float) -> list[ContainerHolding]:
        """Every listed container with the IDs of our resource it holds (maybe none).

        Retries ResourceExhausted (the kubelet rate-limits this API) and a socket that is not
        there yet until ``deadline`` (a ``time.monotonic()`` value).
        """
        delay = 0.02
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PodResourcesError(
                    f"PodResources List on {self.socket} did not answer in time"
                )
            try:
                resp: pr.ListPodResourcesResponse = await self._client().List(
                    pr.ListPodResourcesRequest(), timeout=min(remaining, 5.0)
                )
                break
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                if code not in (
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise PodResourcesError(
                        f"PodResources List on {self.socket} failed: {code.name} {exc.details()}"
                    ) from None
                if time.monotonic() + delay >= deadline:
                    raise PodResourcesError(
                        f"PodResources List on {self.socket}: {code.name} {exc.details()} "
                        "(kubelet down or rate-limiting); gave up at the deadline"
                    ) from None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 0.5)
        out: list[ContainerHolding] = []
        for pod in resp.pod_resources:
            for c in pod.containers:
                ids: set[str] = set()
                for dev in c.devices:
                    if dev.resource_name == self.resource:
                        ids.update(dev.device_ids)
                out.append(ContainerHolding(pod.namespace, pod.name, c.name, frozenset(ids)))
        return out
