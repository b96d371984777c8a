"""Who may call each REST operation, as the docs promise: the expectations of the schema sweep.

The table mirrors the documents, not the permission classes: docs/dashboard.md ("Roles per page
and endpoint": viewers read, operators write), docs/allocation.md ("REST (node identity)") and
docs/ledger.md ("Inventory reports", "Tokens and roles": `node` is a machine identity that holds
no human right, and no human role holds `node`'s). The sweep (tests/api/test_schemathesis.py)
asserts that the served API agrees, answer by answer.

This module imports nothing from the control plane: the schemathesis process loads it too, and
the expectations must not be read from the code they judge.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import unquote, urlsplit

NONE = "none"  # no credentials, or credentials the API does not accept
ROLES = (NONE, "viewer", "operator", "admin", "node")
READERS = frozenset({"viewer", "operator", "admin"})
WRITERS = frozenset({"operator", "admin"})


class NodeScope(StrEnum):
    """How a node identity is held to its own node on an operation it may call."""

    PATH = "path"  # the path's {name} is a node: another node's name is a 403, never a 2xx
    ANSWER = "answer"  # the answer's `node` is the pod's node: a pod bound elsewhere is a 403
    LEDGER = "ledger"  # another node's pod is not found for it (404, as if it had no binding);
    # the sweep then checks the ledger: nothing on another node changed


@dataclass(frozen=True)
class Access:
    roles: frozenset[str]
    node_scope: NodeScope | None = None
    public: bool = False


Operation = tuple[str, str]  # (method, path template as the schema spells it)

MATRIX: dict[Operation, Access] = {
    # docs/dashboard.md: "GET /api/v1/{quotas,nodes,cards,slices,bindings}/, /api/v1/quotas/<ns>/,
    # /api/v1/nodes/<name>/, /api/v1/cards/<uuid>/" - viewer, operator, admin.
    ("GET", "/api/v1/quotas/"): Access(READERS),
    ("GET", "/api/v1/quotas/{namespace}/"): Access(READERS),
    ("GET", "/api/v1/nodes/"): Access(READERS),
    ("GET", "/api/v1/nodes/{name}/"): Access(READERS),
    ("GET", "/api/v1/cards/"): Access(READERS),
    ("GET", "/api/v1/cards/{uuid}/"): Access(READERS),
    ("GET", "/api/v1/slices/"): Access(READERS),
    ("GET", "/api/v1/bindings/"): Access(READERS),
    # docs/dashboard.md: "POST /api/v1/quotas/, PUT/PATCH/DELETE /api/v1/quotas/<ns>/" and the
    # cordons - 403 for a viewer, yes for operator and admin.
    ("POST", "/api/v1/quotas/"): Access(WRITERS),
    ("PUT", "/api/v1/quotas/{namespace}/"): Access(WRITERS),
    ("PATCH", "/api/v1/quotas/{namespace}/"): Access(WRITERS),
    ("DELETE", "/api/v1/quotas/{namespace}/"): Access(WRITERS),
    ("POST", "/api/v1/nodes/{name}/cordon/"): Access(WRITERS),
    ("POST", "/api/v1/nodes/{name}/uncordon/"): Access(WRITERS),
    ("POST", "/api/v1/cards/{uuid}/cordon/"): Access(WRITERS),
    ("POST", "/api/v1/cards/{uuid}/uncordon/"): Access(WRITERS),
    # docs/card-modes.md, "Changing a card's mode": operator or admin.
    ("POST", "/api/v1/cards/{uuid}/mode/"): Access(WRITERS),
    # docs/virtual-memory.md: a card's factor is set as its other settings are, operator or admin.
    ("POST", "/api/v1/cards/{uuid}/memory-oversubscription/"): Access(WRITERS),
    # docs/operator-guide.md, "A pod stays Pending": a viewer token asks why.
    ("GET", "/api/v1/pods/{namespace}/{name}/why"): Access(READERS),
    # docs/allocation.md, "REST": a node identity reads allocations on its own node (403
    # otherwise), people from the viewer role up; it reports what a container got on its own
    # node, and an admin may report for any node.
    ("GET", "/api/v1/allocations/{namespace}/{name}"): Access(
        READERS | {"node"}, node_scope=NodeScope.ANSWER
    ),
    ("POST", "/api/v1/allocations/{pod_uid}/containers/{container}/allocated"): Access(
        frozenset({"node", "admin"}), node_scope=NodeScope.LEDGER
    ),
    # docs/ledger.md, "Inventory reports": a node identity reports only the node of its own name;
    # an admin may report any node; viewers and operators may not.
    ("PUT", "/api/v1/nodes/{name}/inventory"): Access(
        frozenset({"node", "admin"}), node_scope=NodeScope.PATH
    ),
}


def access_of(operation: Operation) -> Access | None:
    """The documented access of `operation`; OPTIONS on a route (docs/dashboard.md) describes it
    to whoever may call one of the route's operations, for any object. None: no operation."""
    method, path = operation
    if method != "OPTIONS":
        return MATRIX.get(operation)
    rules = [access for (_, p), access in MATRIX.items() if p == path]
    if not rules:
        return None
    roles = frozenset().union(*(access.roles for access in rules))
    return Access(roles, public=any(access.public for access in rules))


