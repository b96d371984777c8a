"""The node plugin's calls on the API server: one pod (only for
TESSERA_ALLOCATION_SOURCE=annotation); in DRA mode, ResourceClaims read at prepare and the
node's ResourceSlices written (docs/dra.md)."""

from __future__ import annotations

import asyncio
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nodeplugin.http import JsonClient, TokenFile

RESOURCE_API = "/apis/resource.k8s.io/v1"


class KubeApiError(RuntimeError):
    pass


class KubeApiConflict(KubeApiError):
    """The object changed or appeared meanwhile (409): read again and redo."""


@dataclass(frozen=True)
class PodMeta:
    uid: str
    node_name: str
    annotations: dict[str, str]


class KubeApi:
    def __init__(
        self, base_url: str, token_file: Path, ca_file: Path | None, timeout_s: float
    ) -> None:
        self.http = JsonClient(base_url, TokenFile(token_file), ca_file, timeout_s)

    def _get_pod(self, namespace: str, name: str) -> PodMeta | None:
        q = urllib.parse.quote
        r = self.http.request(
            "GET", f"/api/v1/namespaces/{q(namespace, safe='')}/pods/{q(name, safe='')}"
        )
        if r.status == 404:
            return None
        if r.status != 200 or not isinstance(r.body, dict):
            raise KubeApiError(f"get pod {namespace}/{name}: API server answered {r.status}")
        meta = r.body.get("metadata") or {}
        spec = r.body.get("spec") or {}
        annotations = meta.get("annotations") or {}
        if not isinstance(annotations, dict):
            raise KubeApiError(f"pod {namespace}/{name}: metadata.annotations is not a map")
        return PodMeta(
            uid=str(meta.get("uid", "")),
            node_name=str(spec.get("nodeName", "")),
            annotations={str(k): str(v) for k, v in annotations.items()},
        )

    async def get_pod(self, namespace: str, name: str) -> PodMeta | None:
        return await asyncio.to_thread(self._get_pod, namespace, name)

    # -- DRA ------------------------------------------------------------------------------

    def _get_resource_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        q = urllib.parse.quote
        path = (
            f"{RESOURCE_API}/namespaces/{q(namespace, safe='')}/resourceclaims/{q(name, safe='')}"
        )
        r = self.http.request("GET", path)
        if r.status == 404:
            return None
        if r.status != 200 or not isinstance(r.body, dict):
            raise KubeApiError(
                f"get resourceclaim {namespace}/{name}: API server answered {r.status} "
                f"{r.error_text()}"
            )
        return r.body

    async def get_resource_claim(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The ResourceClaim as stored, or None when there is none by that name."""
        return await asyncio.to_thread(self._get_resource_claim, namespace, name)

    def _list_resource_slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        selector = urllib.parse.quote(f"spec.nodeName={node},spec.driver={driver}", safe="")
        r = self.http.request("GET", f"{RESOURCE_API}/resourceslices?fieldSelector={selector}")
        if r.status != 200 or not isinstance(r.body, dict):
            raise KubeApiError(
                f"list resourceslices: API server answered {r.status} {r.error_text()}"
            )
        items = r.body.get("items") or []
        return [i for i in items if isinstance(i, dict)]

    async def list_resource_slices(self, node: str, driver: str) -> list[dict[str, Any]]:
        """The ResourceSlices of ``driver`` on ``node``."""
        return await asyncio.to_thread(self._list_resource_slices, node, driver)

    def _write_slice(self, method: str, path: str, body: Any, what: str) -> dict[str, Any]:
        r = self.http.request(method, path, body)
        if r.status == 409:
            raise KubeApiConflict(f"{what}: {r.error_text()}")
        if r.status not in (200, 201) or not isinstance(r.body, dict):
            raise KubeApiError(f"{what}: API server answered {r.status} {r.error_text()}")
        return r.body

    async def create_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        return await asyncio.to_thread(
            self._write_slice,
            "POST",
            f"{RESOURCE_API}/resourceslices",
            body,
            f"create resourceslice {name}",
        )

    async def replace_resource_slice(self, body: dict[str, Any]) -> dict[str, Any]:
        """PUT: ``body`` carries the ``metadata.resourceVersion`` it replaces (409 otherwise)."""
        name = body["metadata"]["name"]
        path = f"{RESOURCE_API}/resourceslices/{urllib.parse.quote(name, safe='')}"
        return await asyncio.to_thread(
            self._write_slice, "PUT", path, body, f"update resourceslice {name}"
        )

    def _delete_resource_slice(self, name: str, uid: str) -> None:
        path = f"{RESOURCE_API}/resourceslices/{urllib.parse.quote(name, safe='')}"
        # The UID precondition: never delete a slice of the same name that another writer made.
        body = {"kind": "DeleteOptions", "apiVersion": "v1", "preconditions": {"uid": uid}}
        r = self.http.request("DELETE", path, body)
        if r.status == 409:
            raise KubeApiConflict(f"delete resourceslice {name}: {r.error_text()}")
        if r.status not in (200, 202, 404):
            raise KubeApiError(
                f"delete resourceslice {name}: API server answered {r.status} {r.error_text()}"
            )

    async def delete_resource_slice(self, name: str, uid: str) -> None:
        await asyncio.to_thread(self._delete_resource_slice, name, uid)
