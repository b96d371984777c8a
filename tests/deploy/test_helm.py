"""The Helm chart (deploy/helm/tessera) rendered by the real, pinned helm binary.

`helm lint` and `helm template` for the default values and each tests/deploy/values-*.yaml,
then assertions on the rendered objects: the scheduler's extender stanza, probes, secrets kept
across upgrades, RBAC per ServiceAccount (docs/operator-guide.md, "Permissions"), network
policies, the node plugin's placement, monitoring.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.cluster import Options
from tests.deploy.chart import (
    CHART,
    KUBE_VERSION,
    NAMESPACE,
    RELEASE,
    ROOT,
    VALUES_FILES,
    render,
    run_helm,
)
from tests.deploy.chart import container as chart_container

DEFAULT_RESOURCES = {
    "gpu": "nvidia.com/gpu",
    "gpumem": "nvidia.com/gpumem",
    "gpumemPercentage": "nvidia.com/gpumem-percentage",
    "gpucores": "nvidia.com/gpucores",
    "priority": "nvidia.com/priority",
}
OTHER_RESOURCES = {
    "gpu": "tessera.io/gpu",
    "gpumem": "tessera.io/gpumem",
    "gpumemPercentage": "tessera.io/gpumem-percentage",
    "gpucores": "tessera.io/gpucores",
    "priority": "tessera.io/priority",
}
ENV_OF = {
    "gpu": "TESSERA_RESOURCE_GPU",
    "gpumem": "TESSERA_RESOURCE_GPUMEM",
    "gpumemPercentage": "TESSERA_RESOURCE_GPUMEM_PERCENTAGE",
    "gpucores": "TESSERA_RESOURCE_GPUCORES",
    "priority": "TESSERA_RESOURCE_PRIORITY",
}
ALL_SETS = [(), *[(name,) for name in VALUES_FILES]]
# The pinned helm first: a clear failure when it cannot be built.
pytestmark = pytest.mark.usefixtures("helm")


def ids(values: tuple[str, ...]) -> str:
    return values[0] if values else "defaults"


# --- helpers ---------------------------------------------------------------------------------


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [
        d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)
    ]


def one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def workloads(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}]


def containers(obj: dict[str, Any], init: bool = False) -> list[dict[str, Any]]:
    spec = obj["spec"]["template"]["spec"]
    return list(spec.get("containers", [])) + (list(spec.get("initContainers", [])) if init else [])


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def scheduler_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = one(docs, "ConfigMap", f"{RELEASE}-scheduler-config")
    return yaml.safe_load(cm["data"]["scheduler-config.yaml"])


def tessera_containers(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """Every container that runs Tessera's Django code (it gets TESSERA_SECRET_KEY)."""
    return [
        (f"{w['metadata']['name']}/{c['name']}", c)
        for w in workloads(docs)
        for c in containers(w, init=True)
        if "TESSERA_SECRET_KEY" in env_of(c)
    ]


# --- lint and render -------------------------------------------------------------------------


@pytest.mark.parametrize("values", ALL_SETS, ids=ids)
def test_helm_lint_passes(values: tuple[str, ...], tmp_path: Path) -> None:
    args = ["lint", str(CHART), "--strict", "--namespace", NAMESPACE, "--kube-version",
            KUBE_VERSION]  # fmt: skip
    for name in values:
        args += ["--values", str(Path(__file__).parent / name)]
    proc = run_helm(*args, home=tmp_path, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", ALL_SETS, ids=ids)
def test_template_renders_named_namespaced_objects(values: tuple[str, ...]) -> None:
    docs = render(*values)
    assert len(docs) > 20
    cluster_scoped = {
        "ClusterRole",
        "ClusterRoleBinding",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
        "DeviceClass",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
    }
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"].get("name"), doc
        if doc["kind"] not in cluster_scoped:
            # Only the scheduler's authentication-reader binding lives outside the release.
            expected = {NAMESPACE, "kube-system"}
            assert doc["metadata"].get("namespace") in expected, doc["metadata"]


def test_values_schema_refuses_bad_types_and_names(tmp_path: Path) -> None:
    for bad, field in [
        ("resources.gpu=not a resource", "/resources/gpu"),
        ("scheduler.replicas=zero", "/scheduler/replicas"),
        ("nodeplugin.deviceMode=magic", "/nodeplugin/deviceMode"),
        ("postgresql.enabled=maybe", "/postgresql/enabled"),
    ]:
        proc = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION,
                        "--set", bad, home=tmp_path, check=False)  # fmt: skip
        assert proc.returncode != 0, bad
        assert field in proc.stderr, proc.stderr


