"""A tiny JSON-over-HTTP(S) client with a bearer token read from a file (blocking; callers run
it in a thread). The token file is re-read when it changes: projected ServiceAccount tokens
rotate."""

from __future__ import annotations

import http.client
import json
import socket
import ssl
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_BODY = 1024 * 1024


class HttpUnavailable(RuntimeError):
    """The server could not be reached or answered 5xx: retry later."""


@dataclass(frozen=True)
class HttpResponse:
    status: int
    body: Any  # decoded JSON, or the text when it is not JSON

    def error_text(self) -> str:
        if isinstance(self.body, dict):
            for key in ("error", "detail", "message"):
                if key in self.body:
                    return str(self.body[key])
        return str(self.body)[:300]


class TokenFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._token = ""
        self._lock = threading.Lock()

    def get(self) -> str:
        with self._lock:
            try:
                st = self.path.stat()
            except OSError as exc:
                raise HttpUnavailable(
                    f"token file {self.path} cannot be read ({exc.strerror}); set "
                    "TESSERA_TOKEN_FILE to a node token (manage.py createtoken <node> --role node)"
                ) from None
            stamp = (st.st_ino, st.st_mtime_ns)
            if stamp != self._stamp:
                self._token = self.path.read_text().strip()
                self._stamp = stamp
            return self._token


class JsonClient:
    def __init__(
        self, base_url: str, token: TokenFile | None, ca_file: Path | None, timeout_s: float
    ) -> None:
        parsed = urllib.parse.urlsplit(base_url)
        self.scheme = parsed.scheme
        self.host = parsed.hostname or ""
        self.port = parsed.port
        self.prefix = parsed.path.rstrip("/")
        self.token = token
        self.timeout = timeout_s
        self._ssl: ssl.SSLContext | None = None
        if self.scheme == "https":
            self._ssl = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        self._local = threading.local()
        self.base_url = base_url

    def _conn(self) -> http.client.HTTPConnection:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            if self.scheme == "https":
                conn = http.client.HTTPSConnection(
                    self.host, self.port, timeout=self.timeout, context=self._ssl
                )
            else:
                conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
            conn.connect()
            # Headers and body may leave in separate segments: without this, Nagle plus the
            # peer's delayed ACK can add 40 ms to a request.
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._local.conn = conn
        return conn

    def request(self, method: str, path: str, body: Any = None) -> HttpResponse:
        headers = {"Accept": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token.get()}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        url = self.prefix + path
        for attempt in (1, 2):  # one retry on a keep-alive connection the server closed
            try:
                conn = self._conn()
            except OSError as exc:
                raise HttpUnavailable(
                    f"{method} {self.base_url}{path}: cannot reach the server ({exc})"
                ) from None
            try:
                conn.request(method, url, body=data, headers=headers)
                resp = conn.getresponse()
                raw = resp.read(MAX_BODY + 1)
                status = resp.status
                if resp.will_close:
                    conn.close()
                    self._local.conn = None
                break
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                self._local.conn = None
                if attempt == 2 or not isinstance(
                    exc, http.client.RemoteDisconnected | BrokenPipeError | ConnectionResetError
                ):
                    raise HttpUnavailable(
                        f"{method} {self.base_url}{path}: cannot reach the server ({exc})"
                    ) from None
        try:
            decoded: Any = json.loads(raw) if raw else None
        except ValueError:
            decoded = raw.decode(errors="replace")
        if status >= 500:
            text = HttpResponse(status, decoded).error_text()
            raise HttpUnavailable(f"{method} {self.base_url}{path}: server error {status} {text}")
        return HttpResponse(status, decoded)
