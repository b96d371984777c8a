"""A real API server through the official client: the only module that imports `kubernetes`.

Pods travel as the API server's own JSON (camelCase keys, exactly what `parse_pod` reads),
never as the client's snake_case models. `RealClusterSource` gives the reconciler paginated
lists and resumable watches (`controlplane.kube.sources`).
"""

from __future__ import annotations

import http.client
import json
import logging
import select
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from kubernetes import client, config, watch
from kubernetes.client.rest import ApiException
from urllib3 import exceptions as u3

from controlplane.kube.base import API_POOL_SIZE, API_TIMEOUT_S, KubeError, WatchEvent, timed
from controlplane.kube.sources import (
    DRA_DRIVER,
    ClaimEvent,
    ClaimsUnreadable,
    PodEvent,
    TemporaryError,
    WatchExpired,
    claim_view,
    pod_view,
    published_devices,
)

log = logging.getLogger(__name__)

# The namespace whose UID identifies the cluster (RealClusterSource.cluster_identity).
IDENTITY_NAMESPACE = "kube-system"
# Where DRA's objects live (Kubernetes v1.37: resource.k8s.io/v1, GA), read through the generic
# client: ResourceClaims (mirrored into the ledger) and ResourceSlices (which card a device is).
RESOURCE_GROUP, RESOURCE_VERSION = "resource.k8s.io", "v1"


class _Unreachable(Exception):
    """The connection to the API server did not open: the request never left."""


