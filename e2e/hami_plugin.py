"""What HAMi's device plugin does once HAMi's scheduler has bound a pod, for kwok's nodes.

    python e2e/hami_plugin.py --apiserver URL --ca CA --cert CRT --key KEY

HAMi's scheduler extender (set-up (d) of bench/bench_e2e.py, e2e/hami.py) takes a lock on the
node in its bind, `hami.io/mutex.lock` = "<RFC 3339 time>,<namespace>,<pod>", marks the pod
`hami.io/bind-phase: allocating` and creates the Binding. On a real node the kubelet then asks
HAMi's device plugin to Allocate the pod's devices, and the plugin marks the pod
`hami.io/bind-phase: success` and takes the lock off the node. Until it does, every other pod
bound to that node waits: the scheduler retries the lock every 100 ms for up to 28 s, then
fails the bind. kwok runs no device plugin, so this process does the plugin's part, as early as
it could ever happen: the moment a bound pod in the allocating phase appears on its watch (HAMi's
best case; a kubelet would come later). Standard library and requests only.

It watches every pod that has a node; for each one in the allocating phase it patches the pod's
phase to success, then removes the node's lock if this pod holds it, with the node's
resourceVersion in the patch as HAMi's own release does, read again on a conflict.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import requests

NODE_LOCK = "hami.io/mutex.lock"
BIND_PHASE = "hami.io/bind-phase"
ALLOCATING = "allocating"
SUCCESS = "success"
LOCK_SEPARATOR = ","
WORKERS = 8
READY = "listed the bound pods, watching"
SEEN_LIMIT = 100_000  # pod uids remembered as done (a pod is released once)


def lock_held_by(value: str, namespace: str, name: str) -> bool:
    """Whether the node lock `value` is this pod's to release. A lock of the older form, a bare
    timestamp, names no owner, and HAMi's release takes it off for any pod."""
    if LOCK_SEPARATOR not in value:
        return True
    return value.endswith(f"{LOCK_SEPARATOR}{namespace}{LOCK_SEPARATOR}{name}")


def waiting_for_allocation(pod: dict[str, Any]) -> bool:
    """A pod HAMi has bound and whose devices no plugin has allocated yet."""
    annotations = pod.get("metadata", {}).get("annotations") or {}
    return bool(pod.get("spec", {}).get("nodeName")) and annotations.get(BIND_PHASE) == ALLOCATING


def release_patch(node: dict[str, Any], namespace: str, name: str) -> dict[str, Any] | None:
    """The merge patch that takes this pod's lock off `node`, guarded by the node's
    resourceVersion; None when there is no lock of this pod's to take off."""
    metadata = node.get("metadata", {})
    value = (metadata.get("annotations") or {}).get(NODE_LOCK)
    if value is None or not lock_held_by(value, namespace, name):
        return None
    return {
        "metadata": {
            "annotations": {NODE_LOCK: None},
            "resourceVersion": metadata.get("resourceVersion", ""),
        }
    }


