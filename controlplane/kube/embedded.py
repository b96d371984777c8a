"""The embedded stand-in for the Kubernetes API (DESIGN §7): pods and bindings in the database.

A demo and test aid, never a production mode: `make run` on a bare machine (and the tests) drive
the real extender and bind code paths against it. `EmbeddedClusterSource` is the reconciler's
view of it (`controlplane.kube.sources`).
"""

from __future__ import annotations

import copy
import json
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from django.db import IntegrityError, transaction

from controlplane import rawsql
from controlplane.kube.base import KubeError, WatchEvent, timed
from controlplane.kube.models import (
    EmbeddedObject,
    EmbeddedObjectEvent,
    EmbeddedPod,
    EmbeddedPodEvent,
)
from controlplane.kube.sources import (
    ClaimEvent,
    PodEvent,
    claim_view,
    pod_view,
    published_devices,
)
from controlplane.ledger.selectors import node_names

log = logging.getLogger(__name__)


def _now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _json_value(value: Any) -> Any:
    """A JSON column as read by a plain cursor: text on both backends (Django decodes it only
    for model fields)."""
    return json.loads(value) if isinstance(value, str | bytes) else value


@rawsql.per_vendor
def _stand_in_sql() -> dict[str, str]:
    """The stand-in's hot statements (reading a pod, binding it), hand-written: they run twice
    per scheduled pod in the scheduler's process (controlplane/rawsql.py says why)."""
    pod, event = rawsql.table(EmbeddedPod), rawsql.table(EmbeddedPodEvent)
    key = (
        f"{rawsql.column(EmbeddedPod, 'namespace')} = %s "
        f"AND {rawsql.column(EmbeddedPod, 'name')} = %s"
    )
    row = ("id", "uid", "node_name", "obj", "resource_version")
    update = ("obj", "node_name", "resource_version", "updated_at")
    assignments = ", ".join(f"{rawsql.column(EmbeddedPod, f)} = %s" for f in update)
    return {
        "get": f"SELECT {rawsql.column(EmbeddedPod, 'obj')} FROM {pod} WHERE {key}",
        "lock": (
            f"SELECT {rawsql.columns(EmbeddedPod, row)} FROM {pod} WHERE {key}{rawsql.for_update()}"
        ),
        "update": (f"UPDATE {pod} SET {assignments} WHERE {rawsql.column(EmbeddedPod, 'id')} = %s"),
        "event": (
            f"INSERT INTO {event} ({rawsql.columns(EmbeddedPodEvent, ('type', 'obj', 'at'))}) "
            f"VALUES {rawsql.placeholders(3)}"
        ),
    }


@dataclass(slots=True)
class _StandInRow:
    """One stand-in pod read under its row lock, to change and store with a MODIFIED event."""

    pk: int
    uid: str
    node_name: str
    obj: dict[str, Any]
    resource_version: int

    @classmethod
    def locked(cls, namespace: str, name: str) -> _StandInRow | None:
        rows = rawsql.fetch(_stand_in_sql()["lock"], (namespace, name))
        if not rows:
            return None
        pk, uid, node_name, obj, version = rows[0]
        return cls(pk, uid, node_name, _json_value(obj), int(version))

    def store(self) -> None:
        self.resource_version += 1
        self.obj["metadata"]["resourceVersion"] = str(self.resource_version)
        now = datetime.now(UTC)
        sql = _stand_in_sql()
        update = (
            rawsql.db_value(EmbeddedPod, "obj", self.obj),
            self.node_name,
            self.resource_version,
            rawsql.db_value(EmbeddedPod, "updated_at", now),
            self.pk,
        )
        rawsql.execute(sql["update"], update)
        event = (
            EmbeddedPodEvent.Type.MODIFIED.value,
            rawsql.db_value(EmbeddedPodEvent, "obj", self.obj),
            rawsql.db_value(EmbeddedPodEvent, "at", now),
        )
        rawsql.execute(sql["event"], event)


