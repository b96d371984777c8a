"""kube-scheduler's extender v1 JSON (k8s.io/kube-scheduler/extender/v1): read and write.

Keys are Go field names without JSON tags, capitalised (`Pod`, `NodeNames`); Go decodes keys
case-insensitively and schedulers before 1.16 sent lowercase ones, so input keys match in any
case. Answers always use the canonical capitalised spelling.

JSON goes through orjson: kube-scheduler sends the whole pod and up to hundreds of node names
to filter and to prioritize for every pod, and the answers carry as many names back; the
standard library's json took 6 % of the sidecar's GIL time for it, orjson less than half of
that. orjson refuses NaN and Infinity, which are not JSON (the standard library accepts them).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from controlplane.api.parsers import JSONTooDeep, check_json_depth
from controlplane.ledger.validation import (
    NAMESPACE_HELP,
    NODE_NAME_HELP,
    POD_NAME_HELP,
    is_namespace,
    is_node_name,
    is_pod_name,
)

MAX_NAME = 253
MAX_UID = 64


class WireError(ValueError):
    """Bad extender input: `field` names the key, `message` says what is wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def load_json(body: bytes) -> Any:
    """Decode the body; WireError for anything that is not UTF-8 JSON or nests too deeply."""
    if not body:
        raise WireError("body", "is empty; send the JSON object kube-scheduler sends")
    try:
        check_json_depth(body)
    except JSONTooDeep as exc:
        raise WireError("body", str(exc)) from None
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise WireError("body", f"is not JSON ({exc})") from None


def dump_json(value: Any) -> bytes:
    """Compact UTF-8 JSON of an answer (string keys only)."""
    return orjson.dumps(value)


def _fold(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, Mapping):
        raise WireError("body", f"must be a JSON object ({what})")
    return {str(k).lower(): v for k, v in obj.items()}


@dataclass(frozen=True, slots=True)
class ExtenderArgs:
    """Filter and prioritize input. `nodes` holds the v1.Node objects when the scheduler sent
    `Nodes` (not node-cache capable); the answer then carries `Nodes` too."""

    pod: dict[str, Any]
    node_names: list[str]
    nodes: list[dict[str, Any]] | None
    node_list: dict[str, Any] | None


def _node_name(value: Any, field: str) -> str:
    if not isinstance(value, str) or not value:
        raise WireError(field, "must be a non-empty string (a node name)")
    if len(value) > MAX_NAME:
        raise WireError(field, f"is {len(value)} characters long; a node name has at most 253")
    return value


def parse_extender_args(raw: Any) -> ExtenderArgs:
    args = _fold(raw, "ExtenderArgs")
    pod = args.get("pod")
    if pod is None:
        raise WireError("Pod", "is missing; the extender needs the pod being scheduled")
    if not isinstance(pod, Mapping):
        raise WireError("Pod", "must be a JSON object (a v1.Pod)")
    names_raw = args.get("nodenames")
    nodes_raw = args.get("nodes")
    if names_raw is not None:
        if not isinstance(names_raw, list):
            raise WireError("NodeNames", "must be a list of node names")
        # The common case checked at C speed; the slow loop only finds the culprit.
        lengths = list(map(len, names_raw)) if set(map(type, names_raw)) <= {str} else [0]
        if names_raw and not 0 < min(lengths) <= max(lengths) <= MAX_NAME:
            for i, v in enumerate(names_raw):
                _node_name(v, f"NodeNames[{i}]")
        return ExtenderArgs(dict(pod), names_raw, None, None)
    if nodes_raw is not None:
        if not isinstance(nodes_raw, Mapping):
            raise WireError("Nodes", "must be a v1.NodeList object")
        items = nodes_raw.get("items")
        if items is None:
            items = []
        if not isinstance(items, list):
            raise WireError("Nodes.items", "must be a list of v1.Node objects")
        names = []
        for i, node in enumerate(items):
            meta = node.get("metadata") if isinstance(node, Mapping) else None
            if not isinstance(meta, Mapping):
                raise WireError(f"Nodes.items[{i}].metadata", "must be an object with a name")
            names.append(_node_name(meta.get("name"), f"Nodes.items[{i}].metadata.name"))
        return ExtenderArgs(dict(pod), names, list(items), dict(nodes_raw))
    raise WireError(
        "NodeNames",
        "is missing; send NodeNames (nodeCacheCapable: true) or Nodes (a v1.NodeList)",
    )


@dataclass(frozen=True, slots=True)
class BindingArgs:
    pod_name: str
    namespace: str
    pod_uid: str
    node: str


def parse_binding_args(raw: Any) -> BindingArgs:
    args = _fold(raw, "ExtenderBindingArgs")

    def text(key: str, label: str, limit: int) -> str:
        value = args.get(key)
        if value is None:
            raise WireError(label, "is missing")
        if not isinstance(value, str) or not value:
            raise WireError(label, "must be a non-empty string")
        if len(value) > limit:
            raise WireError(label, f"is {len(value)} characters long; at most {limit}")
        return value

    name = text("podname", "PodName", MAX_NAME)
    namespace = text("podnamespace", "PodNamespace", 63)
    uid = text("poduid", "PodUID", MAX_UID)
    node = text("node", "Node", MAX_NAME)
    if not is_namespace(namespace):
        raise WireError("PodNamespace", f"{namespace!r} is not a namespace: {NAMESPACE_HELP}")
    if not is_node_name(node):
        raise WireError("Node", f"{node!r} is not a node name: {NODE_NAME_HELP}")
    if not is_pod_name(name):
        raise WireError("PodName", f"{name!r} is not a pod name: {POD_NAME_HELP}")
    return BindingArgs(name, namespace, uid, node)