class Plugin:
    def __init__(self, apiserver: str, ca: str, cert: str, key: str) -> None:
        self.base = apiserver.rstrip("/")
        self.ca, self.cert = ca, (cert, key)
        self.local = threading.local()
        self.seen: set[str] = set()
        self.lock = threading.Lock()
        self.released = 0
        self.delays: list[float] = []  # seconds from the watch event to the lock gone

    def session(self) -> requests.Session:
        session = getattr(self.local, "session", None)
        if session is None:
            session = requests.Session()
            session.trust_env = False
            session.verify, session.cert = self.ca, self.cert
            self.local.session = session
        return session

    def patch(self, path: str, body: dict[str, Any]) -> requests.Response:
        return self.session().patch(
            f"{self.base}{path}",
            data=json.dumps(body),
            headers={"Content-Type": "application/merge-patch+json"},
            timeout=30,
        )

    def allocate(self, namespace: str, name: str, node_name: str, seen_at: float) -> None:
        pod_path = f"/api/v1/namespaces/{namespace}/pods/{name}"
        response = self.patch(pod_path, {"metadata": {"annotations": {BIND_PHASE: SUCCESS}}})
        if response.status_code not in (200, 404):
            print(f"hami-plugin: {pod_path}: {response.status_code} {response.text[:200]}")
        node_path = f"/api/v1/nodes/{node_name}"
        for _ in range(50):
            node = self.session().get(f"{self.base}{node_path}", timeout=30)
            if node.status_code != 200:
                print(f"hami-plugin: GET {node_path}: {node.status_code}", flush=True)
                return
            body = release_patch(node.json(), namespace, name)
            if body is None:
                break
            response = self.patch(node_path, body)
            if response.status_code == 200:
                break
            if response.status_code != 409:  # 409: the node changed since; read it again
                print(f"hami-plugin: {node_path}: {response.status_code} {response.text[:200]}")
                return
        with self.lock:
            self.released += 1
            self.delays.append(time.monotonic() - seen_at)

    def run(self) -> None:
        pool = ThreadPoolExecutor(WORKERS)
        threading.Thread(target=self.report, daemon=True).start()
        first = True
        while True:
            listed = self.session().get(
                f"{self.base}/api/v1/pods?fieldSelector=spec.nodeName%21%3D", timeout=120
            )
            listed.raise_for_status()
            body = listed.json()
            for pod in body.get("items", []):
                self.offer(pool, pod)
            if first:  # what the harness waits for before it starts HAMi's scheduler
                print(f"hami-plugin: {READY} ({len(body.get('items', []))} bound)", flush=True)
                first = False
            self.watch(pool, body["metadata"]["resourceVersion"])

    def watch(self, pool: ThreadPoolExecutor, resource_version: str) -> None:
        """Until the watch ends (its timeout, or 410 Gone: list again)."""
        path = (
            "/api/v1/pods?watch=true&fieldSelector=spec.nodeName%21%3D"
            f"&resourceVersion={resource_version}&allowWatchBookmarks=true&timeoutSeconds=600"
        )
        try:
            with self.session().get(f"{self.base}{path}", stream=True, timeout=(10, 700)) as resp:
                resp.raise_for_status()
                for line in resp.iter_lines():
                    if not line:
                        continue
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        return
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        self.offer(pool, event["object"])
        except requests.RequestException as exc:
            print(f"hami-plugin: the watch broke ({exc}); listing again", flush=True)
            time.sleep(1)

    def offer(self, pool: ThreadPoolExecutor, pod: dict[str, Any]) -> None:
        if not waiting_for_allocation(pod):
            return
        metadata = pod["metadata"]
        uid = metadata.get("uid", "")
        with self.lock:
            if uid in self.seen:
                return
            if len(self.seen) >= SEEN_LIMIT:
                self.seen.clear()  # a pod seen again is patched again: harmless
            self.seen.add(uid)
        pool.submit(
            self.allocate,
            metadata["namespace"],
            metadata["name"],
            pod["spec"]["nodeName"],
            time.monotonic(),
        )

    def report(self) -> None:
        """A line every 10 s while pods are being released: how many, and how fast."""
        last = 0
        while True:
            time.sleep(10)
            with self.lock:
                count, delays = self.released, sorted(self.delays)
                self.delays.clear()
            if count != last and delays:
                print(
                    f"hami-plugin: {count} pods allocated; last 10 s: {len(delays)}, watch event "
                    f"to lock released p50 {1000 * delays[len(delays) // 2]:.1f} ms, max "
                    f"{1000 * delays[-1]:.1f} ms",
                    flush=True,
                )
            last = count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--apiserver", required=True)
    parser.add_argument("--ca", required=True)
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    args = parser.parse_args(argv)
    Plugin(args.apiserver, args.ca, args.cert, args.key).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
