"""The one Kubernetes adapter of the control plane: the only module that imports `kubernetes`.

Three implementations, one interface (:class:`Kube`):

- :class:`RealKube`: a real API server through the official client (kubeconfig or in-cluster,
  `settings.TESSERA["KUBE_MODE"]`). Pods travel as the API server's own JSON (camelCase keys,
  exactly what `parse_pod` reads), never as the client's snake_case models.
- :class:`EmbeddedKube`: the embedded stand-in of DESIGN §7, pods and bindings in the database
  (`controlplane.extender.models.EmbeddedPod`); a demo and test aid, never a production mode.
- tests replace :func:`get_kube` with a fake (monkeypatch), not HTTP.

Every call adds its wall time to a per-thread counter (:func:`api_ms`), so the extender can
report the API server's share of a bind apart from Tessera's own (header
`X-Tessera-Apiserver-Ms`, docs/extender.md).
"""

from __future__ import annotations

import copy
import http.client
import json
import select
import socket
import ssl
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from django.conf import settings
from django.db import IntegrityError, transaction

from controlplane import rawsql
from controlplane.extender.models import EmbeddedPod, EmbeddedPodEvent

API_TIMEOUT_S = 5.0  # kube-scheduler gives the whole bind 5 s by default; stay inside it
API_POOL_SIZE = 32  # connections kept to the API server (request threads + the reconciler)


class KubeError(Exception):
    """An API server call failed.

    `status` is the HTTP status when there was an answer. `applied` says what we know about
    the write: False = certainly not applied (a 4xx refusal, or the request never left), None =
    unknown (timeout, 5xx, broken connection: the server may have done it).
    """

    def __init__(self, message: str, status: int | None = None, applied: bool | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.applied = applied

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        return self.status == 409


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change of a pod: ADDED, MODIFIED or DELETED, with the pod as it was then."""

    type: str
    pod: dict[str, Any]
    cursor: str


class Kube(Protocol):
    """What the control plane asks of the API server."""

    mode: str

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The pod's JSON, or None when it does not exist."""

    def list_pods(
        self, namespace: str | None = None, *, node_name: str | None = None
    ) -> list[dict[str, Any]]:
        """Pods (of a namespace, or all), optionally only those on `node_name`."""

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        """Create a pod; returns it as stored (uid, creationTimestamp...)."""

    def delete_pod(self, namespace: str, name: str) -> bool:
        """Delete a pod; False when it was already gone."""

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]
    ) -> None:
        """POST the Binding subresource: sets spec.nodeName and merges `annotations` into the
        pod, with `uid` as precondition. Raises KubeError."""

    def watch_pods(self, cursor: str | None, timeout_s: float) -> Iterator[WatchEvent]:
        """Changes after `cursor` (None: from now), for up to `timeout_s` seconds."""


# --- API time accounting -------------------------------------------------------------------------

_local = threading.local()


def reset_api_ms() -> None:
    """Start counting this thread's API server time from zero."""
    _local.ms = 0.0


def api_ms() -> float:
    """Milliseconds this thread spent in API server calls since the last reset."""
    return float(getattr(_local, "ms", 0.0))


@contextmanager
def _timed() -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        _local.ms = api_ms() + (time.perf_counter() - start) * 1000.0


# --- the real API server -------------------------------------------------------------------------


class _Unreachable(Exception):
    """The connection to the API server did not open: the request never left."""


