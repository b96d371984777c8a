"""The chart's part of DRA mode's webhook: TESSERA_MODE from `.Values.mode` in every control-plane
process, the webhook registered under its own name (NoneOnDryRun: it creates
ResourceClaimTemplates), and the least RBAC for that."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.chart import RELEASE, container, render
from tests.deploy.conftest import helm  # noqa: F401  (the pinned helm, a fixture)

pytestmark = pytest.mark.usefixtures("helm")


def env(item: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in item.get("env") or []}


def named(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


@pytest.mark.parametrize("mode", ["extender", "dra"])
def test_every_control_plane_process_runs_the_charts_mode(mode: str) -> None:
    docs = render(sets=(f"mode={mode}",))
    for name in ("app", "webhook"):
        assert env(container(docs, "controlplane", name))["TESSERA_MODE"] == mode


def test_dra_mode_registers_the_hami_pod_webhook_under_its_own_name() -> None:
    extender = named(render(), "MutatingWebhookConfiguration")
    dra = named(render(sets=("mode=dra",)), "MutatingWebhookConfiguration")
    assert set(extender) == {RELEASE} and set(dra) == {f"{RELEASE}-dra-pods"}
    (ext_hook,) = extender[RELEASE]["webhooks"]
    (dra_hook,) = dra[f"{RELEASE}-dra-pods"]["webhooks"]
    assert ext_hook["sideEffects"] == "None"
    assert dra_hook["sideEffects"] == "NoneOnDryRun"  # it creates templates, never on a dry run
    # the same pods, the same path: only pods naming a Tessera resource are sent
    for key in ("matchConditions", "rules", "namespaceSelector", "objectSelector"):
        assert dra_hook[key] == ext_hook[key], key
    assert dra_hook["clientConfig"]["service"] == ext_hook["clientConfig"]["service"]
    assert dra_hook["clientConfig"]["caBundle"]  # each rendering makes its own CA
    off = render(sets=("mode=dra", "dra.hamiPods=false"))
    assert named(off, "MutatingWebhookConfiguration") == {}


def rules_of(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    roles = named(docs, "ClusterRole")
    return [
        rule for name, role in roles.items() if "controlplane" in name for rule in role["rules"]
    ]


def test_the_webhook_may_get_and_create_claim_templates_and_nothing_more() -> None:
    dra = render(sets=("mode=dra",))
    template_rules = [r for r in rules_of(dra) if "resourceclaimtemplates" in r["resources"]]
    assert template_rules == [
        {"apiGroups": ["resource.k8s.io"], "resources": ["resourceclaimtemplates"],
         "verbs": ["get", "create"]}
    ]  # fmt: skip
    bindings = named(dra, "ClusterRoleBinding")
    (binding,) = [b for b in bindings.values() if b["roleRef"]["name"].endswith("claim-templates")]
    (subject,) = binding["subjects"]
    (deployment,) = [
        d
        for d in dra
        if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("controlplane")
    ]
    pod = deployment["spec"]["template"]["spec"]
    assert subject["name"] == pod["serviceAccountName"]
    assert pod["automountServiceAccountToken"] is True  # the webhook talks to the API server
    for docs in (render(), render(sets=("mode=dra", "dra.hamiPods=false"))):
        assert not [r for r in rules_of(docs) if "resourceclaimtemplates" in r["resources"]]
