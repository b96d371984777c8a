"""The control plane's REST API as the node plugin uses it (docs/allocation.md, DESIGN §7)."""

from __future__ import annotations

import asyncio
import urllib.parse
from pathlib import Path
from typing import Any

from nodeplugin.allocation import Allocation, AllocationError, parse
from nodeplugin.http import HttpUnavailable, JsonClient, TokenFile


class ControlPlaneError(RuntimeError):
    """A definite answer that is not success (403, 409, 400...): do not retry blindly."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


ControlPlaneUnavailable = HttpUnavailable


def _q(part: str) -> str:
    return urllib.parse.quote(part, safe="")


class ControlPlane:
    def __init__(
        self, base_url: str, token_file: Path, ca_file: Path | None, timeout_s: float
    ) -> None:
        self.http = JsonClient(base_url, TokenFile(token_file), ca_file, timeout_s)

    def _put_inventory(self, node: str, report: dict[str, object]) -> dict[str, Any]:
        r = self.http.request("PUT", f"/api/v1/nodes/{_q(node)}/inventory", report)
        if r.status not in (200, 201):
            raise ControlPlaneError(
                r.status, f"inventory report for {node} refused ({r.status}): {r.error_text()}"
            )
        return r.body if isinstance(r.body, dict) else {}

    async def put_inventory(self, node: str, report: dict[str, object]) -> dict[str, Any]:
        """The answer, e.g. ``{"modes": {"<uuid>": "mig"}}`` (docs/card-modes.md)."""
        return await asyncio.to_thread(self._put_inventory, node, report)

    def _get_allocation(self, namespace: str, name: str) -> Allocation | None:
        r = self.http.request("GET", f"/api/v1/allocations/{_q(namespace)}/{_q(name)}")
        if r.status == 404:
            return None
        if r.status != 200:
            raise ControlPlaneError(
                r.status,
                f"allocation of {namespace}/{name}: control plane answered {r.status}: "
                f"{r.error_text()}",
            )
        try:
            return parse(r.body)
        except AllocationError as exc:
            raise ControlPlaneError(
                r.status, f"allocation of {namespace}/{name} from the control plane: {exc}"
            ) from None

    async def get_allocation(self, namespace: str, name: str) -> Allocation | None:
        return await asyncio.to_thread(self._get_allocation, namespace, name)

    def _post_allocated(self, pod_uid: str, container: str, devices: list[str]) -> None:
        path = f"/api/v1/allocations/{_q(pod_uid)}/containers/{_q(container)}/allocated"
        r = self.http.request("POST", path, {"devices": devices})
        if r.status not in (200, 201, 204):
            raise ControlPlaneError(
                r.status,
                f"recording {container} of pod {pod_uid} as allocated {devices}: control plane "
                f"answered {r.status}: {r.error_text()}",
            )

    async def post_allocated(self, pod_uid: str, container: str, devices: list[str]) -> None:
        await asyncio.to_thread(self._post_allocated, pod_uid, container, devices)
