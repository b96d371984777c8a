"""Kueue (sigs.k8s.io/kueue, pinned in e2e/versions.env) on the harness cluster, for the tests that
run Tessera under it (tests/e2e/test_kueue.py, docs/kueue.md).

`start()` applies Kueue's CRDs, writes its Configuration (the pod integration alone, only pods
that name a queue, no leader election, no internal certificate management), starts `kueue` as a
component of the harness run (log `logs/kueue.log`, stopped by pid like the others), starts
kube-controller-manager with its garbage collector alone (component `garbage-collector`), and
registers Kueue's own pod and kueue.x-k8s.io admission webhooks, as its release manifests write
them, pointed at its webhook server on loopback with the harness CA, and limited to namespaces
labelled `NAMESPACE_LABEL=true` so the rest of the harness never calls Kueue. `stop()` removes
the webhook registrations first, then stops both processes. The CRDs (and the queues a test made)
stay: they cost nothing once Kueue is gone, and a later `start()` finds them in place.

Kueue relies on the garbage collector: a Workload is owned by its pod, and when the pod goes
Kueue only drops the Workload's finalizer and leaves deleting it, which gives the pod's quota
back, to the garbage collector, as in any cluster. The harness runs no kube-controller-manager,
so without one a deleted pod's quota would stay taken for good. While it runs it collects any
dependent object whose owner is gone, cluster-wide, as it would in a real cluster.

Kueue serves its webhooks with the harness's loopback serving certificate (the one Tessera's
webhook uses, signed by the run's CA). With internal certificate management off, Kueue v0.17.0
also reads its metrics server's certificate from a fixed path, /etc/kueue/metrics/certs, and
exits when it is missing. Rather than write into the machine's /etc, the process runs in a mount
namespace of its own (`unshare --user --map-root-user --mount`) where /etc is a read-only overlay
of the real /etc and a folder of the run that holds that certificate; nothing outside the run
folder changes.
"""

from __future__ import annotations

import base64
import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import Cluster
from e2e.harness import HarnessError, build_binaries
from e2e.ports import free_port
from e2e.processes import get_ok

QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
MANAGED_LABEL = "kueue.x-k8s.io/managed"  # and the finalizer of the same name
ADMISSION_GATE = "kueue.x-k8s.io/admission"
# Kueue's webhooks see only the namespaces carrying this label (value "true").
NAMESPACE_LABEL = "tessera.io/e2e-kueue"
REGISTRATION = "tessera-e2e-kueue"  # the Mutating- and ValidatingWebhookConfiguration's name
COMPONENT = "kueue"
GARBAGE_COLLECTOR = "garbage-collector"
GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
# Its visibility API server (on by default since Kueue 0.9) would listen on 0.0.0.0:8082 and
# wants an APIService; nothing here asks it anything.
FEATURE_GATES = "VisibilityOnDemand=false"


def binaries() -> dict[str, Path]:
    """The pinned kueue and kube-controller-manager, built by e2e/build.sh on first use
    (minutes cold; see docs/e2e.md)."""
    return build_binaries((COMPONENT, "kube-controller-manager"))