class _LeanClient:
    """One request, one JSON answer, over a keep-alive connection per thread: `http.client`
    with the official client's configuration (address, TLS, credentials).

    The kubernetes client's own path (its serialisation, urllib3's pool and retries) costs
    about 0.45 ms of CPU per Binding; this one about 0.2 (a local TLS server, 2,000 calls).
    Bind makes one such call per pod on the scheduler's hot path. Configurations it does not
    cover (a proxy, a TLS server name or hostname to assert other than the host's, custom
    socket options) keep the official path: `for_client` answers None.
    """

    def __init__(self, api_client: Any, scheme: str, host: str, port: int, prefix: str) -> None:
        self._client = api_client
        self._config = api_client.configuration
        self._scheme, self._host, self._port, self._prefix = scheme, host, port, prefix
        self._context: ssl.SSLContext | None = None
        if scheme == "https":
            self._context = self._tls_context(self._config)
        self._local = threading.local()

    @classmethod
    def for_client(cls, api_client: Any) -> _LeanClient | None:
        config = api_client.configuration
        parts = urllib.parse.urlsplit(config.host or "")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return None
        if config.proxy or config.tls_server_name or config.socket_options is not None:
            return None
        if config.assert_hostname not in (None, False, True):
            return None
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return cls(api_client, parts.scheme, parts.hostname, port, parts.path.rstrip("/"))

    @staticmethod
    def _tls_context(config: Any) -> ssl.SSLContext:
        context = ssl.create_default_context(
            cafile=config.ssl_ca_cert or None, cadata=config.ca_cert_data or None
        )
        if not config.verify_ssl:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        elif config.assert_hostname is False:
            context.check_hostname = False
        if config.cert_file:
            context.load_cert_chain(config.cert_file, config.key_file or None)
        return context

    def _connection(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and conn.sock is not None:
            # A keep-alive connection the server closed (or wrote to) meanwhile: readable now.
            readable, _, _ = select.select([conn.sock], [], [], 0)
            if readable:
                conn.close()
        if conn is None:
            if self._context is not None:
                conn = http.client.HTTPSConnection(
                    self._host, self._port, timeout=API_TIMEOUT_S, context=self._context
                )
            else:
                conn = http.client.HTTPConnection(self._host, self._port, timeout=API_TIMEOUT_S)
            self._local.conn = conn
        if conn.sock is None:
            try:
                conn.connect()
            except OSError as exc:  # refused, no route, TLS handshake refused: nothing sent
                conn.close()
                raise _Unreachable(f"{type(exc).__name__}: {exc}") from exc
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        return conn

    def request(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """The answer's JSON object; ApiException for a non-2xx answer, _Unreachable when the
        connection did not open, OSError or HTTPException when it broke (outcome unknown)."""
        from kubernetes.client.rest import ApiException

        headers = {**self._client.default_headers, "Accept": "application/json"}
        for auth in self._config.auth_settings().values():  # refreshes rotating tokens
            if auth["in"] == "header" and auth["value"]:
                headers[auth["key"]] = auth["value"]
        data = None
        if body is not None:
            headers["Content-Type"] = "application/json"
            data = json.dumps(body, separators=(",", ":")).encode()
        conn = self._connection()
        try:
            conn.request(method, self._prefix + path, data, headers)
            response = conn.getresponse()
            raw = response.read()
        except BaseException:
            conn.close()
            raise
        if response.will_close:
            conn.close()
        if not 200 <= response.status <= 299:
            raise ApiException(
                status=response.status,
                reason=response.reason,
                body=raw.decode("utf-8", "replace"),
            )
        decoded = json.loads(raw or b"{}")
        return decoded if isinstance(decoded, dict) else {}


class RealKube:
    """A real API server through the official client.

    Everything reads the raw JSON: the pod is wanted as the API server serves it, and the
    Binding POST is answered with a 201 `Status`, which the generated client fails to
    deserialize as a `V1Binding` (a validation error about `target`) after the bind happened.
    Bind's calls and delete go through `_request` (the client's auth, serialisation and pool,
    without its per-endpoint layer); every body is read, so each connection goes back to the
    pool.
    """

    def __init__(self, mode: str, kubeconfig: str = "") -> None:
        from kubernetes import client, config

        if mode == "incluster":
            config.load_incluster_config()
        else:
            config.load_kube_config(config_file=kubeconfig or None)
        self.mode = mode
        configuration = client.Configuration.get_default_copy()
        # Keep a connection per thread that talks to the API server (the sidecar's 16 request
        # threads, the reconciler): the default, 5 x CPUs, is 10 on a small node, and every
        # request past the pool opens (and TLS-handshakes) a connection of its own.
        configuration.connection_pool_maxsize = API_POOL_SIZE
        self._api = client.CoreV1Api(client.ApiClient(configuration))
        self._lean = _LeanClient.for_client(self._api.api_client)

    @classmethod
    def with_api(cls, api: Any, mode: str = "test") -> RealKube:
        """Wrap an existing CoreV1Api (tests point one at a local HTTP server)."""
        self = cls.__new__(cls)
        self.mode, self._api = mode, api
        self._lean = _LeanClient.for_client(api.api_client)
        return self

    def _error(self, exc: Exception, doing: str) -> KubeError:
        from kubernetes.client.rest import ApiException
        from urllib3 import exceptions as u3

        if isinstance(exc, _Unreachable):
            return KubeError(f"{doing}: API server unreachable: {exc}", None, False)
        if isinstance(exc, ApiException):
            status = int(exc.status or 0) or None
            message = str(exc.reason or "")
            with suppress(ValueError, AttributeError):
                message = json.loads(exc.body or "{}").get("message") or message
            # A 4xx is a refusal: nothing was written. A 5xx may come after etcd took the write.
            applied = False if status is not None and 400 <= status < 500 else None
            return KubeError(f"{doing}: API server answered {status}: {message}", status, applied)
        cause = exc.reason if isinstance(exc, u3.MaxRetryError) else exc
        if isinstance(cause, u3.NewConnectionError | u3.ConnectTimeoutError):
            # The connection never opened: the request cannot have reached the server.
            return KubeError(f"{doing}: API server unreachable: {cause}", None, False)
        return KubeError(f"{doing}: {type(exc).__name__}: {exc}", None, None)

    @staticmethod
    def _json(response: Any) -> dict[str, Any]:
        """The body as JSON. Reading it whole also hands the connection back to the pool: a
        response left unread keeps its connection, and the next call opens a new one."""
        data = response.data if hasattr(response, "data") else response.read()
        decoded = json.loads(data or b"{}")
        return decoded if isinstance(decoded, dict) else {}

    def _request(
        self, method: str, path: str, params: dict[str, str], body: Any = None
    ) -> dict[str, Any]:
        """One call with the client's configuration and credentials, without the generated
        per-endpoint layer (argument validation and model objects: most of the client's CPU on
        bind's path): through `_LeanClient` where it covers the configuration, else through the
        client's own serialisation and connection pool. Raises the client's ApiException for a
        non-2xx answer."""
        from kubernetes.client.rest import ApiException

        if self._lean is not None:
            quoted = {k: urllib.parse.quote(v, safe="") for k, v in params.items()}
            return self._lean.request(method, path.format(**quoted), body)

        api_client = self._api.api_client
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = api_client.param_serialize(
            method=method,
            resource_path=path,
            path_params=params,
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        response = api_client.call_api(*request, _request_timeout=API_TIMEOUT_S)
        data = response.read()
        if not 200 <= response.status <= 299:
            raise ApiException(http_resp=response, body=data.decode("utf-8", "replace"))
        decoded = json.loads(data or b"{}")
        return decoded if isinstance(decoded, dict) else {}

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        with _timed():
            try:
                return self._request(
                    "GET",
                    "/api/v1/namespaces/{namespace}/pods/{name}",
                    {"namespace": namespace, "name": name},
                )
            except Exception as exc:  # translated: callers handle KubeError only
                error = self._error(exc, f"get pod {namespace}/{name}")
                if error.not_found:
                    return None
                raise error from exc

    def list_pods(
        self, namespace: str | None = None, *, node_name: str | None = None
    ) -> list[dict[str, Any]]:
        selector = f"spec.nodeName={node_name}" if node_name else None
        with _timed():
            try:
                if namespace:
                    response = self._api.list_namespaced_pod(
                        namespace, field_selector=selector, _preload_content=False
                    )
                else:
                    response = self._api.list_pod_for_all_namespaces(
                        field_selector=selector, _preload_content=False
                    )
            except Exception as exc:  # translated
                raise self._error(exc, "list pods") from exc
            return list(self._json(response).get("items") or [])

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        namespace = pod.get("metadata", {}).get("namespace") or "default"
        with _timed():
            try:
                response = self._api.create_namespaced_pod(
                    namespace, pod, _preload_content=False, _request_timeout=API_TIMEOUT_S
                )
            except Exception as exc:  # translated
                raise self._error(exc, "create pod") from exc
            return self._json(response)

    def delete_pod(self, namespace: str, name: str) -> bool:
        with _timed():
            try:
                self._request(
                    "DELETE",
                    "/api/v1/namespaces/{namespace}/pods/{name}",
                    {"namespace": namespace, "name": name},
                )
            except Exception as exc:  # translated
                error = self._error(exc, f"delete pod {namespace}/{name}")
                if error.not_found:
                    return False
                raise error from exc
            return True

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]
    ) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": uid,
                "annotations": dict(annotations),
            },
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        with _timed():
            try:
                # The answer is a Status (201), which the generated client would fail to read
                # as a V1Binding after the bind happened; read raw, it is simply a success.
                self._request(
                    "POST",
                    "/api/v1/namespaces/{namespace}/pods/{name}/binding",
                    {"namespace": namespace, "name": name},
                    body,
                )
            except Exception as exc:  # translated
                raise self._error(exc, f"bind pod {namespace}/{name} to {node}") from exc

    def review_token(self, token: str, audiences: list[str]) -> dict[str, Any]:
        """TokenReview: the API server's `status` for `token` (authenticated, user, error)."""
        from kubernetes import client

        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": audiences},
        }
        with _timed():
            try:
                response = client.AuthenticationV1Api(self._api.api_client).create_token_review(
                    body, _preload_content=False, _request_timeout=API_TIMEOUT_S
                )
            except Exception as exc:  # translated
                raise self._error(exc, "review a ServiceAccount token") from exc
            return dict(self._json(response).get("status") or {})

    def watch_pods(self, cursor: str | None, timeout_s: float) -> Iterator[WatchEvent]:
        from kubernetes import watch

        if cursor is None:
            listing = self._json(self._api.list_pod_for_all_namespaces(_preload_content=False))
            cursor = str(listing.get("metadata", {}).get("resourceVersion", ""))
        stream = watch.Watch().stream(
            self._api.list_pod_for_all_namespaces,
            resource_version=cursor,
            timeout_seconds=max(1, int(timeout_s)),
            _preload_content=False,
        )
        for event in stream:
            raw = event.get("raw_object") or {}
            version = str(raw.get("metadata", {}).get("resourceVersion", cursor))
            yield WatchEvent(str(event.get("type")), raw, version)