def test_external_datastores_need_a_url(tmp_path: Path) -> None:
    for sets, message in [
        (["postgresql.enabled=false"], "externalDatabase.url"),
        (["redis.enabled=false"], "externalRedis.url"),
    ]:
        args = ["template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION]
        for s in sets:
            args += ["--set", s]
        proc = run_helm(*args, home=tmp_path, check=False)
        assert proc.returncode != 0
        assert message in proc.stderr


def test_chart_needs_kubernetes_1_30_for_match_conditions(tmp_path: Path) -> None:
    proc = run_helm("template", RELEASE, str(CHART), "--kube-version", "v1.29.9",
                    home=tmp_path, check=False)  # fmt: skip
    assert proc.returncode != 0
    assert ">=1.30" in proc.stderr


# --- the scheduler ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "names", "profile"),
    [((), DEFAULT_RESOURCES, "tessera-scheduler"),
     (("values-resources.yaml",), OTHER_RESOURCES, "tessera-slices")],
    ids=["defaults", "other-names"],
)  # fmt: skip
def test_scheduler_extender_stanza_matches_the_resource_names(
    values: tuple[str, ...], names: dict[str, str], profile: str
) -> None:
    docs = render(*values)
    config = scheduler_config(docs)
    assert config["kind"] == "KubeSchedulerConfiguration"
    assert [p["schedulerName"] for p in config["profiles"]] == [profile]
    (extender,) = config["extenders"]
    assert extender["urlPrefix"] == "http://127.0.0.1:8001/scheduler"
    assert extender["filterVerb"] == "filter"
    assert extender["prioritizeVerb"] == "prioritize"
    assert extender["preemptVerb"] == "preempt"
    assert extender["bindVerb"] == "bind"
    assert extender["nodeCacheCapable"] is True
    assert extender["ignorable"] is False
    assert extender["managedResources"] == [
        {"name": names[k], "ignoredByScheduler": True}
        for k in ("gpu", "gpumem", "gpumemPercentage", "gpucores", "priority")
    ]
    # The same names reach every Tessera process, the node plugin and the webhook.
    for where, container in tessera_containers(docs):
        env = env_of(container)
        for key, var in ENV_OF.items():
            assert env[var] == names[key], where
        assert env["TESSERA_SCHEDULER_NAME"] == profile, where
    plugin = containers(one(docs, "DaemonSet", f"{RELEASE}-nodeplugin"))[0]
    assert env_of(plugin)["TESSERA_RESOURCE_GPU"] == names["gpu"]
    webhook = one(docs, "MutatingWebhookConfiguration", RELEASE)["webhooks"][0]
    expression = webhook["matchConditions"][0]["expression"]
    for name in names.values():
        assert f'"{name}"' in expression
    others = set(DEFAULT_RESOURCES.values()) ^ set(OTHER_RESOURCES.values())
    for name in others - set(names.values()):
        assert name not in expression


def test_the_schedulers_tessera_adopts_reach_the_webhook() -> None:
    def adopted(docs: list[dict[str, Any]]) -> set[str]:
        return {env_of(c)["TESSERA_ADOPTED_SCHEDULERS"] for _, c in tessera_containers(docs)}

    assert adopted(render()) == {"default-scheduler"}
    assert adopted(render(sets=("scheduler.adopt={default-scheduler,volcano}",))) == {
        "default-scheduler,volcano"
    }


def test_scheduler_profile_is_the_reviewed_one_in_deploy_scheduler() -> None:
    """The chart's extender stanza and profile are deploy/scheduler/scheduler-config.yaml's,
    field for field."""
    reviewed = yaml.safe_load((ROOT / "deploy/scheduler/scheduler-config.yaml").read_text())
    rendered = scheduler_config(render())
    assert rendered["extenders"] == reviewed["extenders"]
    assert rendered["profiles"] == reviewed["profiles"]


def test_the_extender_sees_every_feasible_node_unless_the_operator_says_otherwise() -> None:
    """kube-scheduler hands an extender only the feasible nodes it found before it stopped
    searching; GPU room is invisible to its own filters, so the profile must not stop early."""
    [profile] = scheduler_config(render())["profiles"]
    assert profile["percentageOfNodesToScore"] == 100
    [profile] = scheduler_config(render(sets=("scheduler.percentageOfNodesToScore=30",)))[
        "profiles"
    ]
    assert profile["percentageOfNodesToScore"] == 30


def test_scheduler_image_follows_the_cluster_version_and_leader_election_the_replicas() -> None:
    single = render()
    deploy = one(single, "Deployment", f"{RELEASE}-scheduler")
    images = {c["name"]: c["image"] for c in containers(deploy)}
    assert images["kube-scheduler"] == f"registry.k8s.io/kube-scheduler:{KUBE_VERSION}"
    assert images["extender"] == "localhost:5000/tessera/controlplane:0.1.0"
    assert scheduler_config(single)["leaderElection"] == {"leaderElect": False}
    assert not find(single, "Role", f"{RELEASE}-scheduler-leader-election")

    three = render("values-replicas.yaml")
    assert one(three, "Deployment", f"{RELEASE}-scheduler")["spec"]["replicas"] == 3
    assert scheduler_config(three)["leaderElection"] == {
        "leaderElect": True,
        "resourceNamespace": NAMESPACE,
        "resourceName": f"{RELEASE}-scheduler",
    }
    pinned = render(sets=("scheduler.image.tag=v1.31.4",))
    deploy = one(pinned, "Deployment", f"{RELEASE}-scheduler")
    assert containers(deploy)[0]["image"] == "registry.k8s.io/kube-scheduler:v1.31.4"