class EmbeddedKube:
    """Pods and bindings in the database, with the API server's bind rules (DESIGN §7).

    Bind follows the real `pods/binding` semantics: the UID precondition, refusal of a pod
    already assigned, annotations merged into the pod in the same write as `spec.nodeName`.
    """

    mode = "embedded"

    def __init__(self) -> None:
        # ResourceClaimTemplates (DRA mode's webhook) live in memory, per process: no claim
        # controller runs beside the stand-in to read them.
        self._claim_templates: dict[tuple[str, str], dict[str, Any]] = {}
        self._claim_templates_lock = threading.Lock()

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        with timed():
            rows = rawsql.fetch(_stand_in_sql()["get"], (namespace, name))
            return _json_value(rows[0][0]) if rows else None

    def list_pods(
        self, namespace: str | None = None, *, node_name: str | None = None
    ) -> list[dict[str, Any]]:
        with timed():
            rows = EmbeddedPod.objects.all()
            if namespace:
                rows = rows.filter(namespace=namespace)
            if node_name is not None:
                rows = rows.filter(node_name=node_name)
            return [obj for (obj,) in rows.values_list("obj")]

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(pod)
        meta = obj.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        if not meta.get("name"):
            raise KubeError("create pod: metadata.name is required", 422, False)
        meta["uid"] = meta.get("uid") or str(uuid.uuid4())
        meta["resourceVersion"] = "1"
        meta["creationTimestamp"] = _now_rfc3339()
        spec = obj.setdefault("spec", {})
        spec.setdefault("schedulerName", "default-scheduler")
        obj.setdefault("status", {})["phase"] = "Pending"
        obj.setdefault("apiVersion", "v1")
        obj.setdefault("kind", "Pod")
        with timed():
            try:
                with transaction.atomic():
                    EmbeddedPod.objects.create(
                        namespace=meta["namespace"],
                        name=meta["name"],
                        uid=meta["uid"],
                        node_name=spec.get("nodeName") or "",
                        obj=obj,
                    )
                    EmbeddedPodEvent.objects.create(type=EmbeddedPodEvent.Type.ADDED, obj=obj)
            except IntegrityError:
                raise KubeError(
                    f"create pod: pods {meta['name']!r} already exists in {meta['namespace']}",
                    409,
                    False,
                ) from None
        return obj

    def delete_pod(self, namespace: str, name: str) -> bool:
        with timed(), transaction.atomic():
            row = EmbeddedPod.objects.select_for_update().filter(namespace=namespace, name=name)
            found = row.first()
            if found is None:
                return False
            EmbeddedPodEvent.objects.create(type=EmbeddedPodEvent.Type.DELETED, obj=found.obj)
            found.delete()
            return True

    def set_phase(self, namespace: str, name: str, phase: str) -> bool:
        """What the kubelet would report (the demo marks its pods Running); False if gone."""
        with timed(), transaction.atomic():
            row = _StandInRow.locked(namespace, name)
            if row is None:
                return False
            row.obj.setdefault("status", {})["phase"] = phase
            row.store()
            return True

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]
    ) -> None:
        with timed(), transaction.atomic():
            row = _StandInRow.locked(namespace, name)
            if row is None:
                raise KubeError(f'pods "{name}" not found', 404, False)
            if uid and row.uid != uid:
                raise KubeError(
                    f"Precondition failed: UID in precondition: {uid}, UID in object meta: "
                    f"{row.uid}",
                    409,
                    False,
                )
            if row.node_name:
                raise KubeError(
                    f'Operation cannot be fulfilled on pods/binding "{name}": pod {name} is '
                    f'already assigned to node "{row.node_name}"',
                    409,
                    False,
                )
            meta = row.obj.setdefault("metadata", {})
            meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}
            row.obj.setdefault("spec", {})["nodeName"] = node
            conditions = row.obj.setdefault("status", {}).setdefault("conditions", [])
            conditions.append(
                {"type": "PodScheduled", "status": "True", "lastTransitionTime": _now_rfc3339()}
            )
            row.node_name = node
            row.store()

    def evict_pod(self, namespace: str, name: str, uid: str) -> bool:
        # The stand-in has no PodDisruptionBudgets and no kubelet to wait for: an eviction is
        # a delete.
        pod = self.get_pod(namespace, name)
        if pod is None or (uid and pod.get("metadata", {}).get("uid") != uid):
            return False
        return self.delete_pod(namespace, name)

    def nominate_pod(
        self, namespace: str, name: str, node: str, annotations: dict[str, str]
    ) -> None:
        with timed(), transaction.atomic():
            row = _StandInRow.locked(namespace, name)
            if row is None:
                raise KubeError(f'pods "{name}" not found', 404, False)
            meta = row.obj.setdefault("metadata", {})
            meta["annotations"] = {**(meta.get("annotations") or {}), **annotations}
            status = row.obj.setdefault("status", {})
            if node:
                status["nominatedNodeName"] = node
            else:
                status.pop("nominatedNodeName", None)
            row.store()

    def list_disruption_budgets(self, namespace: str) -> list[dict[str, Any]]:
        return []

    # The stand-in runs no DRA: no claims, templates or slices exist there.
    def list_resource_claims(self, namespace: str | None = None) -> list[dict[str, Any]]:
        return []

    def list_resource_slices(self, driver: str) -> list[dict[str, Any]]:
        return []

    def get_claim_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = self._claim_templates.get((namespace, name))
        return copy.deepcopy(found) if found is not None else None

    def create_claim_template(self, template: dict[str, Any]) -> dict[str, Any]:
        obj = copy.deepcopy(template)
        meta = obj["metadata"]
        key = (meta["namespace"], meta["name"])
        with self._claim_templates_lock:
            if key in self._claim_templates:
                raise KubeError(
                    f"create resourceclaimtemplate: {meta['name']!r} already exists in "
                    f"{meta['namespace']}",
                    409,
                    False,
                )
            meta["uid"] = str(uuid.uuid4())
            self._claim_templates[key] = obj
        return copy.deepcopy(obj)

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        # No kubectl reads the stand-in's events: the log is where the demo tells them.
        log.info(
            "event %s %s on pod %s/%s: %s", event.get("type"), event.get("reason"), namespace,
            event.get("involvedObject", {}).get("name"), event.get("message"),
        )  # fmt: skip

    def watch_pods(self, cursor: str | None, timeout_s: float) -> Iterator[WatchEvent]:
        """Watch by polling the event table (every 50 ms) until `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        last = int(cursor) if cursor else self._latest_event_id()
        while True:
            with timed():
                events = list(
                    EmbeddedPodEvent.objects.filter(id__gt=last).values_list("id", "type", "obj")[
                        :500
                    ]
                )
            for event_id, kind, obj in events:
                last = event_id
                yield WatchEvent(kind, obj, str(event_id))
            if time.monotonic() >= deadline:
                return
            if not events:
                time.sleep(0.05)

    @staticmethod
    def _latest_event_id() -> int:
        latest = EmbeddedPodEvent.objects.order_by("-id").values_list("id", flat=True).first()
        return int(latest or 0)

    # --- DRA objects: what kube-scheduler and the node plugins would write in DRA mode ---------

    def put_object(self, kind: str, obj: dict[str, Any]) -> dict[str, Any]:
        """Create or replace a ResourceClaim or ResourceSlice (by kind, namespace and name);
        a claim's change is a watch event. Returns it as stored (with a uid)."""
        stored = copy.deepcopy(obj)
        meta = stored.setdefault("metadata", {})
        if not meta.get("name"):
            raise KubeError(f"put {kind}: metadata.name is required", 422, False)
        namespace = str(meta.get("namespace", "")) if kind == EmbeddedObject.Kind.CLAIM else ""
        with timed(), transaction.atomic():
            row = (
                EmbeddedObject.objects.select_for_update()
                .filter(kind=kind, namespace=namespace, name=meta["name"])
                .first()
            )
            meta["uid"] = row.uid if row else meta.get("uid") or str(uuid.uuid4())
            stored.setdefault("kind", kind)
            if row is None:
                EmbeddedObject.objects.create(
                    kind=kind, namespace=namespace, name=meta["name"], uid=meta["uid"], obj=stored
                )
            else:
                row.obj = stored
                row.save(update_fields=["obj"])
            if kind == EmbeddedObject.Kind.CLAIM:
                change = EmbeddedPodEvent.Type.MODIFIED if row else EmbeddedPodEvent.Type.ADDED
                EmbeddedObjectEvent.objects.create(type=change, obj=stored)
        return stored

    def delete_object(self, kind: str, namespace: str, name: str) -> bool:
        """Delete a ResourceClaim or ResourceSlice; False when it was already gone."""
        with timed(), transaction.atomic():
            found = (
                EmbeddedObject.objects.select_for_update()
                .filter(kind=kind, namespace=namespace, name=name)
                .first()
            )
            if found is None:
                return False
            if kind == EmbeddedObject.Kind.CLAIM:
                EmbeddedObjectEvent.objects.create(
                    type=EmbeddedPodEvent.Type.DELETED, obj=found.obj
                )
            found.delete()
            return True

    def list_objects(self, kind: str) -> list[dict[str, Any]]:
        with timed():
            return list(EmbeddedObject.objects.filter(kind=kind).values_list("obj", flat=True))

    @staticmethod
    def latest_claim_event_id() -> int:
        latest = EmbeddedObjectEvent.objects.order_by("-id").values_list("id", flat=True).first()
        return int(latest or 0)


