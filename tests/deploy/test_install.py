"""The chart against a real kube-apiserver (the e2e harness's, on loopback): server-side dry-run
of every values set, `helm install` and `helm upgrade` keeping the generated secrets, and the
documented permission matrix checked with SubjectAccessReviews.

No controllers or kubelets run here: objects are stored and validated, pods never start.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.chart import CHART, HERE, VALUES_FILES, run_helm

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("helm")]

NAMESPACE = "tessera-system"
RELEASE = "tessera"
# Kinds whose CRDs (cert-manager, Prometheus Operator) this bare API server does not have.
CRD_KINDS = {"Certificate", "Issuer", "ServiceMonitor"}


@pytest.fixture(scope="module")
def kube(apiserver: Any) -> Iterator[Any]:
    with contextlib.closing(apiserver.api_client()) as api:
        yield api


@pytest.fixture(scope="module")
def installed(apiserver: Any, kube: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`helm install` with the default values into tessera-system (the API server's version)."""
    from kubernetes import client

    client.CoreV1Api(kube).create_namespace({"metadata": {"name": NAMESPACE}})
    home = tmp_path_factory.mktemp("helm")
    run_helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE,
             "--kubeconfig", str(apiserver.kubeconfig), home=home)  # fmt: skip
    return home


def secrets_of(kube: Any) -> dict[str, dict[str, str]]:
    from kubernetes import client

    core = client.CoreV1Api(kube)
    return {
        name: core.read_namespaced_secret(f"{RELEASE}-{name}", NAMESPACE).data
        for name in ("secrets", "allocation-key", "webhook-tls")
    }


def ca_bundle(kube: Any) -> str:
    from kubernetes import client

    mwc = client.AdmissionregistrationV1Api(kube).read_mutating_webhook_configuration(RELEASE)
    return str(mwc.webhooks[0].client_config.ca_bundle)


def can(kube: Any, sa: str, verb: str, resource: str, *, namespace: str = "team-a",
        group: str = "", subresource: str = "", name: str = "") -> bool:  # fmt: skip
    from kubernetes import client

    user = f"system:serviceaccount:{NAMESPACE}:{RELEASE}-{sa}"
    attributes = {"namespace": namespace, "verb": verb, "group": group, "resource": resource}
    if subresource:
        attributes["subresource"] = subresource
    if name:
        attributes["name"] = name
    review = client.AuthorizationV1Api(kube).create_subject_access_review(
        {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": user,
                "groups": [
                    "system:serviceaccounts",
                    f"system:serviceaccounts:{NAMESPACE}",
                    "system:authenticated",
                ],
                "resourceAttributes": attributes,
            },
        }
    )
    return bool(review.status.allowed)


# --- server-side validation ------------------------------------------------------------------


@pytest.mark.parametrize("values", [None, *VALUES_FILES])
def test_rendered_manifests_pass_server_side_dry_run(
    apiserver: Any, kube: Any, values: str | None, tmp_path: Path
) -> None:
    from kubernetes import client, dynamic

    namespace = "tessera-dry"
    with contextlib.suppress(client.ApiException):
        client.CoreV1Api(kube).create_namespace({"metadata": {"name": namespace}})
    version = apiserver.state["versions"]["KUBERNETES_VERSION"]
    args = ["template", "dry", str(CHART), "--namespace", namespace, "--kube-version", version]
    if values:
        args += ["--values", str(HERE / values)]
    docs = [d for d in yaml.safe_load_all(run_helm(*args, home=tmp_path).stdout) if d]
    api = dynamic.DynamicClient(kube)
    skipped, checked = set(), 0
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            skipped.add(doc["kind"])
            continue
        resource = api.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
        ns = doc["metadata"].get("namespace") if resource.namespaced else None
        try:
            resource.create(body=doc, namespace=ns, dry_run="All")
        except client.ApiException as exc:
            pytest.fail(f"{doc['kind']} {doc['metadata']['name']} refused: {exc.body}")
        checked += 1
    assert checked > 20
    expected_skips = {
        "values-certmanager.yaml": {"Certificate", "Issuer"},
        "values-servicemonitor.yaml": {"ServiceMonitor"},
    }.get(values or "", set())
    assert skipped == expected_skips


# --- install, upgrade, secrets ---------------------------------------------------------------


def test_install_uses_the_clusters_scheduler_version(
    apiserver: Any, kube: Any, installed: Path
) -> None:
    from kubernetes import client

    version = apiserver.state["versions"]["KUBERNETES_VERSION"]
    deploy = client.AppsV1Api(kube).read_namespaced_deployment(f"{RELEASE}-scheduler", NAMESPACE)
    images = {c.name: c.image for c in deploy.spec.template.spec.containers}
    assert images["kube-scheduler"] == f"registry.k8s.io/kube-scheduler:{version}"


