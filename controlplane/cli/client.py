"""Finding the control plane, its token, and talking to its REST API.

Two ways to the control plane:
- direct: `--server URL` or `TESSERA_SERVER` (a port-forward, an Ingress, the Service's address),
  the token in `Authorization: Bearer`;
- through the API server's service proxy, with the kubeconfig's credentials
  (`/api/v1/namespaces/<ns>/services/<name>:<port>/proxy/...`). The API server takes the
  `Authorization` header for itself and does not pass it on, so there the Tessera token rides in
  `X-Tessera-Token`, which the control plane reads when `Authorization` is absent.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import urllib3
from kubernetes import client as kube_client
from kubernetes import config as kube_config
from kubernetes.config.config_exception import ConfigException

SERVER_ENV = "TESSERA_SERVER"
TOKEN_ENV = "TESSERA_TOKEN"  # noqa: S105 - a variable's name
# The Helm chart's names with `helm install tessera ... --namespace tessera-system`
# (docs/operator-guide.md): the Service is the release's full name, its HTTP port is named http.
DEFAULT_NAMESPACE = "tessera-system"
DEFAULT_SERVICE = "tessera"
DEFAULT_PORT = "http"
PROXY_TOKEN_HEADER = "X-Tessera-Token"  # noqa: S105 - a header's name
TIMEOUT_S = 20.0
PAGE_SIZE = 500  # the API's largest page


class CliError(Exception):
    """A failure to tell the user in one line; `code` is the process's exit status."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


class ApiError(CliError):
    """The control plane (or the API server in front of it) answered with an error status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Settings:
    """What the command line and the environment say about where Tessera is."""

    server: str | None = None
    token: str | None = None
    token_secret: str | None = None
    kubeconfig: str | None = None
    context: str | None = None
    namespace: str = DEFAULT_NAMESPACE
    service: str = DEFAULT_SERVICE
    port: str = DEFAULT_PORT
    insecure: bool = False


def proxy_path(namespace: str, service: str, port: str) -> str:
    """The API server's path that proxies to the control plane's Service."""
    target = f"{service}:{port}" if port else service
    return (
        f"/api/v1/namespaces/{quote(namespace, safe='')}/services/{quote(target, safe=':')}/proxy"
    )


def split_secret(ref: str) -> tuple[str, str]:
    """`NS/NAME` of `--token-secret` as (namespace, name)."""
    namespace, sep, name = ref.partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise CliError(f"--token-secret {ref!r}: give NAMESPACE/NAME of a Secret with key 'token'")
    return namespace, name


class Transport:
    """One HTTP connection setup: a base URL, headers every request carries, a pool."""

    def __init__(
        self, base: str, headers: dict[str, str], pool: urllib3.PoolManager, via: str
    ) -> None:
        self.base = base.rstrip("/")
        self.headers = headers
        self.pool = pool
        self.via = via  # for error messages: where the requests go

    def request(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        url = self.base + path
        headers = {**self.headers, "Accept": "application/json"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            response = self.pool.request(
                method,
                url,
                body=data,
                headers=headers,
                timeout=urllib3.Timeout(total=TIMEOUT_S),
                retries=False,
                redirect=False,
            )
        except urllib3.exceptions.HTTPError as exc:
            reason = getattr(exc, "reason", None) or exc
            raise CliError(f"cannot reach Tessera at {self.via}: {reason}") from None
        return response.status, response.data


def _kube_api(settings: Settings) -> kube_client.ApiClient:
    try:
        api: kube_client.ApiClient = kube_config.new_client_from_config(  # type: ignore[no-untyped-call]
            config_file=settings.kubeconfig, context=settings.context
        )
        return api
    except (ConfigException, OSError, TypeError, ValueError) as exc:
        where = settings.kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise CliError(
            f"cannot use the kubeconfig {where}: {exc}; or give --server URL (or {SERVER_ENV})"
        ) from None


def _kube_headers(api: kube_client.ApiClient) -> dict[str, str]:
    """The kubeconfig's header credentials (a bearer token, also one an exec plugin refreshes);
    client certificates are already in the client's connection pool."""
    headers: dict[str, str] = {}
    for setting in api.configuration.auth_settings().values():
        if setting.get("in") == "header" and setting.get("value"):
            headers[str(setting["key"])] = str(setting["value"])
    return headers


def _secret_token(settings: Settings, api: kube_client.ApiClient | None) -> str:
    namespace, name = split_secret(settings.token_secret or "")
    api = api or _kube_api(settings)
    host = api.configuration.host
    try:
        secret = kube_client.CoreV1Api(api).read_namespaced_secret(name, namespace)
    except kube_client.ApiException as exc:
        if exc.status == 404:
            raise CliError(f"secret {namespace}/{name} not found (--token-secret)") from None
        if exc.status in (401, 403):
            raise CliError(
                f"the kubeconfig's identity may not read secret {namespace}/{name} "
                f"({exc.status}): it needs 'get secrets' in {namespace}, or use --token"
            ) from None
        raise CliError(f"reading secret {namespace}/{name}: {exc.status} {exc.reason}") from None
    except urllib3.exceptions.HTTPError as exc:
        raise CliError(f"cannot reach the API server at {host}: {exc}") from None
    raw = (secret.data or {}).get("token")
    if not raw:
        raise CliError(f"secret {namespace}/{name} has no key 'token'")
    try:
        return base64.b64decode(raw).decode().strip()
    except (binascii.Error, UnicodeDecodeError):
        raise CliError(f"secret {namespace}/{name}: key 'token' is not text") from None