class EmbeddedClusterSource:
    """The stand-in's pods; its resourceVersion is the id of the last event row."""

    def __init__(self, kube: EmbeddedKube) -> None:
        self.kube = kube
        self._rv = ""
        self._claims_rv = ""

    def list_pods(self, page_size: int = 500) -> tuple[list[Any], str]:
        with transaction.atomic():  # the list and its version from one snapshot
            rv = str(self.kube._latest_event_id())
            pods = [pod_view(obj) for obj in self.kube.list_pods()]
        self._rv = rv
        return pods, rv

    def watch_pods(self, resource_version: str, timeout_s: float) -> Iterator[Any]:
        self._rv = resource_version
        for event in self.kube.watch_pods(resource_version, timeout_s):
            self._rv = event.cursor
            yield PodEvent(event.type, pod_view(event.pod))

    def get_pod(self, namespace: str, name: str) -> Any:
        obj = self.kube.get_pod(namespace, name)
        return None if obj is None else pod_view(obj)

    def list_node_names(self) -> set[str]:
        # The stand-in keeps no Node objects: the ledger's nodes are the cluster's nodes.
        return node_names()

    def last_resource_version(self) -> str:
        return self._rv

    def current_resource_version(self) -> str:
        return str(self.kube._latest_event_id())

    def cluster_identity(self) -> str:
        """The stand-in is one cluster per database, and a reconciler keeps its resume point in
        memory next to one database (`manage.py reconcile`): nothing to tell apart."""
        return "embedded"

    def list_claims(self, page_size: int = 500) -> tuple[list[Any], str]:
        with transaction.atomic():  # the list and its version from one snapshot
            rv = str(self.kube.latest_claim_event_id())
            claims = [claim_view(o) for o in self.kube.list_objects(EmbeddedObject.Kind.CLAIM)]
        self._claims_rv = rv
        return claims, rv

    def watch_claims(self, resource_version: str, timeout_s: float) -> Iterator[Any]:
        """The claim events after `resource_version`; the stand-in's backlog is all there is
        (nothing writes claims while a pass runs but tests), so no waiting."""
        self._claims_rv = resource_version
        events = EmbeddedObjectEvent.objects.filter(id__gt=int(resource_version or 0))
        for event_id, kind, obj in events.values_list("id", "type", "obj").iterator():
            self._claims_rv = str(event_id)
            yield ClaimEvent(kind, claim_view(obj))

    def last_claims_resource_version(self) -> str:
        return self._claims_rv

    def published_devices(self) -> dict[Any, Any]:
        return published_devices(self.kube.list_objects(EmbeddedObject.Kind.SLICE))
