"""The scheduler profile and webhook manifests say what docs/extender.md says."""

from __future__ import annotations

from pathlib import Path

import yaml

from controlplane.scheduling import ResourceNames

DEPLOY = Path(__file__).resolve().parent.parent.parent / "deploy"
# Every managed name, nvidia.com/priority included: no node advertises it either.
RESOURCES = set(ResourceNames().all())


def docs(path: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / path).read_text()) if d]


def test_scheduler_profile_calls_the_loopback_extender_for_every_verb() -> None:
    [config] = docs("scheduler/scheduler-config.yaml")
    assert [p["schedulerName"] for p in config["profiles"]] == ["tessera-scheduler"]
    # GPU room is invisible to kube-scheduler's own filters: it must not stop searching early
    assert config["profiles"][0]["percentageOfNodesToScore"] == 100
    [ext] = config["extenders"]
    assert ext["urlPrefix"].startswith("http://127.0.0.1:")
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["preemptVerb"], ext["bindVerb"]) == (
        "filter", "prioritize", "preempt", "bind",
    )  # fmt: skip
    assert ext["nodeCacheCapable"] is True and ext["weight"] > 0 and ext["httpTimeout"]
    assert {r["name"] for r in ext["managedResources"]} == RESOURCES
    assert all(r["ignoredByScheduler"] is True for r in ext["managedResources"])
    # the ConfigMap the Deployment mounts carries the same configuration
    configmap = next(d for d in docs("scheduler/deployment.yaml") if d["kind"] == "ConfigMap")
    assert yaml.safe_load(configmap["data"]["scheduler-config.yaml"]) == config


def test_sidecar_serves_the_extender_on_loopback_only_with_the_key_file() -> None:
    deployment = next(d for d in docs("scheduler/deployment.yaml") if d["kind"] == "Deployment")
    [sidecar] = [c for c in deployment["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "extender"]  # fmt: skip
    assert {"--host=127.0.0.1", "--port=8001", "--workers=1"} <= set(sidecar["command"])
    env = {e["name"]: e.get("value") for e in sidecar["env"]}
    assert env["TESSERA_SERVE_EXTENDER"] == "1" and env["TESSERA_ENV"] == "production"
    assert env["TESSERA_ALLOCATION_KEY_FILE"]


# kube-scheduler's extender client keeps idle connections for 90 s (Go's http.DefaultTransport,
# through k8s.io/apimachinery's SetTransportDefaults); the sidecar must not close them sooner.
SCHEDULER_IDLE_CONN_S = 90


def header_read_timeout_ms(command: list[str]) -> int:
    values = [
        int(a.split("=", 1)[1]) for a in command if a.startswith("--http1-header-read-timeout=")
    ]
    assert len(values) == 1, command
    return values[0]


def test_sidecar_keeps_idle_connections_longer_than_the_scheduler() -> None:
    """granian closes a connection idle for its header-read timeout; its own command line caps
    that at 60 s, so the sidecar starts granian through controlplane.sidecar (docs/extender.md)."""
    deployment = next(d for d in docs("scheduler/deployment.yaml") if d["kind"] == "Deployment")
    [sidecar] = [c for c in deployment["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "extender"]  # fmt: skip
    command = sidecar["command"]
    assert command[:3] == ["python", "-m", "controlplane.sidecar"]
    assert header_read_timeout_ms(command) > SCHEDULER_IDLE_CONN_S * 1000


def test_webhook_configuration() -> None:
    [config] = docs("webhook/mutatingwebhookconfiguration.yaml")
    [hook] = config["webhooks"]
    assert hook["sideEffects"] == "None" and hook["admissionReviewVersions"] == ["v1"]
    assert hook["failurePolicy"] == "Fail" and hook["timeoutSeconds"] <= 10
    assert hook["clientConfig"]["service"]["path"] == "/webhook/mutate"
    excluded = hook["namespaceSelector"]["matchExpressions"][0]["values"]
    assert {"kube-system", "tessera-system"} <= set(excluded)
    assert hook["rules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"],
         "resources": ["pods"], "scope": "Namespaced"}
    ]  # fmt: skip