class Kueue:
    """One Kueue on one harness cluster: `start()`, then `stop()` whatever happened."""

    def __init__(self, cluster: Cluster, binaries: dict[str, Path]) -> None:
        self.cluster = cluster
        self.binary = binaries[COMPONENT]
        self.controller_manager = binaries["kube-controller-manager"]
        self.manifests = self.binary.parent  # crd/ and webhook/, put there by e2e/build.sh
        self.home = cluster.run_dir / "kueue"
        taken = set(cluster.ports.values())
        names = ("webhook", "metrics", "health", GARBAGE_COLLECTOR)
        self.ports = {name: free_port(taken) for name in names}

    @property
    def webhook_url(self) -> str:
        return f"https://127.0.0.1:{self.ports['webhook']}"

    def start(self) -> None:
        """CRDs, configuration, the process (until its /readyz answers), the garbage collector,
        the webhooks."""
        try:
            self._apply_crds()
            config = self._write_files()
            self._start_process(config)
            self._start_garbage_collector()
            self._register_webhooks()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Webhook registrations first (so no pod create waits on a Kueue that is going), then
        the processes: SIGTERM, up to 10 s, SIGKILL."""
        from kubernetes import client

        try:
            with contextlib.closing(self.cluster.api_client()) as api:
                admission = client.AdmissionregistrationV1Api(api)
                for delete in (
                    admission.delete_mutating_webhook_configuration,
                    admission.delete_validating_webhook_configuration,
                ):
                    try:
                        delete(REGISTRATION)
                    except client.ApiException as exc:
                        if exc.status != 404:  # never registered: a start that failed early
                            raise
        finally:
            self.cluster.stop_component(COMPONENT)
            self.cluster.stop_component(GARBAGE_COLLECTOR)

    # -- start's steps ---------------------------------------------------------------------------
    def _apply_crds(self) -> None:
        from kubernetes import client

        paths = sorted((self.manifests / "crd").glob("*.yaml"))
        if not paths:
            raise HarnessError(
                f"kueue: no CRDs in {self.manifests / 'crd'} (e2e/build.sh copies them beside the "
                "binary; rebuild with e2e/build.sh --force kueue)"
            )
        names = []
        with contextlib.closing(self.cluster.api_client()) as api:
            crds = client.ApiextensionsV1Api(api)
            for path in paths:
                body = yaml.safe_load(path.read_text())
                names.append(body["metadata"]["name"])
                try:
                    crds.create_custom_resource_definition(body)
                except client.ApiException as exc:
                    if exc.status != 409:  # an earlier start's: the same pinned CRD
                        raise

            def established() -> bool:
                for name in names:
                    conditions = crds.read_custom_resource_definition(name).status.conditions
                    if not any(
                        c.type == "Established" and c.status == "True" for c in conditions or []
                    ):
                        return False
                return True

            deadline = time.monotonic() + 30
            while not established():
                if time.monotonic() > deadline:
                    raise HarnessError("kueue: its CRDs were not Established within 30 s")
                time.sleep(0.2)

    def _write_files(self) -> Path:
        """The serving certificate (webhook and metrics), the /etc overlay, the Configuration."""
        pki = self.cluster.pki
        certs = self.home / "certs"
        metrics = self.home / "etc" / "kueue" / "metrics" / "certs"
        for folder in (certs, metrics):
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(pki / "webhook.crt", folder / "tls.crt")
            shutil.copyfile(pki / "webhook.key", folder / "tls.key")
            (folder / "tls.key").chmod(0o600)
        config = {
            "apiVersion": "config.kueue.x-k8s.io/v1beta2",
            "kind": "Configuration",
            "manageJobsWithoutQueueName": False,
            "leaderElection": {"leaderElect": False},
            "internalCertManagement": {"enable": False},
            "webhook": {"host": "127.0.0.1", "port": self.ports["webhook"], "certDir": str(certs)},
            "metrics": {"bindAddress": f"127.0.0.1:{self.ports['metrics']}"},
            "health": {"healthProbeBindAddress": f"127.0.0.1:{self.ports['health']}"},
            "clientConnection": {"qps": 50, "burst": 100},
            "integrations": {"frameworks": ["pod"]},
        }
        path = self.home / "config.yaml"
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        return path

    def _start_process(self, config: Path) -> None:
        unshare = shutil.which("unshare")
        if unshare is None:
            raise HarnessError(
                "kueue: unshare not found (util-linux; Debian: apt-get install mount)"
            )
        # A read-only overlay of the run's etc/ on the real /etc, in this process's own mount
        # namespace (see the module docstring); then kueue in the same process.
        overlay = 'mount -t overlay overlay -o "lowerdir=$1:/etc" /etc && shift && exec "$@"'
        argv = [
            unshare, "--user", "--map-root-user", "--mount", "--", "sh", "-c", overlay, "sh",
            str(self.home / "etc"), str(self.binary), f"--config={config}",
            f"--feature-gates={FEATURE_GATES}", "--zap-log-level=2",
        ]  # fmt: skip
        url = f"http://127.0.0.1:{self.ports['health']}/readyz"
        self.cluster.start_component(
            COMPONENT,
            argv,
            probe=lambda: get_ok(url),
            what=f"GET {url}",
            env={"KUBECONFIG": str(self.cluster.kubeconfig)},
        )

    def _start_garbage_collector(self) -> None:
        kubeconfig = self.cluster.kubeconfig
        port = self.ports[GARBAGE_COLLECTOR]
        url = f"https://127.0.0.1:{port}/healthz"
        self.cluster.start_component(
            GARBAGE_COLLECTOR,
            [
                str(self.controller_manager),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--controllers=garbagecollector",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--v=1",
            ],
            probe=lambda: get_ok(url, insecure=True),
            what=f"GET {url}",
        )

    def webhooks(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """Kueue's mutating and validating webhooks for pods and its own kinds, as its manifests
        write them (rules, failure policy), served at `webhook_url` and trusted through the
        harness CA, limited to the namespaces labelled NAMESPACE_LABEL=true."""
        path = self.manifests / "webhook" / "manifests.yaml"
        ca_bundle = base64.b64encode((self.cluster.pki / "ca.crt").read_bytes()).decode()
        found: dict[str, list[dict[str, Any]]] = {}
        for doc in yaml.safe_load_all(path.read_text()):
            if not isinstance(doc, dict):
                continue
            hooks = found.setdefault(doc["kind"], [])
            for hook in doc.get("webhooks") or []:
                groups = {g for rule in hook.get("rules") or [] for g in rule.get("apiGroups", [])}
                resources = {r for rule in hook.get("rules") or [] for r in rule["resources"]}
                if not (groups == {GROUP} or (groups == {""} and resources == {"pods"})):
                    continue  # another integration's kind (Job, JobSet, ...): not enabled here
                hook = dict(hook)
                path_ = hook["clientConfig"]["service"]["path"]
                hook["clientConfig"] = {"url": self.webhook_url + path_, "caBundle": ca_bundle}
                hook["namespaceSelector"] = {
                    "matchExpressions": [
                        {"key": NAMESPACE_LABEL, "operator": "In", "values": ["true"]}
                    ]
                }
                hooks.append(hook)
        mutating = found.get("MutatingWebhookConfiguration", [])
        validating = found.get("ValidatingWebhookConfiguration", [])
        if not any(h["name"] == "mpod.kb.io" for h in mutating):
            raise HarnessError(f"kueue: {path} has no mpod.kb.io, the pod webhook that gates pods")
        return mutating, validating

    def _register_webhooks(self) -> None:
        from kubernetes import client

        mutating, validating = self.webhooks()
        meta = {"name": REGISTRATION}
        api_version = "admissionregistration.k8s.io/v1"
        with contextlib.closing(self.cluster.api_client()) as api:
            admission = client.AdmissionregistrationV1Api(api)
            admission.create_mutating_webhook_configuration(
                {"apiVersion": api_version, "kind": "MutatingWebhookConfiguration",
                 "metadata": meta, "webhooks": mutating}
            )  # fmt: skip
            admission.create_validating_webhook_configuration(
                {"apiVersion": api_version, "kind": "ValidatingWebhookConfiguration",
                 "metadata": meta, "webhooks": validating}
            )  # fmt: skip


def resource_flavor(name: str) -> dict[str, Any]:
    """A ResourceFlavor with no node labels: Tessera, not the flavor, picks the node."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ResourceFlavor",
        "metadata": {"name": name},
    }


def cluster_queue(name: str, flavor: str, quota: dict[str, str]) -> dict[str, Any]:
    """A ClusterQueue with one resource group: `quota` (resource -> nominal quota) of `flavor`,
    for the namespaces labelled NAMESPACE_LABEL=true."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "ClusterQueue",
        "metadata": {"name": name},
        "spec": {
            "namespaceSelector": {"matchLabels": {NAMESPACE_LABEL: "true"}},
            "resourceGroups": [
                {
                    "coveredResources": list(quota),
                    "flavors": [
                        {
                            "name": flavor,
                            "resources": [
                                {"name": resource, "nominalQuota": value}
                                for resource, value in quota.items()
                            ],
                        }
                    ],
                }
            ],
        },
    }


def local_queue(name: str, cluster_queue_name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "LocalQueue",
        "metadata": {"name": name},
        "spec": {"clusterQueue": cluster_queue_name},
    }