def test_upgrade_keeps_the_generated_secrets_and_the_webhook_ca(
    apiserver: Any, kube: Any, installed: Path
) -> None:
    from kubernetes import client

    before, bundle = secrets_of(kube), ca_bundle(kube)
    assert set(before["secrets"]) == {"secret-key", "postgresql-password", "redis-password"}
    run_helm("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE,
             "--kubeconfig", str(apiserver.kubeconfig), "--set", "controlplane.replicas=3",
             home=installed)  # fmt: skip
    assert secrets_of(kube) == before
    assert ca_bundle(kube) == bundle
    apps = client.AppsV1Api(kube)
    assert apps.read_namespaced_deployment(f"{RELEASE}-controlplane", NAMESPACE).spec.replicas == 3
    jobs = {j.metadata.name for j in client.BatchV1Api(kube).list_namespaced_job(NAMESPACE).items}
    assert f"{RELEASE}-migrate-2" in jobs


# --- permissions -----------------------------------------------------------------------------

LEASE = {"group": "coordination.k8s.io", "namespace": NAMESPACE, "name": f"{RELEASE}-scheduler"}
TOKENREVIEW = {"group": "authentication.k8s.io", "namespace": ""}
AUTH_CONFIGMAP = {"namespace": "kube-system", "name": "extension-apiserver-authentication"}
CLUSTER = {"namespace": ""}

# (ServiceAccount, verb, resource, keyword arguments of `can`, allowed?) — docs/operator-guide.md
DEFAULT_MATRIX = [
    ("scheduler", "create", "pods", {"subresource": "binding"}, True),
    ("scheduler", "get", "pods", {}, True),
    ("scheduler", "create", "events", {}, True),  # the pod's Allocated/AllocationFailed
    ("scheduler", "list", "nodes", CLUSTER, True),
    ("scheduler", "get", "configmaps", AUTH_CONFIGMAP, True),
    ("scheduler", "create", "pods", {}, False),
    ("scheduler", "list", "secrets", {}, False),
    ("scheduler", "update", "leases", LEASE, False),
    ("worker", "list", "pods", CLUSTER, True),
    ("worker", "watch", "pods", CLUSTER, True),
    ("worker", "get", "pods", {}, True),
    ("worker", "list", "nodes", CLUSTER, True),
    ("worker", "create", "pods", {"subresource": "binding"}, False),
    ("worker", "delete", "pods", {}, False),
    ("worker", "update", "nodes", CLUSTER, False),
    ("worker", "list", "secrets", {}, False),
    ("worker", "get", "namespaces", {"namespace": "", "name": "kube-system"}, True),
    ("worker", "get", "namespaces", {"namespace": "", "name": "default"}, False),
    ("worker", "list", "namespaces", CLUSTER, False),
    ("controlplane", "list", "pods", {}, False),
    ("controlplane", "create", "pods", {"subresource": "binding"}, False),
    ("controlplane", "create", "tokenreviews", TOKENREVIEW, False),
    ("controlplane", "get", "secrets", {"namespace": NAMESPACE}, False),
    ("nodeplugin", "list", "secrets", {"namespace": NAMESPACE}, False),
    ("nodeplugin", "get", "pods", {}, True),  # signed annotations while the control plane is away
    ("nodeplugin", "list", "pods", {}, False),
    ("nodeplugin", "get", "nodes", CLUSTER, False),
    ("nodeplugin", "create", "pods", {"subresource": "binding"}, False),
]  # fmt: skip

# After `helm upgrade -f values-replicas.yaml` (3 schedulers, SA-token auth, annotation mode).
REPLICAS_MATRIX = [
    ("scheduler", "update", "leases", LEASE, True),
    ("controlplane", "create", "tokenreviews", TOKENREVIEW, True),
    ("controlplane", "list", "pods", {}, False),
    ("nodeplugin", "get", "pods", {}, True),
    ("nodeplugin", "list", "pods", {}, False),
    ("nodeplugin", "list", "secrets", {"namespace": NAMESPACE}, False),
]  # fmt: skip


def check_matrix(kube: Any, matrix: list[tuple[str, str, str, dict[str, str], bool]]) -> None:
    wrong = []
    for sa, verb, resource, extra, allowed in matrix:
        if can(kube, sa, verb, resource, **extra) != allowed:
            wrong.append(f"{sa} {verb} {resource} {extra}: expected {'yes' if allowed else 'no'}")
    assert not wrong, "\n".join(wrong)


def test_service_accounts_get_exactly_the_documented_permissions(
    apiserver: Any, kube: Any, installed: Path
) -> None:
    check_matrix(kube, DEFAULT_MATRIX)
    run_helm("upgrade", RELEASE, str(CHART), "--namespace", NAMESPACE,
             "--kubeconfig", str(apiserver.kubeconfig),
             "--values", str(HERE / "values-replicas.yaml"), home=installed)  # fmt: skip
    check_matrix(kube, REPLICAS_MATRIX)