def test_extender_sidecar_listens_on_loopback_only_and_signs_with_the_shared_key() -> None:
    docs = render()
    deploy = one(docs, "Deployment", f"{RELEASE}-scheduler")
    sidecar = next(c for c in containers(deploy) if c["name"] == "extender")
    command = sidecar["command"]
    assert command[:3] == ["python", "-m", "controlplane.sidecar"]  # granian
    assert command[-1] == "controlplane.wsgi:application"
    assert {"--host=127.0.0.1", "--port=8001", "--workers=1", "--interface=wsgi"} <= set(command)
    assert "--blocking-threads=16" in command  # scheduler.extender.threads
    assert not sidecar.get("ports")
    env = env_of(sidecar)
    assert env["TESSERA_SERVE_EXTENDER"] == "1"
    assert env["TESSERA_ALLOCATION_KEY_FILE"] == "/etc/tessera/allocation/key"
    volumes = {v["name"]: v for v in deploy["spec"]["template"]["spec"]["volumes"]}
    assert volumes["allocation-key"]["secret"]["secretName"] == f"{RELEASE}-allocation-key"
    # Nobody else serves the extender.
    for where, container in tessera_containers(docs):
        if where != f"{RELEASE}-scheduler/extender":
            assert "TESSERA_SERVE_EXTENDER" not in env_of(container), where


# --- probes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("values", ALL_SETS, ids=ids)
def test_every_long_running_container_has_probes(values: tuple[str, ...]) -> None:
    docs = render(*values)
    for workload in workloads(docs):
        if workload["kind"] == "Job":
            continue
        for c in containers(workload):
            where = f"{workload['kind']} {workload['metadata']['name']}/{c['name']}"
            assert "livenessProbe" in c, where
            for probe in (c.get("livenessProbe"), c.get("readinessProbe")):
                # The kubelet probes from the node: a loopback host would probe the node itself.
                if probe and "httpGet" in probe:
                    assert probe["httpGet"].get("host") in (None, ""), where
            if workload["kind"] != "DaemonSet" and c["name"] not in {"worker", "beat"}:
                assert "readinessProbe" in c, where


def test_app_server_probes_healthz_and_readyz() -> None:
    docs = render()
    deploy = one(docs, "Deployment", f"{RELEASE}-controlplane")
    by_name = {c["name"]: c for c in containers(deploy)}
    for name, port in (("app", "http"), ("webhook", "https")):
        c = by_name[name]
        assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
        assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
        assert c["livenessProbe"]["httpGet"]["port"] == port
    sidecar = next(
        c for c in containers(one(docs, "Deployment", f"{RELEASE}-scheduler"))
        if c["name"] == "extender"
    )  # fmt: skip
    assert "http://127.0.0.1:8001/healthz" in " ".join(sidecar["livenessProbe"]["exec"]["command"])
    assert "http://127.0.0.1:8001/readyz" in " ".join(sidecar["readinessProbe"]["exec"]["command"])
    # The pod's IP is an allowed host (the kubelet's probes and Prometheus address it by IP).
    allowed = env_of(by_name["app"])["TESSERA_ALLOWED_HOSTS"].split(",")
    assert "$(POD_IP)" in allowed
    assert f"{RELEASE}-webhook.{NAMESPACE}.svc" in allowed


# The API server's webhook client drops idle connections after 90 s (http.Transport defaults
# that k8s.io/apimachinery/pkg/util/net applies); a server that closes them sooner races reuse.
API_SERVER_IDLE_CONN_S = 90


# kube-apiserver's default --max-mutating-requests-inflight: the most pod creates, and so
# admission calls, it has in flight at once.
API_SERVER_MUTATING_INFLIGHT = 200


def _flag(command: list[str], name: str) -> int:
    values = [int(a.split("=", 1)[1]) for a in command if a.startswith(f"--{name}=")]
    assert len(values) == 1, command
    return values[0]


