"""`POST /webhook/mutate` in DRA mode (`TESSERA_MODE=dra`): a HAMi-style pod gets its claim
templates, created once and checked every time, and the patch that points it at them; the
refusals of extender mode still hold; a template planted under the name is refused."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from controlplane.kube.base import KubeError
from tests.builders import make_node
from tests.extender.conftest import FakeKube, post
from tests.extender.dra_pods import apply_json_patch, claims_by_container, decode_patch
from tests.extender.test_webhook import mutate, review
from tests.pods import gpu_container, pod_json

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]


class TemplateKube(FakeKube):
    """The fake API server, with ResourceClaimTemplates."""

    def __init__(self) -> None:
        super().__init__()
        self.templates: dict[tuple[str, str], dict[str, Any]] = {}
        self.creates = 0
        self.fail_template: KubeError | None = None

    def get_claim_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.fail_template is not None:
            raise self.fail_template
        found = self.templates.get((namespace, name))
        return copy.deepcopy(found) if found else None

    def create_claim_template(self, template: dict[str, Any]) -> dict[str, Any]:
        meta = template["metadata"]
        key = (meta["namespace"], meta["name"])
        if key in self.templates:
            raise KubeError("exists", 409, False)
        self.creates += 1
        self.templates[key] = copy.deepcopy(template)
        return template


@pytest.fixture
def kube(monkeypatch: pytest.MonkeyPatch, settings) -> TemplateKube:
    from controlplane.kube import adapter

    settings.TESSERA = {**settings.TESSERA, "MODE": "dra"}
    fake = TemplateKube()
    monkeypatch.setattr(adapter, "get_kube", lambda: fake)
    make_node("n1", cards=2, memory_mib=81920)
    return fake


def hami_pod(name: str = "p", namespace: str = "team", **kw: Any) -> dict[str, Any]:
    pod = pod_json(name, namespace, containers=[gpu_container("main", mem=4096, cores=30)], **kw)
    pod["spec"]["schedulerName"] = "default-scheduler"
    return pod


def test_a_hami_pod_gets_its_claim_and_the_template_is_created(client, kube) -> None:
    pod = hami_pod()
    answer = mutate(client, pod)
    assert answer["allowed"] is True
    patched = apply_json_patch(pod, decode_patch(answer))
    assert patched["spec"]["schedulerName"] == "default-scheduler"  # kube-scheduler allocates
    ((namespace, name),) = kube.templates
    assert namespace == "team"
    template = kube.templates[(namespace, name)]
    assert template["apiVersion"] == "resource.k8s.io/v1"
    assert template["kind"] == "ResourceClaimTemplate"
    per = claims_by_container(patched, {name: template["spec"]})
    exact = per["main"]["request"]["exactly"]
    assert exact["capacity"]["requests"] == {"memory": "4096Mi", "compute": "30"}
    assert "nvidia.com/gpu" not in patched["spec"]["containers"][0]["resources"].get("limits", {})


def test_the_next_pod_of_the_shape_reuses_the_template(client, kube) -> None:
    first = mutate(client, hami_pod("a"))
    second = mutate(client, hami_pod("b"), uid="another")
    assert kube.creates == 1
    assert decode_patch(first) == decode_patch(second)


def test_a_template_created_meanwhile_is_checked_and_used(client, kube) -> None:
    mutate(client, hami_pod("a"))
    kept = dict(kube.templates)
    kube.templates.clear()
    real_get = kube.get_claim_template
    calls = iter([None])  # the first read misses it, the create then meets it

    def get(namespace: str, name: str) -> dict[str, Any] | None:
        if next(calls, "again") is None:
            kube.templates.update(kept)
            return None
        return real_get(namespace, name)

    kube.get_claim_template = get  # type: ignore[method-assign]
    assert mutate(client, hami_pod("b"))["allowed"] is True


def test_a_planted_template_of_that_name_refuses_the_pod(client, kube) -> None:
    mutate(client, hami_pod("a"))
    ((key, template),) = kube.templates.items()
    exact = template["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    exact["tolerations"] = [{"key": "gpu.tessera.io/unhealthy", "operator": "Exists"}]
    answer = mutate(client, hami_pod("b"))
    assert answer["allowed"] is False
    message = answer["status"]["message"]
    assert key[1] in message and "spec other than" in message
    assert kube.creates == 1  # nothing written for the refused pod


def test_a_template_the_api_server_refuses_refuses_the_pod_with_its_reason(client, kube) -> None:
    def refuse(template: dict[str, Any]) -> dict[str, Any]:
        raise KubeError("create resourceclaimtemplate: API server answered 422: too costly", 422)

    kube.create_claim_template = refuse  # type: ignore[method-assign]
    answer = mutate(client, hami_pod())
    assert answer["allowed"] is False
    assert "refused by the API server" in answer["status"]["message"]
    assert "too costly" in answer["status"]["message"]


def test_a_dry_run_creates_nothing(client, kube) -> None:
    body = review(hami_pod())
    body["request"]["dryRun"] = True
    answer = post(client, "/webhook/mutate", body).json()["response"]
    assert answer["allowed"] is True and "patch" in answer
    assert kube.templates == {}


def test_what_a_claim_cannot_carry_is_denied_and_nothing_is_created(client, kube) -> None:
    pod = hami_pod()
    pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/priority"] = "0"
    answer = mutate(client, pod)
    assert answer["allowed"] is False
    assert "nvidia.com/priority" in answer["status"]["message"]
    assert kube.templates == {}


def test_a_percentage_is_turned_into_mib_of_the_registered_card_sizes(client, kube) -> None:
    make_node("n2", cards=1, memory_mib=23028)
    pod = hami_pod()
    limits = pod["spec"]["containers"][0]["resources"]["limits"]
    del limits["nvidia.com/gpumem"]
    limits["nvidia.com/gpumem-percentage"] = "25"
    answer = mutate(client, pod)
    assert answer["allowed"] is True
    ((_, name),) = kube.templates
    (request,) = kube.templates[("team", name)]["spec"]["spec"]["devices"]["requests"]
    got = [s["capacity"]["requests"]["memory"] for s in request["firstAvailable"]]
    assert got == ["5757Mi", "20480Mi"]


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda p: p["spec"].update(nodeName="n1"), "spec.nodeName"),
        (
            lambda p: p["spec"]["containers"][0].update(securityContext={"privileged": True}),
            "privileged",
        ),
        (
            lambda p: p["spec"]["containers"][0]["resources"]["limits"].update(
                {"nvidia.com/gpumem": "999999"}
            ),
            "largest registered card",
        ),
    ],
)
def test_extender_modes_refusals_hold_in_dra_mode(client, kube, change, needle) -> None:
    pod = hami_pod()
    change(pod)
    answer = mutate(client, pod)
    assert answer["allowed"] is False and needle in answer["status"]["message"]
    assert kube.templates == {}


def test_placement_preferences_come_back_as_warnings(client, kube) -> None:
    answer = mutate(client, hami_pod(annotations={"hami.io/node-scheduler-policy": "spread"}))
    assert answer["allowed"] is True
    assert answer["warnings"] and "not applied in DRA mode" in answer["warnings"][0]


def test_pods_of_other_schedulers_and_cpu_pods_pass_untouched(client, kube) -> None:
    volcano = hami_pod()
    volcano["spec"]["schedulerName"] = "volcano"
    assert "patch" not in mutate(client, volcano)
    cpu = pod_json("c", "team", containers=[{"name": "web", "image": "nginx"}])
    assert "patch" not in mutate(client, cpu)
    assert kube.templates == {}


def test_a_pod_naming_tesseras_scheduler_goes_to_kube_scheduler(client, kube) -> None:
    pod = hami_pod()
    pod["spec"]["schedulerName"] = "tessera-scheduler"
    patched = apply_json_patch(pod, decode_patch(mutate(client, pod)))
    assert patched["spec"]["schedulerName"] == "default-scheduler"


def test_the_api_server_unreachable_is_an_error_not_a_verdict(client, kube) -> None:
    kube.fail_template = KubeError("unreachable", None, False)
    response = post(client, "/webhook/mutate", review(hami_pod()))
    assert response.status_code == 500


def test_extender_mode_is_the_default_and_writes_no_template(client, settings) -> None:
    assert settings.TESSERA["MODE"] == "extender"
    make_node("n1")
    pod = hami_pod()
    patched = apply_json_patch(pod, decode_patch(mutate(client, pod)))
    assert patched["spec"]["schedulerName"] == "tessera-scheduler"
    assert "resourceClaims" not in patched["spec"]


def mode_of(tmp_path, value: str | None) -> subprocess.CompletedProcess[str]:
    """Start the settings with TESSERA_MODE=value (unset: None) and print the mode."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TESSERA_", "KUBE"))}
    env.update(DJANGO_SETTINGS_MODULE="controlplane.settings", TESSERA_LOCAL_DIR=str(tmp_path))
    if value is not None:
        env["TESSERA_MODE"] = value
    code = "import django; django.setup(); from django.conf import settings;"
    code += " print(settings.TESSERA['MODE'])"
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=60, check=False,
    )  # fmt: skip


def test_the_mode_setting_takes_extender_or_dra_and_refuses_the_rest(tmp_path) -> None:
    for value, mode in ((None, "extender"), ("extender", "extender"), ("dra", "dra")):
        result = mode_of(tmp_path, value)
        assert result.returncode == 0, result.stderr
        assert result.stdout.split() == [mode]
    for bad in ("DRA", "device-plugin"):
        result = mode_of(tmp_path, bad)
        assert result.returncode != 0
        assert f"TESSERA_MODE={bad!r} is not a mode Tessera runs" in result.stderr
