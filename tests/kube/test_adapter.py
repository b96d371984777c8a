"""The Kubernetes adapter: the real client against a local HTTP server speaking the API
server's answers, and the embedded stand-in's pod and bind rules."""

from __future__ import annotations

import json
import threading
from http.server import ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client as k8s

from controlplane.kube.adapter import get_kube
from controlplane.kube.base import KubeError, api_ms, reset_api_ms
from controlplane.kube.embedded import EmbeddedKube
from controlplane.kube.real import RealKube
from tests.nodeplugin.harness.jsonhttp import JsonHandler
from tests.pods import gpu_pod

STATUS_201 = {
    "kind": "Status",
    "apiVersion": "v1",
    "metadata": {},
    "status": "Success",
    "code": 201,
}


class FakeApiServer(JsonHandler):
    """Answers the two calls bind makes, the way kube-apiserver does."""

    protocol_version = "HTTP/1.0"  # KeepAliveApiServer below speaks kube-apiserver's 1.1
    requests: list[tuple[str, str, Any]] = []
    binding_status = 201
    namespace_status = 200

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length) or b"{}")
        self.requests.append(("POST", self.path, body))
        if self.binding_status == 201:
            self.send_json(201, STATUS_201)
        else:
            self.send_json(
                self.binding_status,
                {"kind": "Status", "status": "Failure", "code": self.binding_status,
                 "message": 'pods "p" is already assigned to node "n9"', "reason": "Conflict"},
            )  # fmt: skip

    def do_DELETE(self) -> None:
        self.requests.append(("DELETE", self.path, None))
        if self.path == "/api/v1/namespaces/default/pods/p":
            self.send_json(200, {"kind": "Status", "status": "Success", "code": 200})
        else:
            self.send_json(404, {"kind": "Status", "code": 404, "message": "pods not found"})

    def do_GET(self) -> None:
        self.requests.append(("GET", self.path, None))
        if self.path.startswith("/api/v1/namespaces/default/pods/p"):
            self.send_json(200, gpu_pod())
        elif self.path.split("?")[0] == "/api/v1/namespaces/kube-system":
            if self.namespace_status == 200:
                namespace = {"kind": "Namespace", "metadata": {"name": "kube-system", "uid": "u-1"}}
                self.send_json(200, namespace)
            else:
                status = self.namespace_status
                self.send_json(status, {"kind": "Status", "code": status, "message": "refused"})
        elif self.path.startswith("/apis/resource.k8s.io/v1/"):
            self._send_dra(self.path.removeprefix("/apis/resource.k8s.io/v1/"))
        else:
            self.send_json(404, {"kind": "Status", "code": 404, "message": "pods not found"})

    def _send_dra(self, path: str) -> None:
        """DRA objects: a claim in team-a, a template t there, a slice of gpu.tessera.io."""
        route, _, query = path.partition("?")
        item = {"metadata": {"name": route.rsplit("/", 1)[-1]}}
        if route in ("namespaces/team-a/resourceclaims", "resourceclaims"):
            self.send_json(200, {"kind": "ResourceClaimList", "items": [item]})
        elif route == "namespaces/team-a/resourceclaimtemplates/t":
            self.send_json(200, {"kind": "ResourceClaimTemplate", **item})
        elif route == "resourceslices" and "spec.driver%3Dgpu.tessera.io" in query:
            self.send_json(200, {"kind": "ResourceSliceList", "items": [item]})
        else:
            self.send_json(404, {"kind": "Status", "code": 404, "message": "not found"})


@pytest.fixture
def api_server():
    FakeApiServer.requests = []
    FakeApiServer.binding_status = 201
    FakeApiServer.namespace_status = 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    config = k8s.Configuration()
    config.host = f"http://127.0.0.1:{server.server_address[1]}"
    yield RealKube.with_api(k8s.CoreV1Api(k8s.ApiClient(config)))
    server.shutdown()


class KeepAliveApiServer(FakeApiServer):
    """HTTP/1.1 keep-alive, as kube-apiserver; counts the connections clients open."""

    protocol_version = "HTTP/1.1"
    connections = 0

    def setup(self) -> None:
        type(self).connections += 1
        super().setup()