def test_webhook_threads_cover_the_api_servers_bursts() -> None:
    """Each connection the API server opens holds a gunicorn thread until its first request: the
    listeners' threads over all replicas must cover every admission call the API server can have
    in flight, and the e2e harness runs a replica's threads as the chart does."""
    deploy = one(render(), "Deployment", f"{RELEASE}-controlplane")
    webhook = next(c for c in containers(deploy) if c["name"] == "webhook")
    threads = _flag(webhook["command"], "threads")
    workers = _flag(webhook["command"], "workers")
    assert deploy["spec"]["replicas"] * workers * threads >= API_SERVER_MUTATING_INFLIGHT
    assert Options().webhook_threads == threads
    fragment = yaml.safe_load(
        (Path(__file__).parents[2] / "deploy/webhook/controlplane-tls-args.yaml").read_text()
    )
    assert _flag(fragment["containers"][0]["command"], "threads") == threads
    few = one(
        render(sets=("controlplane.webhookThreads=3",)), "Deployment", deploy["metadata"]["name"]
    )
    hook = next(c for c in containers(few) if c["name"] == "webhook")
    assert _flag(hook["command"], "threads") == 3


def test_webhook_keeps_idle_connections_longer_than_the_api_server() -> None:
    deploy = one(render(), "Deployment", f"{RELEASE}-controlplane")
    webhook = next(c for c in containers(deploy) if c["name"] == "webhook")
    assert webhook["command"][0] == "gunicorn"
    assert _flag(webhook["command"], "keep-alive") > API_SERVER_IDLE_CONN_S
    fragment = yaml.safe_load(
        (Path(__file__).parents[2] / "deploy/webhook/controlplane-tls-args.yaml").read_text()
    )
    assert _flag(fragment["containers"][0]["command"], "keep-alive") > API_SERVER_IDLE_CONN_S


# kube-scheduler's extender client keeps idle connections for 90 s too (the same defaults).
SCHEDULER_IDLE_CONN_S = 90


def test_extender_sidecar_keeps_idle_connections_longer_than_the_scheduler() -> None:
    deploy = one(render(), "Deployment", f"{RELEASE}-scheduler")
    sidecar = next(c for c in containers(deploy) if c["name"] == "extender")
    timeouts = [
        int(a.split("=", 1)[1])
        for a in sidecar["command"]
        if a.startswith("--http1-header-read-timeout=")
    ]
    assert len(timeouts) == 1 and timeouts[0] > SCHEDULER_IDLE_CONN_S * 1000, sidecar["command"]


def test_beat_is_a_single_replica_that_never_overlaps() -> None:
    for values in ALL_SETS:
        beat = one(render(*values), "Deployment", f"{RELEASE}-beat")
        assert beat["spec"]["replicas"] == 1
        assert beat["spec"]["strategy"] == {"type": "Recreate"}


def test_migrations_run_once_per_revision_and_pods_wait_for_them() -> None:
    docs = render()
    (job,) = find(docs, "Job")
    assert job["metadata"]["name"] == f"{RELEASE}-migrate-1"
    assert "helm.sh/hook" not in job["metadata"].get("annotations", {})
    assert containers(job)[0]["command"] == ["python", "manage.py", "migrate", "--noinput"]
    for name in ("controlplane", "scheduler", "worker", "beat"):
        deploy = one(docs, "Deployment", f"{RELEASE}-{name}")
        init = deploy["spec"]["template"]["spec"]["initContainers"]
        assert init[0]["name"] == "wait-for-migrations", name
        assert "migrate --check" in init[0]["command"][-1]


# --- secrets ---------------------------------------------------------------------------------


