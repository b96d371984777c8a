"""DRA mode's validating webhook for claims (docs/dra.md, *Quotas at admission*): rendered only
in DRA mode, aimed at the route the control plane serves, trusted through the same CA as the
pod webhook, scoped to claims naming Tessera's classes and pods naming claim templates, and the
control plane given the read access and the token it needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from django.urls import resolve

from controlplane.extender import views
from controlplane.scheduling.claim_demand import TESSERA_CLASSES
from tests.deploy.chart import render

pytestmark = pytest.mark.usefixtures("helm")


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def test_extender_mode_renders_no_claim_webhook_and_no_claim_access() -> None:
    docs = render()
    assert of_kind(docs, "ValidatingWebhookConfiguration") == {}
    assert "tessera-claims" not in of_kind(docs, "ClusterRole")


def test_dra_mode_renders_the_claim_webhook_on_the_served_route() -> None:
    docs = render(sets=("mode=dra",))
    (config,) = of_kind(docs, "ValidatingWebhookConfiguration").values()
    hooks = {h["name"]: h for h in config["webhooks"]}
    assert set(hooks) == {"claims.tessera.io", "claim-pods.tessera.io"}
    (secret,) = [d for d in docs if d["kind"] == "Secret" and "ca.crt" in d.get("data", {})]
    for hook in hooks.values():
        service = hook["clientConfig"]["service"]
        assert resolve(service["path"]).func is views.validate_claims_view
        assert (service["name"], service["port"]) == ("tessera-webhook", 443)
        assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
        assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
        assert hook["rules"][0]["operations"] == ["CREATE"]
        assert "tessera-system" in hook["namespaceSelector"]["matchExpressions"][0]["values"]
    claims, pods = hooks["claims.tessera.io"], hooks["claim-pods.tessera.io"]
    assert claims["rules"][0]["apiGroups"] == ["resource.k8s.io"]
    assert claims["rules"][0]["resources"] == ["resourceclaims"]
    assert pods["rules"][0]["resources"] == ["pods"]
    # the CEL scope names exactly the classes the chart renders and the demand counts
    expression = claims["matchConditions"][0]["expression"]
    rendered = set(of_kind(docs, "DeviceClass"))
    assert rendered == set(TESSERA_CLASSES)
    assert all(f'"{name}"' in expression for name in TESSERA_CLASSES)
    assert "resourceClaimTemplateName" in pods["matchConditions"][0]["expression"]


def test_dra_mode_gives_the_control_plane_read_access_and_a_token() -> None:
    docs = render(sets=("mode=dra",))
    role = of_kind(docs, "ClusterRole")["tessera-claims"]
    granted = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert granted == {
        ("pods", "get"), ("resourceclaims", "get"), ("resourceclaims", "list"),
        ("resourceclaimtemplates", "get"), ("resourceslices", "list"),
    }  # fmt: skip
    binding = of_kind(docs, "ClusterRoleBinding")["tessera-claims"]
    (subject,) = binding["subjects"]
    (deployment,) = [
        d for d in docs
        if d["kind"] == "Deployment" and d["metadata"]["name"] == "tessera-controlplane"
    ]  # fmt: skip
    pod = deployment["spec"]["template"]["spec"]
    assert subject["name"] == pod["serviceAccountName"]
    assert pod["automountServiceAccountToken"] is True


def test_cert_manager_injects_the_claim_webhook_ca() -> None:
    docs = render("values-certmanager.yaml", sets=("mode=dra",))
    (config,) = of_kind(docs, "ValidatingWebhookConfiguration").values()
    assert config["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == (
        "tessera-system/tessera-webhook"
    )
    assert all("caBundle" not in h["clientConfig"] for h in config["webhooks"])


def test_the_plain_manifest_says_what_the_chart_renders() -> None:
    plain = [
        d for d in yaml.safe_load_all(
            (Path(__file__).parents[2] / "deploy/webhook/validatingwebhookconfiguration-dra.yaml")
            .read_text()
        ) if d
    ]  # fmt: skip
    chart = render(sets=("mode=dra",))
    (mine,) = of_kind(plain, "ValidatingWebhookConfiguration").values()
    (theirs,) = of_kind(chart, "ValidatingWebhookConfiguration").values()
    for a, b in zip(mine["webhooks"], theirs["webhooks"], strict=True):
        assert a["name"] == b["name"] and a["rules"] == b["rules"]
        assert a["clientConfig"]["service"] == b["clientConfig"]["service"]
        assert (a["failurePolicy"], a["timeoutSeconds"]) == (b["failurePolicy"], 5)
        for name in TESSERA_CLASSES if a["name"] == "claims.tessera.io" else ():
            assert f'"{name}"' in a["matchConditions"][0]["expression"]
    assert (
        of_kind(plain, "ClusterRole")["tessera-claims"]["rules"]
        == (of_kind(chart, "ClusterRole")["tessera-claims"]["rules"])
    )