def test_reads_and_binds_reuse_one_connection_to_the_api_server() -> None:
    """A response left unread keeps its connection: every bind then paid a new connection (a
    TLS handshake against a real API server)."""
    FakeApiServer.requests, FakeApiServer.binding_status = [], 201
    KeepAliveApiServer.connections = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), KeepAliveApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = k8s.Configuration()
        config.host = f"http://127.0.0.1:{server.server_address[1]}"
        api = RealKube.with_api(k8s.CoreV1Api(k8s.ApiClient(config)))
        for i in range(5):
            assert api.get_pod("default", "p") is not None
            api.bind_pod("default", "p", f"uid-{i}", "n1", {})
        assert len(FakeApiServer.requests) == 10
        assert KeepAliveApiServer.connections == 1
    finally:
        server.shutdown()


def test_real_client_binding_answered_with_a_status_is_a_success(api_server) -> None:
    reset_api_ms()
    api_server.bind_pod("default", "p", "uid-1", "n1", {"tessera.io/allocation": "{}"})
    method, path, body = FakeApiServer.requests[-1]
    assert (method, path) == ("POST", "/api/v1/namespaces/default/pods/p/binding")
    assert body == {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": {
            "name": "p",
            "namespace": "default",
            "uid": "uid-1",
            "annotations": {"tessera.io/allocation": "{}"},
        },
        "target": {"apiVersion": "v1", "kind": "Node", "name": "n1"},
    }
    assert api_ms() > 0


def test_the_generated_client_alone_would_mistake_that_status_for_a_failure(api_server) -> None:
    """Why the adapter reads the raw answer: the stock call raises after the bind happened."""
    body = k8s.V1Binding(
        metadata=k8s.V1ObjectMeta(name="p", namespace="default"),
        target=k8s.V1ObjectReference(kind="Node", name="n1"),
    )
    with pytest.raises(ValueError, match="target"):
        api_server.api.create_namespaced_pod_binding("p", "default", body)
    assert FakeApiServer.requests[-1][0] == "POST"  # the POST did go out


def test_real_client_errors_become_kube_errors_with_what_we_know(api_server) -> None:
    FakeApiServer.binding_status = 409
    with pytest.raises(KubeError) as err:
        api_server.bind_pod("default", "p", "uid-1", "n1", {})
    assert err.value.status == 409 and err.value.applied is False
    assert "already assigned" in err.value.message
    FakeApiServer.binding_status = 500
    with pytest.raises(KubeError) as err:
        api_server.bind_pod("default", "p", "uid-1", "n1", {})
    assert err.value.status == 500 and err.value.applied is None


def test_real_client_reads_pods_as_the_api_server_serves_them(api_server) -> None:
    pod = api_server.get_pod("default", "p")
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert api_server.get_pod("default", "missing") is None


def test_real_client_reads_claims_templates_and_the_drivers_slices(api_server) -> None:
    assert [c["metadata"]["name"] for c in api_server.list_resource_claims("team-a")] == [
        "resourceclaims"
    ]
    assert len(api_server.list_resource_claims()) == 1
    assert api_server.get_claim_template("team-a", "t")["metadata"]["name"] == "t"
    assert api_server.get_claim_template("team-a", "gone") is None
    assert len(api_server.list_resource_slices("gpu.tessera.io")) == 1
    with pytest.raises(KubeError) as err:
        api_server.list_resource_claims("team-b")
    assert err.value.not_found


def test_the_cluster_identity_is_the_uid_of_kube_system(api_server, caplog) -> None:
    """The reconciler's resume point is tied to it (docs/reconciler.md). Without permission to
    read the namespace: no identity and a warning naming the grant; the API server away: a
    temporary error, retried like any other."""
    from controlplane.kube.real import RealClusterSource
    from controlplane.kube.sources import TemporaryError

    source = RealClusterSource(api_server)
    assert source.cluster_identity() == "u-1"
    FakeApiServer.namespace_status = 403
    assert source.cluster_identity() == ""
    assert "grant get on namespaces/kube-system" in caplog.text
    FakeApiServer.namespace_status = 503
    with pytest.raises(TemporaryError, match="503"):
        source.cluster_identity()