def test_generated_secrets_are_looked_up_before_being_made() -> None:
    """`helm template` cannot reach a cluster, so check the templates themselves: every
    generated value is read back from the live Secret first (the e2e test upgrades for real)."""
    secrets_tpl = (CHART / "templates" / "secrets.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in secrets_tpl
    assert 'lookup "v1" "Secret" .Release.Namespace $keyName' in secrets_tpl
    generated = re.findall(r"^\s*([a-z-]+): \{\{ (.*?) \}\}$", secrets_tpl, re.M)
    randoms = {key: expr for key, expr in generated if "rand" in expr}
    assert set(randoms) == {"secret-key", "postgresql-password", "redis-password", "key"}
    for key, expr in randoms.items():
        assert re.match(rf'get \$(data|keyData) "{key}" \| default \(randAlphaNum \d+', expr), expr
    webhook_tpl = (CHART / "templates" / "webhook.yaml").read_text()
    assert 'lookup "v1" "Secret" $ns $secretName' in webhook_tpl
    assert webhook_tpl.index("lookup") < webhook_tpl.index("genCA")


def test_secrets_hold_what_the_pods_read_and_are_kept_on_uninstall() -> None:
    docs = render()
    secret = one(docs, "Secret", f"{RELEASE}-secrets")
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert set(secret["data"]) == {"secret-key", "postgresql-password", "redis-password"}
    key = one(docs, "Secret", f"{RELEASE}-allocation-key")
    assert len(key["data"]["key"]) >= 44  # base64 of >= 32 bytes (48 here)
    tls = one(docs, "Secret", f"{RELEASE}-webhook-tls")
    assert set(tls["data"]) == {"tls.crt", "tls.key", "ca.crt"}
    webhook = one(docs, "MutatingWebhookConfiguration", RELEASE)["webhooks"][0]
    assert webhook["clientConfig"]["caBundle"] == tls["data"]["ca.crt"]
    # The bundled database's URL is put together from the password Secret, never stored twice.
    app = containers(one(docs, "Deployment", f"{RELEASE}-controlplane"))[0]
    env = env_of(app)
    assert env["DATABASE_URL"] == (
        f"postgres://tessera:$(TESSERA_DB_PASSWORD)@{RELEASE}-postgresql:5432/tessera"
    )
    assert env["TESSERA_DB_PASSWORD"]["secretKeyRef"]["key"] == "postgresql-password"


def test_external_database_and_redis() -> None:
    docs = render("values-external.yaml")
    assert not find(docs, "StatefulSet")
    secret = one(docs, "Secret", f"{RELEASE}-secrets")
    assert set(secret["data"]) == {"secret-key", "database-url"}
    worker = containers(one(docs, "Deployment", f"{RELEASE}-worker"))[0]
    env = env_of(worker)
    assert env["DATABASE_URL"] == {
        "secretKeyRef": {"name": f"{RELEASE}-secrets", "key": "database-url"}
    }
    assert env["REDIS_URL"] == {"secretKeyRef": {"name": "tessera-redis-credentials", "key": "url"}}
    assert not [p for p in find(docs, "NetworkPolicy") if "postgresql" in p["metadata"]["name"]]


def test_webhook_certificate_from_cert_manager() -> None:
    docs = render("values-certmanager.yaml")
    assert not find(docs, "Secret", f"{RELEASE}-webhook-tls")
    cert = one(docs, "Certificate", f"{RELEASE}-webhook")
    assert cert["spec"]["secretName"] == f"{RELEASE}-webhook-tls"
    assert f"{RELEASE}-webhook.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    assert f"{RELEASE}.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]  # node plugins' URL
    assert cert["spec"]["issuerRef"] == {"name": f"{RELEASE}-ca", "kind": "Issuer"}
    assert one(docs, "Certificate", f"{RELEASE}-ca")["spec"]["isCA"] is True
    mwc = one(docs, "MutatingWebhookConfiguration", RELEASE)
    assert mwc["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        f"{NAMESPACE}/{RELEASE}-webhook"
    )
    assert "caBundle" not in mwc["webhooks"][0]["clientConfig"]


# --- RBAC ------------------------------------------------------------------------------------

# The documented matrix (docs/operator-guide.md, "Permissions"): what each ServiceAccount is
# bound to. Built-in roles by name; the chart's own roles by their rules.
KUBE_SCHEDULER = ("ClusterRole", "system:kube-scheduler")
VOLUME_SCHEDULER = ("ClusterRole", "system:volume-scheduler")
AUTH_READER = ("Role", "kube-system/extension-apiserver-authentication-reader")
# Tessera's own preemption: evictions, and marking the preemptor (docs/preemption.md)
PREEMPTION = {("", "pods/eviction", "create"), ("", "pods", "patch")}
WORKER_RULES = (
    ("", "pods", "get,list,watch"),
    ("", "nodes", "list"),
    ("", "namespaces", "get", "names=kube-system"),  # the cluster's identity (its UID)
)
EXPECTED_RBAC = {
    "defaults": {
        "controlplane": set(),
        "scheduler": {KUBE_SCHEDULER, VOLUME_SCHEDULER, AUTH_READER, *PREEMPTION},
        "worker": set(WORKER_RULES),
        "nodeplugin": {("", "pods", "get")},
    },
    "values-replicas.yaml": {
        "controlplane": {("authentication.k8s.io", "tokenreviews", "create")},
        "scheduler": {
            KUBE_SCHEDULER,
            VOLUME_SCHEDULER,
            AUTH_READER,
            *PREEMPTION,
            ("coordination.k8s.io", "leases", "create,get,list,update,watch", NAMESPACE),
        },
        "worker": set(WORKER_RULES),
        "nodeplugin": {("", "pods", "get")},
    },
}