def may_call(role: str, operation: Operation) -> bool:
    """Whether the docs let `role` past the role check of `operation` (for some object)."""
    access = access_of(operation)
    return access is not None and (access.public or role in access.roles)


def route_parameters(template: str, url: str) -> dict[str, str] | None:
    """The path parameters of `url` as the server's router reads them, or None when the path
    does not reach the route of `template` at all (a parameter with a `/` in it, say): each
    parameter is one non-empty segment, percent-decoded."""
    pattern = re.sub(r"\\\{(\w+)\\\}", r"(?P<\1>[^/]+)", re.escape(template))
    match = re.fullmatch(pattern, unquote(urlsplit(url).path))
    return None if match is None else match.groupdict()


@dataclass(frozen=True)
class Answer:
    """One answer of the API, as the role check sees it."""

    role: str  # the role whose credentials the request carried (NONE without valid ones)
    status: int
    parameters: dict[str, str]  # path parameters as routed
    body: object  # the decoded JSON body, or None


INPUT_ERRORS = {400, 413, 415}


def violation(
    operation: Operation, answer: Answer, own_node: str, foreign_pods: frozenset[str] = frozenset()
) -> str | None:
    """Why `answer` breaks the documented access of `operation`, or None when it keeps it.

    A caller without credentials gets 401 on every operation that is not public; a role the
    docs do not list gets 403; a role they list is never refused (no 401, no 403), except that a
    node identity is refused another node's objects where the docs say so (NodeScope);
    `foreign_pods` are the UIDs of pods bound on other nodes.
    """
    access = access_of(operation)
    assert access is not None, operation
    role, status = answer.role, answer.status
    ok = 200 <= status < 300
    if access.public:
        return None
    if role == NONE:
        return None if status == 401 else f"no credentials: expected 401, got {status}"
    if role not in access.roles:
        return None if status == 403 else f"role {role} may not call it: expected 403, got {status}"
    if status == 401:
        return f"role {role} may call this, but its valid token was refused with 401"
    if role != "node" or access.node_scope is None:
        return f"role {role} may call this, but got 403" if status == 403 else None
    if access.node_scope is NodeScope.PATH:
        if answer.parameters.get("name") == own_node:
            return f"node {own_node} was refused its own node" if status == 403 else None
        if ok:
            return f"node {own_node} got {status} for node {answer.parameters.get('name')!r}"
        return None
    if access.node_scope is NodeScope.ANSWER:
        if ok:
            node = answer.body.get("node") if isinstance(answer.body, dict) else None
            if node != own_node:
                return f"node {own_node} got {status} for a record on node {node!r}"
        return None
    if answer.parameters.get("pod_uid") in foreign_pods and status not in INPUT_ERRORS | {404}:
        return f"node {own_node} got {status} for a pod of another node, not 404"
    return f"node {own_node} got 403 where other nodes' objects are 404s" if status == 403 else None


def must_show(role: str, operation: Operation) -> tuple[bool, bool]:
    """Which sides of `operation`'s role boundary a sweep as `role` must show at least once: let
    past the role check, refused. A node identity on a path-scoped operation shows both: its own
    node let past, another node refused."""
    access = MATRIX[operation]
    allowed = may_call(role, operation)
    scoped = role == "node" and access.node_scope is NodeScope.PATH
    return allowed, not allowed or scoped


def let_past(operation: Operation, answer: Answer, own_node: str) -> bool:
    """Whether `answer` shows its role let past the role check of `operation`: neither 401 nor
    403, and for a node identity on a path-scoped operation, on its own node."""
    access = MATRIX[operation]
    if answer.status in (401, 403):
        return False
    if answer.role == "node" and access.node_scope is NodeScope.PATH:
        return answer.parameters.get("name") == own_node
    return True
