"""A scheduler extender that decides nothing: the benchmark's baseline for "an extender at all".

    python e2e/noop_extender.py --port N --apiserver URL --ca CA --cert CRT --key KEY

It answers every verb the way Tessera's extender is configured (filter, prioritize, bind):
filter keeps every node, prioritize scores every node 0, bind creates the pod's Binding through
the API server (the least any binding extender must do). Standard library only:
ThreadingHTTPServer, and a shared pool of keep-alive HTTPS connections to the API server.
kube-scheduler opens a new connection (so the server a new thread) for many of its parallel
binds: a connection to the API server per thread would cost the API server a TLS handshake per
such bind, and make the baseline dearer than it needs to be.
"""

from __future__ import annotations

import argparse
import http.client
import json
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

MAX_IDLE = 32  # idle connections kept to the API server


class Binder:
    def __init__(self, apiserver: str, ca: str, cert: str, key: str) -> None:
        url = urlsplit(apiserver)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 443
        self.context = ssl.create_default_context(cafile=ca)
        self.context.load_cert_chain(cert, key)
        self._idle: list[http.client.HTTPSConnection] = []  # most recently used last
        self._lock = threading.Lock()

    def _take(self) -> http.client.HTTPSConnection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return http.client.HTTPSConnection(self.host, self.port, context=self.context, timeout=10)

    def _give(self, conn: http.client.HTTPSConnection) -> None:
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
                return
        conn.close()

    def bind(self, namespace: str, name: str, uid: str, node: str) -> str:
        body = json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Binding",
                "metadata": {"name": name, "namespace": namespace, "uid": uid},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node},
            }
        )
        path = f"/api/v1/namespaces/{namespace}/pods/{name}/binding"
        for attempt in range(2):  # one retry on a connection the server closed meanwhile
            conn = self._take()
            try:
                conn.request("POST", path, body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                text = resp.read().decode(errors="replace")
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                if attempt:
                    return f"binding {namespace}/{name}: {exc}"
                continue
            self._give(conn)
            return (
                ""
                if resp.status in (200, 201)
                else f"binding {namespace}/{name}: {resp.status} {text[:300]}"
            )
        return f"binding {namespace}/{name}: no answer"


def make_handler(binder: Binder) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as Go's client expects
        # Headers and body leave in two writes: without TCP_NODELAY, Nagle's algorithm and the
        # client's delayed ACK hold every answer back by ~40 ms.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet: a log line per call would be the benchmark's biggest cost

        def _answer(self, code: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer(200, {"status": "ok"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            try:
                args = json.loads(self.rfile.read(length) or b"{}")
            except ValueError:
                self._answer(400, {"Error": "body is not JSON"})
                return
            verb = self.path.rstrip("/").rsplit("/", 1)[-1]
            names = args.get("NodeNames") or args.get("nodenames") or []
            if verb == "filter":
                self._answer(200, {"NodeNames": names, "FailedNodes": {}, "Error": ""})
            elif verb == "prioritize":
                self._answer(200, [{"Host": n, "Score": 0} for n in names])
            elif verb == "bind":
                error = binder.bind(
                    args.get("PodNamespace", ""), args.get("PodName", ""),
                    args.get("PodUID", ""), args.get("Node", ""),
                )  # fmt: skip
                self._answer(200, {"Error": error})
            else:
                self._answer(404, {"Error": f"unknown verb {verb!r}"})

    return Handler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="no-op scheduler extender")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--apiserver", required=True)
    parser.add_argument("--ca", required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    args = parser.parse_args(argv)
    binder = Binder(args.apiserver, args.ca, args.cert, args.key)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(binder))
    server.daemon_threads = True
    print(f"no-op extender on 127.0.0.1:{args.port}", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
