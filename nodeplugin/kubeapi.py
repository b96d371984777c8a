"""Read one pod from the API server (only for TESSERA_ALLOCATION_SOURCE=annotation)."""

from __future__ import annotations

import asyncio
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from nodeplugin.http import JsonClient, TokenFile


class KubeApiError(RuntimeError):
    pass


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