def test_unreachable_api_server_is_a_not_applied_error() -> None:
    config = k8s.Configuration()
    config.host = "http://127.0.0.1:9"  # discard port: nothing listens
    config.retries = False
    adapter = RealKube.with_api(k8s.CoreV1Api(k8s.ApiClient(config)))
    with pytest.raises(KubeError) as err:
        adapter.bind_pod("default", "p", "uid-1", "n1", {})
    assert err.value.applied is False and "unreachable" in err.value.message


# --- the embedded stand-in -----------------------------------------------------------------------


@pytest.mark.django_db
def test_embedded_pods_create_get_list_bind_watch_delete() -> None:
    api = EmbeddedKube()
    cursor = "0"
    created = api.create_pod(gpu_pod("a"))
    uid = created["metadata"]["uid"]
    assert created["status"]["phase"] == "Pending"
    with pytest.raises(KubeError) as dup:
        api.create_pod(gpu_pod("a"))
    assert dup.value.conflict
    assert api.get_pod("default", "a")["metadata"]["uid"] == uid
    assert api.get_pod("default", "zzz") is None

    with pytest.raises(KubeError) as wrong_uid:
        api.bind_pod("default", "a", "not-the-uid", "n1", {})
    assert wrong_uid.value.conflict and "Precondition" in wrong_uid.value.message
    api.bind_pod("default", "a", uid, "n1", {"tessera.io/allocation": "{}"})
    bound = api.get_pod("default", "a")
    assert bound["spec"]["nodeName"] == "n1"
    assert bound["metadata"]["annotations"]["tessera.io/allocation"] == "{}"
    with pytest.raises(KubeError) as twice:
        api.bind_pod("default", "a", uid, "n2", {})
    assert twice.value.conflict and "already assigned" in twice.value.message
    assert [p["metadata"]["name"] for p in api.list_pods(node_name="n1")] == ["a"]
    assert api.list_pods(node_name="n2") == []

    assert api.delete_pod("default", "a") is True
    assert api.delete_pod("default", "a") is False
    events = [(e.type, e.pod["metadata"]["name"]) for e in api.watch_pods(cursor, 0)]
    assert events == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
    with pytest.raises(KubeError) as gone:
        api.bind_pod("default", "a", uid, "n1", {})
    assert gone.value.not_found


def test_get_kube_follows_the_configured_mode(settings) -> None:
    settings.TESSERA = {**settings.TESSERA, "KUBE_MODE": "embedded"}
    assert isinstance(get_kube(), EmbeddedKube)
    assert get_kube() is get_kube()


def test_real_client_delete_says_whether_the_pod_was_there(api_server) -> None:
    assert api_server.delete_pod("default", "p") is True
    assert api_server.delete_pod("default", "gone") is False
    assert [r[:2] for r in FakeApiServer.requests] == [
        ("DELETE", "/api/v1/namespaces/default/pods/p"),
        ("DELETE", "/api/v1/namespaces/default/pods/gone"),
    ]


# --- the lean request path (real._LeanClient) ----------------------------------------------------


class SeesAuth(KeepAliveApiServer):
    """Keeps what each request carried for authentication, and closes its connection after
    `close_after` requests (kube-apiserver ends idle keep-alive connections too)."""

    seen: list[tuple[str | None, Any]] = []
    close_after = 0

    def do_POST(self) -> None:
        peer = self.connection.getpeercert() if hasattr(self.connection, "getpeercert") else None
        type(self).seen.append((self.headers.get("Authorization"), peer))
        super().do_POST()
        if type(self).close_after and len(type(self).seen) % type(self).close_after == 0:
            self.close_connection = True


@pytest.fixture
def pki(tmp_path):
    from e2e.certificates import make_certificates

    make_certificates(tmp_path)
    return tmp_path