def effective_grants(docs: list[dict[str, Any]]) -> dict[str, set[tuple[str, ...]]]:
    roles = {
        (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
        for d in docs
        if d["kind"] in {"Role", "ClusterRole"}
    }
    grants: dict[str, set[tuple[str, ...]]] = {}
    for sa in find(docs, "ServiceAccount"):
        grants[sa["metadata"]["name"].removeprefix(f"{RELEASE}-")] = set()
    for binding in docs:
        if binding["kind"] not in {"RoleBinding", "ClusterRoleBinding"}:
            continue
        ns = binding["metadata"].get("namespace")
        ref = binding["roleRef"]
        key = (ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE
            sa = subject["name"].removeprefix(f"{RELEASE}-")
            if key in roles:
                for rule in roles[key]["rules"]:
                    for group in rule["apiGroups"]:
                        for resource in rule["resources"]:
                            grant = (group, resource, ",".join(sorted(rule["verbs"])))
                            if ref["kind"] == "Role":
                                grant = (*grant, ns)
                            if "resourceNames" in rule:
                                grant = (*grant, "names=" + ",".join(sorted(rule["resourceNames"])))
                            grants[sa].add(grant)
            else:
                name = f"{ns}/{ref['name']}" if ref["kind"] == "Role" else ref["name"]
                grants[sa].add((ref["kind"], name))
    return grants


@pytest.mark.parametrize("values", ["defaults", "values-replicas.yaml"])
def test_rbac_per_service_account_is_exactly_the_documented_matrix(values: str) -> None:
    docs = render() if values == "defaults" else render(values)
    assert effective_grants(docs) == EXPECTED_RBAC[values]


def test_pods_use_their_own_service_accounts_and_tokens_only_where_needed() -> None:
    docs = render()

    def pod(kind: str, name: str) -> dict[str, Any]:
        return one(docs, kind, f"{RELEASE}-{name}")["spec"]["template"]["spec"]

    assert pod("Deployment", "controlplane")["serviceAccountName"] == f"{RELEASE}-controlplane"
    assert pod("Deployment", "controlplane")["automountServiceAccountToken"] is False
    assert pod("Deployment", "scheduler")["serviceAccountName"] == f"{RELEASE}-scheduler"
    assert pod("Deployment", "worker")["serviceAccountName"] == f"{RELEASE}-worker"
    assert pod("Deployment", "beat")["automountServiceAccountToken"] is False
    assert pod("DaemonSet", "nodeplugin")["serviceAccountName"] == f"{RELEASE}-nodeplugin"
    # to read pods' signed annotations while the control plane is away (allocationFallback)
    assert pod("DaemonSet", "nodeplugin")["automountServiceAccountToken"] is True
    for name in ("postgresql", "redis"):
        assert pod("StatefulSet", name)["automountServiceAccountToken"] is False


# --- network policies ------------------------------------------------------------------------


def test_network_policies_keep_the_extender_and_datastores_closed() -> None:
    docs = render()
    policies = {p["metadata"]["name"]: p["spec"] for p in find(docs, "NetworkPolicy")}
    assert set(policies) == {
        f"{RELEASE}-{n}"
        for n in ("controlplane", "scheduler", "nodeplugin", "reconciler", "postgresql", "redis")
    }
    for spec in policies.values():
        assert spec["policyTypes"] == ["Ingress"]
        for rule in spec["ingress"]:
            assert 8001 not in [p["port"] for p in rule["ports"]]  # the extender: never
    scheduler = policies[f"{RELEASE}-scheduler"]
    assert scheduler["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "scheduler"
    assert [p["port"] for r in scheduler["ingress"] for p in r["ports"]] == [10259]
    cp = policies[f"{RELEASE}-controlplane"]
    assert cp["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "controlplane"
    by_port = {r["ports"][0]["port"]: r for r in cp["ingress"]}
    assert set(by_port) == {8443, 8000}
    assert by_port[8000]["from"] == [{"podSelector": {}}]  # this namespace only by default
    assert policies[f"{RELEASE}-reconciler"]["ingress"] == []
    pg = policies[f"{RELEASE}-postgresql"]["ingress"][0]["from"][0]["podSelector"]
    components = pg["matchExpressions"][1]["values"]
    assert "nodeplugin" not in components and "controlplane" in components


def test_network_policy_webhook_and_http_sources_from_values() -> None:
    docs = render("values-servicemonitor.yaml")
    cp = one(docs, "NetworkPolicy", f"{RELEASE}-controlplane")["spec"]
    by_port = {r["ports"][0]["port"]: r for r in cp["ingress"]}
    webhook_from = by_port[8443]["from"]
    assert {"ipBlock": {"cidr": "10.0.0.0/24"}} in webhook_from
    assert webhook_from[0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == (
        "nodeplugin"
    )
    labels = {"kubernetes.io/metadata.name": "monitoring"}
    monitoring = {"namespaceSelector": {"matchLabels": labels}}
    assert monitoring in by_port[8000]["from"]


# --- node plugin -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "selector"),
    [((), {"tessera.io/gpu": "true"}),
     (("values-resources.yaml",), {"example.com/gpu-pool": "shared"})],
    ids=["defaults", "custom"],
)  # fmt: skip
def test_node_plugin_runs_on_labelled_gpu_nodes_with_the_shim_installed(
    values: tuple[str, ...], selector: dict[str, str]
) -> None:
    ds = one(render(*values), "DaemonSet", f"{RELEASE}-nodeplugin")
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == selector
    (init,) = spec["initContainers"]
    assert init["name"] == "install-shim"
    assert "/opt/tessera/lib/libtessera.so" in init["command"][-1]
    assert init["volumeMounts"] == [{"name": "shim", "mountPath": "/host-shim"}]
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["shim"]["hostPath"]["path"] == "/usr/local/tessera/lib"
    env = env_of(spec["containers"][0])
    assert env["TESSERA_SHIM_LIBRARY"] == "/usr/local/tessera/lib/libtessera.so"
    assert env["TESSERA_CONTROLPLANE_URL"] == f"https://{RELEASE}.{NAMESPACE}.svc:8443"
    assert env["TESSERA_TOKEN_FILE"] == "/var/run/tessera-node-tokens/$(TESSERA_NODE_NAME)"
    assert volumes["control-plane-ca"]["secret"]["items"] == [{"key": "ca.crt", "path": "ca.crt"}]


def test_node_plugin_service_account_token_and_annotation_modes() -> None:
    ds = one(render("values-replicas.yaml"), "DaemonSet", f"{RELEASE}-nodeplugin")
    spec = ds["spec"]["template"]["spec"]
    env = env_of(spec["containers"][0])
    assert env["TESSERA_TOKEN_FILE"] == "/var/run/tessera-token/token"
    assert env["TESSERA_ALLOCATION_SOURCE"] == "annotation"
    assert env["TESSERA_ALLOCATION_KEY_FILE"] == "/var/run/tessera-key/key"
    volumes = {v["name"]: v for v in spec["volumes"]}
    (source,) = volumes["token"]["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] == "tessera"
    assert volumes["allocation-key"]["secret"]["secretName"] == f"{RELEASE}-allocation-key"
    assert spec["automountServiceAccountToken"] is True


def test_node_plugin_falls_back_to_the_signed_annotation_by_default() -> None:
    """GPU containers start while the control plane is away: by default the plugin may read
    pods (and only get them) and verify their signed annotation with the allocation key."""

    def plugin(docs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
        spec = one(docs, "DaemonSet", f"{RELEASE}-nodeplugin")["spec"]["template"]["spec"]
        return spec, env_of(spec["containers"][0])

    docs = render()
    spec, env = plugin(docs)
    assert env["TESSERA_ALLOCATION_SOURCE"] == "controlplane"
    assert env["TESSERA_ALLOCATION_FALLBACK"] == "true"
    assert env["TESSERA_ALLOCATION_KEY_FILE"] == "/var/run/tessera-key/key"
    assert spec["automountServiceAccountToken"] is True
    role = one(docs, "ClusterRole", f"{RELEASE}-nodeplugin")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}]

    docs = render(sets=("nodeplugin.allocationFallback=false",))
    spec, env = plugin(docs)
    assert env["TESSERA_ALLOCATION_FALLBACK"] == "false"
    assert "TESSERA_ALLOCATION_KEY_FILE" not in env
    assert spec["automountServiceAccountToken"] is False
    assert not [d for d in find(docs, "ClusterRole") if "nodeplugin" in d["metadata"]["name"]]
    assert "allocation-key" not in {v["name"] for v in spec["volumes"]}


# --- monitoring ------------------------------------------------------------------------------


def test_service_monitor_only_when_enabled() -> None:
    assert not find(render(), "ServiceMonitor")
    (monitor,) = find(render("values-servicemonitor.yaml"), "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoints = {e["port"]: e for e in monitor["spec"]["endpoints"]}
    assert endpoints["http"]["path"] == "/metrics"
    assert endpoints["http"]["authorization"]["credentials"] == {
        "name": "tessera-metrics-token",
        "key": "token",
    }
    assert "metrics" in endpoints


def test_grafana_dashboard_configmap_is_the_deploy_grafana_json() -> None:
    cm = one(render(), "ConfigMap", f"{RELEASE}-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads((ROOT / "deploy/grafana/tessera-dashboard.json").read_text())
    assert json.loads(cm["data"]["tessera-dashboard.json"]) == shipped


def test_images_are_the_built_ones_from_one_registry() -> None:
    """`make images push REGISTRY=r` pushes r/tessera/controlplane and r/tessera/nodeplugin at
    the project's version: the chart's defaults name exactly those, under image.registry."""
    docs = render()
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    seen = {}
    for workload in workloads(docs):
        for c in containers(workload, init=True):
            seen[(workload["kind"], c["name"])] = c["image"]
    plugin = {k: v for k, v in seen.items() if k[0] == "DaemonSet"}
    tessera = {k: v for k, v in seen.items() if k[0] != "DaemonSet" and "tessera/" in v}
    assert set(plugin.values()) == {f"localhost:5000/tessera/nodeplugin:{version}"}
    assert set(tessera.values()) == {f"localhost:5000/tessera/controlplane:{version}"}
    assert ("Deployment", "worker") in tessera and ("Deployment", "extender") in tessera

    moved = render(sets=("image.registry=registry.example.com:5000/", "image.tag=1.2.3",
                         "nodeplugin.image.tag=1.2.4"))  # fmt: skip
    ds = one(moved, "DaemonSet", f"{RELEASE}-nodeplugin")
    assert containers(ds)[0]["image"] == "registry.example.com:5000/tessera/nodeplugin:1.2.4"
    app = chart_container(moved, "controlplane", "app")
    assert app["image"] == "registry.example.com:5000/tessera/controlplane:1.2.3"
    bare = render(sets=("image.registry=",))
    bare_app = chart_container(bare, "controlplane", "app")
    assert bare_app["image"] == f"tessera/controlplane:{version}"


def test_nodeplugin_network_controlplane_url_and_extra_volumes() -> None:
    default = one(render(), "DaemonSet", f"{RELEASE}-nodeplugin")["spec"]["template"]["spec"]
    assert "hostNetwork" not in default
    env = {e["name"]: e.get("value") for e in default["containers"][0]["env"]}
    assert env["TESSERA_CONTROLPLANE_URL"] == f"https://{RELEASE}.{NAMESPACE}.svc:8443"

    docs = render(sets=("nodeplugin.hostNetwork=true",
                        "nodeplugin.controlplaneURL=https://cp.example.com:8443",
                        "nodeplugin.extraVolumes[0].name=nvml",
                        "nodeplugin.extraVolumes[0].hostPath.path=/usr/lib/nvidia",
                        "nodeplugin.extraVolumeMounts[0].name=nvml",
                        "nodeplugin.extraVolumeMounts[0].mountPath=/usr/lib/nvidia"))  # fmt: skip
    spec = one(docs, "DaemonSet", f"{RELEASE}-nodeplugin")["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    plugin = spec["containers"][0]
    env = {e["name"]: e.get("value") for e in plugin["env"]}
    assert env["TESSERA_CONTROLPLANE_URL"] == "https://cp.example.com:8443"
    assert {"name": "nvml", "hostPath": {"path": "/usr/lib/nvidia"}} in spec["volumes"]
    assert {"name": "nvml", "mountPath": "/usr/lib/nvidia"} in plugin["volumeMounts"]
    names = [v["name"] for v in spec["volumes"]]
    assert len(names) == len(set(names))


def test_schema_refuses_a_controlplane_url_without_scheme(helm: Path) -> None:
    proc = run_helm("template", RELEASE, str(CHART), "--kube-version", KUBE_VERSION,
                    "--set", "nodeplugin.controlplaneURL=cp.example.com:8443",
                    home=Path("/tmp") / "tessera-helm-schema", check=False)  # fmt: skip
    assert proc.returncode != 0 and "controlplaneURL" in proc.stderr


def test_nodeplugin_termination_log_is_writable() -> None:
    """The host's /dev is mounted read-only over the plugin's /dev: a termination log left at
    /dev/termination-log makes runc fail the container's start (seen with a real kubelet)."""
    spec = one(render(), "DaemonSet", f"{RELEASE}-nodeplugin")["spec"]["template"]["spec"]
    plugin = spec["containers"][0]
    path = plugin.get("terminationMessagePath", "/dev/termination-log")
    mounts = {m["mountPath"]: m for m in plugin["volumeMounts"]}
    holder = max((m for m in mounts if path.startswith(m.rstrip("/") + "/")), key=len)
    assert not mounts[holder].get("readOnly"), (path, mounts[holder])
    emptydirs = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    assert mounts[holder]["name"] in emptydirs


def test_production_datastores_from_operator_secrets() -> None:
    """values-production.yaml (docs/operator-guide.md, "Production database and broker"): every
    Tessera process, init containers included, reads DATABASE_URL from CloudNativePG's app
    Secret and REDIS_URL from the managed Redis's; the chart bundles and stores neither."""
    docs = render("values-production.yaml")
    assert not find(docs, "StatefulSet")
    assert set(one(docs, "Secret", f"{RELEASE}-secrets")["data"]) == {"secret-key"}
    django = 0
    for workload in workloads(docs):
        for c in containers(workload, init=True):
            env = env_of(c)
            if "DATABASE_URL" not in env:
                continue
            django += 1
            where = f"{workload['metadata']['name']}/{c['name']}"
            assert env["DATABASE_URL"] == {
                "secretKeyRef": {"name": "tessera-pg-app", "key": "uri"}
            }, where
            if "REDIS_URL" in env:
                assert env["REDIS_URL"] == {
                    "secretKeyRef": {"name": "tessera-redis", "key": "url"}
                }, where
    assert django >= 6  # app, webhook, extender, worker, beat, migrate (and their waits)
    worker = containers(one(docs, "Deployment", f"{RELEASE}-worker"))[0]
    assert "REDIS_URL" in env_of(worker)