MAX_VICTIM_NODES = 5000  # Kubernetes' largest cluster
MAX_VICTIMS = 1000  # per node: more pods than any node runs


@dataclass(frozen=True, slots=True)
class NodeVictims:
    """One candidate node of kube-scheduler's preemption: the pods it would evict there."""

    uids: tuple[str, ...]
    pdb_violations: int


@dataclass(frozen=True, slots=True)
class PreemptionArgs:
    """ExtenderPreemptionArgs: the preemptor and, per candidate node, kube-scheduler's victims
    (`NodeNameToMetaVictims` from a node-cache-capable scheduler, else `NodeNameToVictims` with
    whole pods; only their UIDs matter here)."""

    pod: dict[str, Any]
    victims: dict[str, NodeVictims]


def _victim_uid(pod: Any, where: str) -> str:
    if not isinstance(pod, Mapping):
        raise WireError(where, "must be an object")
    folded = {str(k).lower(): v for k, v in pod.items()}
    uid = folded.get("uid")
    if uid is None and isinstance(folded.get("metadata"), Mapping):
        uid = folded["metadata"].get("uid")
        where = f"{where}.metadata"
    if not isinstance(uid, str) or not uid or len(uid) > MAX_UID:
        raise WireError(
            f"{where}.UID", f"must be a pod UID (a string of 1 to {MAX_UID} characters)"
        )
    return uid


def parse_preemption_args(raw: Any) -> PreemptionArgs:
    args = _fold(raw, "ExtenderPreemptionArgs")
    pod = args.get("pod")
    if not isinstance(pod, Mapping):
        raise WireError("Pod", "must be the preemptor, a v1.Pod object")
    label = "NodeNameToMetaVictims"
    table = args.get("nodenametometavictims")
    if table is None:
        label, table = "NodeNameToVictims", args.get("nodenametovictims")
    if table is None:
        table = {}
    if not isinstance(table, Mapping):
        raise WireError(label, "must be an object: node name -> victims")
    if len(table) > MAX_VICTIM_NODES:
        raise WireError(label, f"names {len(table)} nodes; at most {MAX_VICTIM_NODES}")
    victims: dict[str, NodeVictims] = {}
    for node, entry in table.items():
        where = f"{label}[{node!r}]"
        _node_name(node, where)
        if not isinstance(entry, Mapping):
            raise WireError(where, "must be an object with Pods and NumPDBViolations")
        folded = {str(k).lower(): v for k, v in entry.items()}
        pods = folded.get("pods") or []
        if not isinstance(pods, list) or len(pods) > MAX_VICTIMS:
            raise WireError(f"{where}.Pods", f"must be a list of at most {MAX_VICTIMS} pods")
        violations = folded.get("numpdbviolations", 0) or 0
        if isinstance(violations, bool) or not isinstance(violations, int) or violations < 0:
            raise WireError(f"{where}.NumPDBViolations", "must be a non-negative integer")
        uids = tuple(_victim_uid(p, f"{where}.Pods[{i}]") for i, p in enumerate(pods))
        victims[node] = NodeVictims(uids, violations)
    return PreemptionArgs(dict(pod), victims)


def preemption_result(victims: Mapping[str, NodeVictims]) -> dict[str, Any]:
    """ExtenderPreemptionResult: the nodes kept, each with its (possibly larger) victim set."""
    return {
        "NodeNameToMetaVictims": {
            node: {"Pods": [{"UID": uid} for uid in v.uids], "NumPDBViolations": v.pdb_violations}
            for node, v in victims.items()
        }
    }


def filter_result(
    args: ExtenderArgs | None,
    feasible: list[str] | None,
    failed: Mapping[str, str] | None = None,
    unresolvable: Mapping[str, str] | None = None,
    error: str = "",
) -> dict[str, Any]:
    """ExtenderFilterResult; with `Nodes` input the feasible v1.Node objects come back too."""
    nodes: dict[str, Any] | None = None
    if args is not None and args.nodes is not None and feasible is not None:
        keep = set(feasible)
        items = [n for n, name in zip(args.nodes, args.node_names, strict=True) if name in keep]
        nodes = {**(args.node_list or {}), "items": items}
    return {
        "Nodes": nodes,
        "NodeNames": feasible,
        "FailedNodes": dict(failed) if failed else None,
        "FailedAndUnresolvableNodes": dict(unresolvable) if unresolvable else None,
        "Error": error,
    }


def host_priority_list(scores: Iterable[tuple[str, int]]) -> bytes:
    """HostPriorityList JSON, `[{"Host": ..., "Score": ...}]`."""
    return orjson.dumps([{"Host": h, "Score": int(s)} for h, s in scores])