class _LeanClient:
    """One request, one JSON answer, over a keep-alive connection per thread: `http.client`
    with the official client's configuration (address, TLS, credentials).

    Why it is kept beside the official client: bind makes one such call per pod on the
    scheduler's hot path. Against a real kube-apiserver (v1.37.2 on loopback, TLS; 1,200
    Binding POSTs per path in each of two runs, rounds alternating) a bind took 2.42-2.66 ms
    (median) here, 2.80-2.97 through the official client's `call_api` and 2.83-2.84 through
    its generated `create_namespaced_binding` (ratio 0.86-0.94), on 0.33 ms of this process's
    CPU against 0.55-0.57 and 0.58-0.62; the p99s were within the runs' noise.
    `bench/bench_kube_bind.py` measures it.
    Configurations it does not cover (a proxy, a TLS server name or hostname to assert other
    than the host's, custom socket options) keep the official path: `for_client` answers None.
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

    def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> dict[str, Any]:
        """The answer's JSON object; ApiException for a non-2xx answer, _Unreachable when the
        connection did not open, OSError or HTTPException when it broke (outcome unknown)."""
        headers = {**self._client.default_headers, "Accept": "application/json"}
        for auth in self._config.auth_settings().values():  # refreshes rotating tokens
            if auth["in"] == "header" and auth["value"]:
                headers[auth["key"]] = auth["value"]
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
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
    pool. `RealClusterSource` calls the generated API (`api`) and reads and translates its
    answers through `read_json` and `error_of`.
    """

    def __init__(self, mode: str, kubeconfig: str = "") -> None:
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
        self.api = client.CoreV1Api(client.ApiClient(configuration))
        self._lean = _LeanClient.for_client(self.api.api_client)

    @classmethod
    def with_api(cls, api: Any, mode: str = "test") -> RealKube:
        """Wrap an existing CoreV1Api (tests point one at a local HTTP server)."""
        self = cls.__new__(cls)
        self.mode, self.api = mode, api
        self._lean = _LeanClient.for_client(api.api_client)
        return self

    def error_of(self, exc: Exception, doing: str) -> KubeError:
        """`exc`, raised by a call to the API server while `doing`, as a KubeError: its status,
        and whether the write can have been applied."""
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
    def read_json(response: Any) -> dict[str, Any]:
        """The body as JSON. Reading it whole also hands the connection back to the pool: a
        response left unread keeps its connection, and the next call opens a new one."""
        data = response.data if hasattr(response, "data") else response.read()
        decoded = json.loads(data or b"{}")
        return decoded if isinstance(decoded, dict) else {}

    def _request(
        self,
        method: str,
        path: str,
        params: dict[str, str],
        body: Any = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        """One call with the client's configuration and credentials, without the generated
        per-endpoint layer (argument validation and model objects: most of the client's CPU on
        bind's path): through `_LeanClient` where it covers the configuration, else through the
        client's own serialisation and connection pool. Raises the client's ApiException for a
        non-2xx answer."""
        if self._lean is not None:
            quoted = {k: urllib.parse.quote(v, safe="") for k, v in params.items()}
            return self._lean.request(method, path.format(**quoted), body, content_type)

        api_client = self.api.api_client
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
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

    def _get_or_none(
        self, path: str, namespace: str, name: str, what: str
    ) -> dict[str, Any] | None:
        """GET one namespaced object as JSON; None when it does not exist."""
        with timed():
            try:
                return self._request("GET", path, {"namespace": namespace, "name": name})
            except Exception as exc:  # translated: callers handle KubeError only
                error = self.error_of(exc, f"get {what} {namespace}/{name}")
                if error.not_found:
                    return None
                raise error from exc

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_or_none(
            "/api/v1/namespaces/{namespace}/pods/{name}", namespace, name, "pod"
        )

    def list_pods(
        self, namespace: str | None = None, *, node_name: str | None = None
    ) -> list[dict[str, Any]]:
        selector = f"spec.nodeName={node_name}" if node_name else None
        with timed():
            try:
                if namespace:
                    response = self.api.list_namespaced_pod(
                        namespace, field_selector=selector, _preload_content=False
                    )
                else:
                    response = self.api.list_pod_for_all_namespaces(
                        field_selector=selector, _preload_content=False
                    )
            except Exception as exc:  # translated
                raise self.error_of(exc, "list pods") from exc
            return list(self.read_json(response).get("items") or [])

    def create_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        namespace = pod.get("metadata", {}).get("namespace") or "default"
        with timed():
            try:
                response = self.api.create_namespaced_pod(
                    namespace, pod, _preload_content=False, _request_timeout=API_TIMEOUT_S
                )
            except Exception as exc:  # translated
                raise self.error_of(exc, "create pod") from exc
            return self.read_json(response)

    def delete_pod(self, namespace: str, name: str) -> bool:
        with timed():
            try:
                self._request(
                    "DELETE",
                    "/api/v1/namespaces/{namespace}/pods/{name}",
                    {"namespace": namespace, "name": name},
                )
            except Exception as exc:  # translated
                error = self.error_of(exc, f"delete pod {namespace}/{name}")
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
        with timed():
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
                raise self.error_of(exc, f"bind pod {namespace}/{name} to {node}") from exc

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        with timed():
            try:
                self._request(
                    "POST", "/api/v1/namespaces/{namespace}/events", {"namespace": namespace}, event
                )
            except Exception as exc:  # translated
                raise self.error_of(exc, f"create event in {namespace}") from exc

    def evict_pod(self, namespace: str, name: str, uid: str) -> bool:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
            "deleteOptions": {"preconditions": {"uid": uid}},
        }
        with timed():
            try:
                self._request(
                    "POST",
                    "/api/v1/namespaces/{namespace}/pods/{name}/eviction",
                    {"namespace": namespace, "name": name},
                    body,
                )
            except Exception as exc:  # translated
                error = self.error_of(exc, f"evict pod {namespace}/{name}")
                if error.not_found:
                    return False
                raise error from exc
            return True

    def nominate_pod(
        self, namespace: str, name: str, node: str, annotations: dict[str, str]
    ) -> None:
        params = {"namespace": namespace, "name": name}
        merge = "application/merge-patch+json"
        with timed():
            try:
                self._request(
                    "PATCH",
                    "/api/v1/namespaces/{namespace}/pods/{name}/status",
                    params,
                    {"status": {"nominatedNodeName": node or None}},
                    merge,
                )
                if annotations:
                    self._request(
                        "PATCH",
                        "/api/v1/namespaces/{namespace}/pods/{name}",
                        params,
                        {"metadata": {"annotations": annotations}},
                        merge,
                    )
            except Exception as exc:  # translated
                raise self.error_of(exc, f"nominate pod {namespace}/{name} for {node}") from exc

    def list_disruption_budgets(self, namespace: str) -> list[dict[str, Any]]:
        with timed():
            try:
                answer = self._request(
                    "GET",
                    "/apis/policy/v1/namespaces/{namespace}/poddisruptionbudgets",
                    {"namespace": namespace},
                )
            except Exception as exc:  # translated
                raise self.error_of(exc, f"list PodDisruptionBudgets of {namespace}") from exc
            return list(answer.get("items") or [])

    def list_resource_claims(self, namespace: str | None = None) -> list[dict[str, Any]]:
        api = client.ResourceV1Api(self.api.api_client)
        with timed():
            try:
                if namespace:
                    response = api.list_namespaced_resource_claim(
                        namespace, _preload_content=False, _request_timeout=API_TIMEOUT_S
                    )
                else:
                    response = api.list_resource_claim_for_all_namespaces(
                        _preload_content=False, _request_timeout=API_TIMEOUT_S
                    )
            except Exception as exc:  # translated
                raise self.error_of(exc, f"list ResourceClaims of {namespace or 'all'}") from exc
            return list(self.read_json(response).get("items") or [])

    def list_resource_slices(self, driver: str) -> list[dict[str, Any]]:
        api = client.ResourceV1Api(self.api.api_client)
        with timed():
            try:
                response = api.list_resource_slice(
                    field_selector=f"spec.driver={driver}",
                    _preload_content=False,
                    _request_timeout=API_TIMEOUT_S,
                )
            except Exception as exc:  # translated
                raise self.error_of(exc, f"list ResourceSlices of {driver}") from exc
            return list(self.read_json(response).get("items") or [])

    def get_claim_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self._get_or_none(
            "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates/{name}",
            namespace,
            name,
            "resourceclaimtemplate",
        )

    def create_claim_template(self, template: dict[str, Any]) -> dict[str, Any]:
        namespace = template["metadata"]["namespace"]
        with timed():
            try:
                return self._request(
                    "POST",
                    "/apis/resource.k8s.io/v1/namespaces/{namespace}/resourceclaimtemplates",
                    {"namespace": namespace},
                    template,
                )
            except Exception as exc:  # translated
                name = template["metadata"].get("name")
                raise self.error_of(
                    exc, f"create resourceclaimtemplate {namespace}/{name}"
                ) from exc

    def review_token(self, token: str, audiences: list[str]) -> dict[str, Any]:
        """TokenReview: the API server's `status` for `token` (authenticated, user, error)."""
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token, "audiences": audiences},
        }
        with timed():
            try:
                response = client.AuthenticationV1Api(self.api.api_client).create_token_review(
                    body, _preload_content=False, _request_timeout=API_TIMEOUT_S
                )
            except Exception as exc:  # translated
                raise self.error_of(exc, "review a ServiceAccount token") from exc
            return dict(self.read_json(response).get("status") or {})

    def watch_pods(self, cursor: str | None, timeout_s: float) -> Iterator[WatchEvent]:
        if cursor is None:
            listing = self.read_json(self.api.list_pod_for_all_namespaces(_preload_content=False))
            cursor = str(listing.get("metadata", {}).get("resourceVersion", ""))
        stream = watch.Watch().stream(
            self.api.list_pod_for_all_namespaces,
            resource_version=cursor,
            timeout_seconds=max(1, int(timeout_s)),
            _preload_content=False,
        )
        for event in stream:
            raw = event.get("raw_object") or {}
            version = str(raw.get("metadata", {}).get("resourceVersion", cursor))
            yield WatchEvent(str(event.get("type")), raw, version)


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
        self._claims_rv = ""
        self._custom = client.CustomObjectsApi(kube.api.api_client)

    def _call(self, doing: str, fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with timed():
            try:
                return self.kube.read_json(fn(*args, _preload_content=False, **kwargs))
            except Exception as exc:  # translated into the reconciler's two error kinds
                error = self.kube.error_of(exc, doing)
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
        api = self.kube.api
        try:
            items, rv = self._paged("list pods", api.list_pod_for_all_namespaces, page_size)
        except WatchExpired:  # the continue token expired mid-list: start over, once
            items, rv = self._paged("list pods", api.list_pod_for_all_namespaces, page_size)
        self._rv = rv
        return [pod_view(item) for item in items], rv

    def watch_pods(self, resource_version: str, timeout_s: float) -> Iterator[Any]:
        self._rv = resource_version
        for kind, raw, version in self._watch(
            "watch pods", self.kube.api.list_pod_for_all_namespaces, resource_version, timeout_s
        ):
            self._rv = version or self._rv
            if kind != "BOOKMARK":
                yield PodEvent(kind, pod_view(raw))

    def _watch(
        self, doing: str, fn: Any, resource_version: str, timeout_s: float
    ) -> Iterator[tuple[str, dict[str, Any], str]]:
        """(type, object, its resourceVersion) of each event after `resource_version`, for up to
        `timeout_s`; bookmarks included (they move the resume point). WatchExpired when the
        version cannot be watched from, TemporaryError for the rest."""
        stream = watch.Watch().stream(
            fn,
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
                    raise TemporaryError(f"{doing}: {raw.get('message', raw)}")
                yield kind, raw, str((raw.get("metadata") or {}).get("resourceVersion") or "")
        except (WatchExpired, TemporaryError):
            raise
        except Exception as exc:  # connection trouble mid-watch: retry later
            error = self.kube.error_of(exc, doing)
            if _resume_point_lost(error.status, error.message):
                raise WatchExpired(error.message) from exc
            raise TemporaryError(error.message) from exc

    def get_pod(self, namespace: str, name: str) -> Any:
        try:
            obj = self.kube.get_pod(namespace, name)
        except KubeError as exc:
            raise TemporaryError(exc.message) from exc
        return None if obj is None else pod_view(obj)

    def list_node_names(self) -> set[str]:
        items, _ = self._paged("list nodes", self.kube.api.list_node, 500)
        return {str((n.get("metadata") or {}).get("name")) for n in items}

    def current_resource_version(self) -> str:
        page = self._call(
            "list pods", self.kube.api.list_pod_for_all_namespaces, limit=1, _request_timeout=30
        )
        return str((page.get("metadata") or {}).get("resourceVersion", ""))

    def last_resource_version(self) -> str:
        return self._rv

    def cluster_identity(self) -> str:
        """The UID of the `kube-system` namespace. The API server creates it when it first starts
        on an empty etcd and refuses to delete it, so the UID stays for the cluster's life and
        changes only with its store: a new cluster, or an etcd that is not this one's. An etcd
        restored from this cluster's own backup keeps it; a resume point from before the backup
        is then ahead of the API server, which `current_resource_version` tells. Without
        permission to read it (the chart grants `get` on that one namespace): "" and a warning;
        the resume point is then checked against the API server's version alone."""
        with timed():
            try:
                namespace = self.kube.read_json(
                    self.kube.api.read_namespace(
                        IDENTITY_NAMESPACE, _preload_content=False, _request_timeout=30
                    )
                )
            except Exception as exc:  # translated
                error = self.kube.error_of(exc, f"read namespace {IDENTITY_NAMESPACE}")
                if error.status in (401, 403, 404):
                    log.warning(
                        "%s: the reconciler cannot tell this cluster from another; a resume "
                        "point saved on another cluster would go unnoticed (grant get on "
                        "namespaces/%s)",
                        error.message,
                        IDENTITY_NAMESPACE,
                    )
                    return ""
                raise TemporaryError(error.message) from exc
        return str((namespace.get("metadata") or {}).get("uid") or "")

    def _resources(self, plural: str) -> Any:
        """The generic client's cluster-wide list of a resource.k8s.io/v1 kind, as a function
        of the list's keyword arguments (paginated and watched like pods)."""
        custom = self._custom

        def listing(**kwargs: Any) -> Any:
            return custom.list_cluster_custom_object(
                RESOURCE_GROUP, RESOURCE_VERSION, plural, **kwargs
            )

        return listing

    def list_claims(self, page_size: int = 500) -> tuple[list[Any], str]:
        listing = self._resources("resourceclaims")
        with _refused("list resourceclaims"):
            try:
                items, rv = self._paged("list resourceclaims", listing, page_size)
            except WatchExpired:  # the continue token expired mid-list: start over, once
                items, rv = self._paged("list resourceclaims", listing, page_size)
        self._claims_rv = rv
        return [claim_view(item) for item in items], rv

    def watch_claims(self, resource_version: str, timeout_s: float) -> Iterator[Any]:
        self._claims_rv = resource_version
        events = self._watch(
            "watch resourceclaims", self._resources("resourceclaims"), resource_version, timeout_s
        )
        with _refused("watch resourceclaims"):
            for kind, raw, version in events:
                self._claims_rv = version or self._claims_rv
                if kind != "BOOKMARK":
                    yield ClaimEvent(kind, claim_view(raw))

    def last_claims_resource_version(self) -> str:
        return self._claims_rv

    def published_devices(self) -> dict[Any, Any]:
        """Tessera's ResourceSlices only (a field selector on the driver)."""
        listing = self._resources("resourceslices")

        def ours(**kwargs: Any) -> Any:
            return listing(field_selector=f"spec.driver={DRA_DRIVER}", **kwargs)

        with _refused("list resourceslices"):
            items, _ = self._paged("list resourceslices", ours, 500)
        return published_devices(items)


@contextmanager
def _refused(doing: str) -> Iterator[None]:
    """A 403 or 404 from the API server, while `doing`, as ClaimsUnreadable: a grant or an API
    that is missing, which no retry brings."""
    try:
        yield
    except TemporaryError as exc:
        cause = exc.__cause__
        status = cause.status if isinstance(cause, ApiException) else None
        if status in (403, 404):
            raise ClaimsUnreadable(f"{doing}: {exc}") from exc
        raise