# --- the embedded stand-in -----------------------------------------------------------------------


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

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        with _timed():
            rows = rawsql.fetch(_stand_in_sql()["get"], (namespace, name))
            return _json_value(rows[0][0]) if rows else None

    def list_pods(
        self, namespace: str | None = None, *, node_name: str | None = None
    ) -> list[dict[str, Any]]:
        with _timed():
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
        with _timed():
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
        with _timed(), transaction.atomic():
            row = EmbeddedPod.objects.select_for_update().filter(namespace=namespace, name=name)
            found = row.first()
            if found is None:
                return False
            EmbeddedPodEvent.objects.create(type=EmbeddedPodEvent.Type.DELETED, obj=found.obj)
            found.delete()
            return True

    def set_phase(self, namespace: str, name: str, phase: str) -> bool:
        """What the kubelet would report (the demo marks its pods Running); False if gone."""
        with _timed(), transaction.atomic():
            row = _StandInRow.locked(namespace, name)
            if row is None:
                return False
            row.obj.setdefault("status", {})["phase"] = phase
            row.store()
            return True

    def bind_pod(
        self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str]
    ) -> None:
        with _timed(), transaction.atomic():
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

    def watch_pods(self, cursor: str | None, timeout_s: float) -> Iterator[WatchEvent]:
        """Watch by polling the event table (every 50 ms) until `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        last = int(cursor) if cursor else self._latest_event_id()
        while True:
            with _timed():
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


# --- the getter ----------------------------------------------------------------------------------

_lock = threading.Lock()
_instances: dict[str, Kube] = {}


def get_kube() -> Kube:
    """The adapter for `settings.TESSERA["KUBE_MODE"]`, one per process (tests replace this)."""
    mode = settings.TESSERA["KUBE_MODE"]
    found = _instances.get(mode)
    if found is None:
        with _lock:
            found = _instances.get(mode)
            if found is None:
                found = (
                    EmbeddedKube()
                    if mode == "embedded"
                    else RealKube(mode, settings.TESSERA.get("KUBECONFIG", ""))
                )
                _instances[mode] = found
    return found


# --- the reconciler's view of the cluster (controlplane.reconciler.source.ClusterSource) ------


def _resume_point_lost(status: int | None, message: str, details: Any = None) -> bool:
    """The API server cannot watch from the given resourceVersion: 410 Gone (compacted away),
    or 504 "Too large resource version" (ahead of the API server: etcd was restored from a
    backup, or the resume point is another cluster's). Either way only a relist helps; without
    this the second kind read as a temporary error, retried until the next full resync."""
    if status == 410:
        return True
    causes = (details.get("causes") or []) if isinstance(details, dict) else []
    return status == 504 and (
        "too large resource version" in message.lower()
        or any(isinstance(c, dict) and c.get("reason") == "ResourceVersionTooLarge" for c in causes)
    )


class RealClusterSource:
    """Paginated lists and resumable watches of pods and nodes on a real API server."""

    def __init__(self, kube: RealKube) -> None:
        self.kube = kube
        self._rv = ""

    def _call(self, doing: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        from controlplane.reconciler.source import TemporaryError, WatchExpired

        with _timed():
            try:
                return self.kube._json(fn(*args, _preload_content=False, **kwargs))
            except Exception as exc:  # translated into the reconciler's two error kinds
                error = self.kube._error(exc, doing)
                if _resume_point_lost(error.status, error.message):
                    raise WatchExpired(error.message) from exc
                raise TemporaryError(error.message) from exc

    def _paged(self, doing: str, fn: Any, page_size: int) -> tuple[list[dict[str, Any]], str]:
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"limit": page_size, "_request_timeout": 30}
            if token:
                kwargs["_continue"] = token
            page = self._call(doing, fn, **kwargs)
            items.extend(page.get("items") or [])
            meta = page.get("metadata") or {}
            token = meta.get("continue")
            if not token:
                return items, str(meta.get("resourceVersion", ""))

    def list_pods(self, page_size: int = 500) -> tuple[list[Any], str]:
        from controlplane.reconciler.source import WatchExpired, pod_view

        api = self.kube._api
        try:
            items, rv = self._paged("list pods", api.list_pod_for_all_namespaces, page_size)
        except WatchExpired:  # the continue token expired mid-list: start over, once
            items, rv = self._paged("list pods", api.list_pod_for_all_namespaces, page_size)
        self._rv = rv
        return [pod_view(item) for item in items], rv

    def watch_pods(self, resource_version: str, timeout_s: float) -> Iterator[Any]:
        from kubernetes import watch

        from controlplane.reconciler.source import PodEvent, TemporaryError, WatchExpired, pod_view

        self._rv = resource_version
        stream = watch.Watch().stream(
            self.kube._api.list_pod_for_all_namespaces,
            resource_version=resource_version,
            timeout_seconds=max(1, int(timeout_s)),
            allow_watch_bookmarks=True,
            _preload_content=False,
        )
        try:
            for event in stream:
                kind = str(event.get("type"))
                raw = event.get("raw_object") or {}
                if kind == "ERROR":
                    message = str(raw.get("message", "resourceVersion expired"))
                    if _resume_point_lost(int(raw.get("code") or 0), message, raw.get("details")):
                        raise WatchExpired(message)
                    raise TemporaryError(f"watch pods: {raw.get('message', raw)}")
                self._rv = str((raw.get("metadata") or {}).get("resourceVersion") or self._rv)
                if kind == "BOOKMARK":
                    continue
                yield PodEvent(kind, pod_view(raw))
        except (WatchExpired, TemporaryError):
            raise
        except Exception as exc:  # connection trouble mid-watch: retry later
            error = self.kube._error(exc, "watch pods")
            if _resume_point_lost(error.status, error.message):
                raise WatchExpired(error.message) from exc
            raise TemporaryError(error.message) from exc

    def get_pod(self, namespace: str, name: str) -> Any:
        from controlplane.reconciler.source import TemporaryError, pod_view

        try:
            obj = self.kube.get_pod(namespace, name)
        except KubeError as exc:
            raise TemporaryError(exc.message) from exc
        return None if obj is None else pod_view(obj)

    def list_node_names(self) -> set[str]:
        items, _ = self._paged("list nodes", self.kube._api.list_node, 500)
        return {str((n.get("metadata") or {}).get("name")) for n in items}

    def current_resource_version(self) -> str:
        page = self._call(
            "list pods", self.kube._api.list_pod_for_all_namespaces, limit=1, _request_timeout=30
        )
        return str((page.get("metadata") or {}).get("resourceVersion", ""))

    def last_resource_version(self) -> str:
        return self._rv


class EmbeddedClusterSource:
    """The stand-in's pods; its resourceVersion is the id of the last event row."""

    def __init__(self, kube: EmbeddedKube) -> None:
        self.kube = kube
        self._rv = ""

    def list_pods(self, page_size: int = 500) -> tuple[list[Any], str]:
        from controlplane.reconciler.source import pod_view

        with transaction.atomic():  # the list and its version from one snapshot
            rv = str(self.kube._latest_event_id())
            pods = [pod_view(obj) for obj in self.kube.list_pods()]
        self._rv = rv
        return pods, rv

    def watch_pods(self, resource_version: str, timeout_s: float) -> Iterator[Any]:
        from controlplane.reconciler.source import PodEvent, pod_view

        self._rv = resource_version
        for event in self.kube.watch_pods(resource_version, timeout_s):
            self._rv = event.cursor
            yield PodEvent(event.type, pod_view(event.pod))

    def get_pod(self, namespace: str, name: str) -> Any:
        from controlplane.reconciler.source import pod_view

        obj = self.kube.get_pod(namespace, name)
        return None if obj is None else pod_view(obj)

    def list_node_names(self) -> set[str]:
        # The stand-in keeps no Node objects: the ledger's nodes are the cluster's nodes.
        from controlplane.ledger.models import Node

        return set(Node.objects.values_list("name", flat=True))

    def last_resource_version(self) -> str:
        return self._rv

    def current_resource_version(self) -> str:
        return str(self.kube._latest_event_id())


def cluster_source() -> Any:
    """The reconciler's ClusterSource for the configured cluster (or the stand-in)."""
    kube = get_kube()
    if isinstance(kube, EmbeddedKube):
        return EmbeddedClusterSource(kube)
    if isinstance(kube, RealKube):
        return RealClusterSource(kube)
    raise TypeError(f"no cluster source for {type(kube).__name__}")
