"""Helpers for DRA mode's webhook tests: the JSON patch it answers applied as the API server
applies it, and the claim a pod's template makes, read back per container."""

from __future__ import annotations

import base64
import copy
import json
from typing import Any


def apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """RFC 6902 'add' (with '/-' appending to a list), 'replace' and 'remove'."""
    out = copy.deepcopy(doc)
    for op in ops:
        assert op["op"] in ("add", "replace", "remove"), op
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        target: Any = out
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            if op["op"] == "remove":
                del target[int(last)]
            elif last == "-":
                target.append(op["value"])
            elif op["op"] == "add":
                target.insert(int(last), op["value"])
            else:
                target[int(last)] = op["value"]
        elif op["op"] == "remove":
            del target[last]
        else:
            assert op["op"] == "add" or last in target, f"replace of a missing {op['path']}"
            target[last] = op["value"]
    return out


def decode_patch(answer: dict[str, Any]) -> list[dict[str, Any]]:
    if "patch" not in answer:
        return []
    assert answer["patchType"] == "JSONPatch"
    ops: list[dict[str, Any]] = json.loads(base64.b64decode(answer["patch"]))
    return ops


def claims_by_container(
    pod: dict[str, Any], templates: dict[str, dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Per container name: the device request of the claim its `resources.claims` names, from
    the template the pod's `spec.resourceClaims` entry points at (``templates``: name -> the
    template's spec). Checks the container names exactly one request of Tessera's claims."""
    entries = {e["name"]: e for e in pod["spec"].get("resourceClaims") or []}
    out: dict[str, dict[str, Any]] = {}
    for key in ("initContainers", "containers"):
        for c in pod["spec"].get(key) or []:
            claims = (c.get("resources") or {}).get("claims") or []
            ours = [n for n in claims if n["name"].startswith("tessera-gpu-")]
            if not ours:
                continue
            (named,) = ours
            template = templates[entries[named["name"]]["resourceClaimTemplateName"]]
            devices = template["spec"]["devices"]
            (request,) = [r for r in devices["requests"] if r["name"] == named["request"]]
            out[c["name"]] = {"request": request, "constraints": devices.get("constraints", [])}
    return out