def connect(settings: Settings) -> Client:
    """A client for the control plane the settings point at (see the module's docstring)."""
    server = settings.server or os.environ.get(SERVER_ENV) or None
    api = None if server else _kube_api(settings)
    token = settings.token or os.environ.get(TOKEN_ENV) or None
    if not token and settings.token_secret:
        token = _secret_token(settings, api)
    if not token:
        raise CliError(
            f"no token: give --token, set {TOKEN_ENV}, or --token-secret NAMESPACE/NAME "
            "(an operator makes one with `manage.py createtoken NAME --role viewer`)"
        )
    if server:
        parts = urlsplit(server)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise CliError(f"--server {server!r}: give a URL like https://tessera.example.com")
        pool = urllib3.PoolManager(cert_reqs="CERT_NONE" if settings.insecure else "CERT_REQUIRED")
        if settings.insecure:
            urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
        transport = Transport(server, {"Authorization": f"Bearer {token}"}, pool, server)
        return Client(transport, proxied=False)
    assert api is not None
    path = proxy_path(settings.namespace, settings.service, settings.port)
    base = api.configuration.host.rstrip("/") + path
    headers = {**_kube_headers(api), PROXY_TOKEN_HEADER: token}
    transport = Transport(base, headers, api.rest_client.pool_manager, base)
    return Client(transport, proxied=True)


def _error_text(body: bytes) -> tuple[str, bool]:
    """The error message in an answer's body, and whether the API server (not Tessera) wrote it
    (its Status object)."""
    try:
        data = json.loads(body)
    except ValueError:
        text = body.decode(errors="replace").strip().splitlines()
        return (text[0][:300] if text else ""), False
    if isinstance(data, dict):
        if data.get("kind") == "Status":
            return str(data.get("message", "")), True
        if "error" in data:
            return str(data["error"]), False
        if "detail" in data:
            return str(data["detail"]), False
    return json.dumps(data)[:300], False


class Client:
    """The control plane's REST API: JSON in, JSON out, errors as `ApiError`."""

    def __init__(self, transport: Transport, proxied: bool) -> None:
        self.transport = transport
        self.proxied = proxied
        self.role = "viewer"  # what the command needs, for a 403's message

    def call(self, method: str, path: str, body: Any = None, **query: Any) -> Any:
        params = {k: v for k, v in query.items() if v is not None}
        full = "/api/v1/" + path.lstrip("/") + ("?" + urlencode(params) if params else "")
        status, data = self.transport.request(method, full, body)
        if 200 <= status < 300:
            if not data:
                return None
            try:
                return json.loads(data)
            except ValueError:
                raise ApiError(
                    f"{self.transport.via} answered {status} with something that is not JSON: "
                    "is this Tessera's control plane?",
                    status,
                ) from None
        raise self._error(status, data)

    def _error(self, status: int, body: bytes) -> ApiError:
        text, from_apiserver = _error_text(body)
        if from_apiserver:
            # The API server refused or could not proxy: the Service, not Tessera, is at fault.
            hint = ""
            if status in (401, 403):
                hint = (
                    ": the kubeconfig's identity needs 'get services/proxy' on the Service "
                    "(or give --server URL)"
                )
            elif status in (404, 503):
                hint = ": check --tessera-namespace, --tessera-service and --tessera-port"
            return ApiError(
                f"the API server's proxy to Tessera said {status}: {text}{hint}", status
            )
        if status == 401:
            return ApiError(
                f"token refused (401): {text} Give a valid token (--token, {TOKEN_ENV} or "
                f"--token-secret) of an identity with the {self.role} role.",
                status,
            )
        if status == 403:
            return ApiError(
                f"forbidden (403): {text} This command needs the {self.role} role.", status
            )
        if status == 404:
            return ApiError(f"not found (404): {text}", status)
        if status == 400:
            return ApiError(f"refused (400): {text}", status)
        return ApiError(f"Tessera answered {status}: {text}", status)

    def get(self, path: str, **query: Any) -> Any:
        return self.call("GET", path, **query)

    def pages(self, path: str, **query: Any) -> Iterator[dict[str, Any]]:
        """Every row of a paginated list, page by page (the pages' `next` links name the
        server's own host, which through the proxy is not the one to use)."""
        page = 1
        while True:
            answer = self.call("GET", path, page=page, page_size=PAGE_SIZE, **query)
            yield from answer.get("results", [])
            if not answer.get("next"):
                return
            page += 1