def _tls_server(pki, *, client_ca: bool) -> ThreadingHTTPServer:
    import ssl

    FakeApiServer.requests, FakeApiServer.binding_status = [], 201
    SeesAuth.seen, SeesAuth.connections, SeesAuth.close_after = [], 0, 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), SeesAuth)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pki / "apiserver.crt", pki / "apiserver.key")
    if client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(pki / "ca.crt")
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_binds_go_over_tls_with_the_configured_ca_client_cert_and_fresh_token(pki) -> None:
    server = _tls_server(pki, client_ca=True)
    try:
        config = k8s.Configuration()
        config.host = f"https://127.0.0.1:{server.server_address[1]}"
        config.ssl_ca_cert, config.cert_file = str(pki / "ca.crt"), str(pki / "admin.crt")
        config.key_file = str(pki / "admin.key")
        tokens = iter(["t1", "t2", "t3"])

        def rotate(cfg: k8s.Configuration) -> None:  # as in-cluster config re-reads its file
            cfg.api_key["authorization"] = next(tokens)

        config.api_key["authorization"], config.api_key_prefix["authorization"] = "t0", "Bearer"
        config.refresh_api_key_hook = rotate
        adapter = RealKube.with_api(k8s.CoreV1Api(k8s.ApiClient(config)))
        assert adapter._lean is not None
        for i in range(3):
            adapter.bind_pod("default", "p", f"uid-{i}", "n1", {})
        assert [auth for auth, _ in SeesAuth.seen] == ["Bearer t1", "Bearer t2", "Bearer t3"]
        assert SeesAuth.connections == 1  # one TLS handshake for all three
        assert FakeApiServer.requests[-1][2]["metadata"]["uid"] == "uid-2"
    finally:
        server.shutdown()


def test_a_server_the_ca_does_not_vouch_for_is_unreachable_and_nothing_was_sent(pki, tmp_path):
    from e2e.certificates import make_certificates

    server = _tls_server(pki, client_ca=False)
    other = tmp_path / "other"
    make_certificates(other)
    try:
        config = k8s.Configuration()
        config.host = f"https://127.0.0.1:{server.server_address[1]}"
        config.ssl_ca_cert = str(other / "ca.crt")
        adapter = RealKube.with_api(k8s.CoreV1Api(k8s.ApiClient(config)))
        with pytest.raises(KubeError) as err:
            adapter.bind_pod("default", "p", "uid-1", "n1", {})
        assert err.value.applied is False and "unreachable" in err.value.message
        assert "CERTIFICATE_VERIFY_FAILED" in err.value.message
        assert FakeApiServer.requests == []
    finally:
        server.shutdown()


def test_a_connection_the_server_closed_is_replaced_before_the_next_bind() -> None:
    FakeApiServer.requests, FakeApiServer.binding_status = [], 201
    SeesAuth.seen, SeesAuth.connections, SeesAuth.close_after = [], 0, 2
    server = ThreadingHTTPServer(("127.0.0.1", 0), SeesAuth)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = k8s.Configuration()
        config.host = f"http://127.0.0.1:{server.server_address[1]}"
        adapter = RealKube.with_api(k8s.CoreV1Api(k8s.ApiClient(config)))
        for i in range(5):
            adapter.bind_pod("default", "p", f"uid-{i}", "n1", {})  # no error on the stale one
        assert len(FakeApiServer.requests) == 5 and SeesAuth.connections == 3
    finally:
        server.shutdown()


def test_a_proxy_keeps_the_official_client_path() -> None:
    config = k8s.Configuration()
    config.host = "https://127.0.0.1:6443"
    config.proxy = "http://127.0.0.1:3128"
    assert RealKube.with_api(k8s.CoreV1Api(k8s.ApiClient(config)))._lean is None
    config.proxy, config.tls_server_name = None, "kubernetes.default.svc"
    assert RealKube.with_api(k8s.CoreV1Api(k8s.ApiClient(config)))._lean is None
    config.tls_server_name = None
    assert RealKube.with_api(k8s.CoreV1Api(k8s.ApiClient(config)))._lean is not None
