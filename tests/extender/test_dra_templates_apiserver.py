"""DRA mode's ResourceClaimTemplates against a real kube-apiserver (the e2e harness's, 1.37.2):
every template the translation writes for HAMi's corpus and for each HAMi feature is accepted
(its CEL selectors compile, its constraints and alternatives validate), read back as the same
spec after the API server's defaults and canonical quantities, and written through the webhook's
own path (`ensure_template`, `RealKube`) under the chart's RBAC for the control plane, which
allows get and create and nothing more.

No scheduler or controllers run: the API server stores and validates.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from controlplane.extender.dra_admission import TemplateRefused, ensure_template
from controlplane.extender.dra_translate import translate
from controlplane.kube.base import KubeError
from controlplane.kube.real import RealKube
from controlplane.scheduling import RequestError, SchedulingConfig, parse_pod
from tests.compat.test_hami_corpus import CORPUS, case_ids, load
from tests.deploy.chart import RELEASE, render
from tests.deploy.conftest import apiserver, helm  # noqa: F401  (fixtures)
from tests.pods import gpu_container, pod_json

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("helm")]

NAMESPACE = "tessera-system"
CONFIG = SchedulingConfig()


@pytest.fixture(scope="module")
def admin(apiserver: Any) -> Iterator[Any]:  # noqa: F811
    with contextlib.closing(apiserver.api_client()) as api:
        yield api


def kubeconfig_with_token(apiserver: Any, token: str, path: Path) -> Path:  # noqa: F811
    admin = yaml.safe_load(Path(apiserver.kubeconfig).read_text())
    (cluster,) = admin["clusters"]
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [cluster],
                "users": [{"name": "webhook", "user": {"token": token}}],
                "contexts": [
                    {"name": "webhook", "context": {"cluster": cluster["name"], "user": "webhook"}}
                ],
                "current-context": "webhook",
            }
        )
    )
    return path


@pytest.fixture(scope="module")
def webhook_kube(
    apiserver: Any,  # noqa: F811
    admin: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> RealKube:
    """RealKube with the control plane's ServiceAccount token, under the chart's DRA-mode
    ClusterRole and binding for it (as rendered), nothing else."""
    from kubernetes import client, utils

    core = client.CoreV1Api(admin)
    core.create_namespace({"metadata": {"name": NAMESPACE}})
    docs = render(sets=("mode=dra",))
    sa = f"{RELEASE}-controlplane"
    wanted = [
        d
        for d in docs
        if (d["kind"] == "ServiceAccount" and d["metadata"]["name"] == sa)
        or (d["kind"] in ("ClusterRole", "ClusterRoleBinding")
            and d["metadata"]["name"].endswith("claim-templates"))
    ]  # fmt: skip
    assert len(wanted) == 3, [d["metadata"]["name"] for d in wanted]
    for doc in wanted:
        utils.create_from_dict(admin, copy.deepcopy(doc), namespace=NAMESPACE)
    token = core.create_namespaced_service_account_token(
        sa, NAMESPACE, {"spec": {"expirationSeconds": 3600}}
    ).status.token
    path = kubeconfig_with_token(apiserver, token, tmp_path_factory.mktemp("kc") / "config")
    return RealKube("kubeconfig", str(path))


def namespace(admin: Any, name: str) -> str:
    from kubernetes import client

    with contextlib.suppress(client.ApiException):
        client.CoreV1Api(admin).create_namespace({"metadata": {"name": name}})
    return name


def feature_pods() -> list[dict[str, Any]]:
    """A pod per HAMi feature the translation carries."""
    pods = []
    for i, marks in enumerate(
        [
            {},
            {"nvidia.com/use-gputype": "A100,h100", "nvidia.com/nouse-gputype": 'odd"quote'},
            {"nvidia.com/use-gpuuuid": "GPU-aaa,GPU-bbb", "nvidia.com/nouse-gpuuuid": "GPU-c"},
            {"nvidia.com/numa-bind": "true"},
            {"nvidia.com/vgpu-mode": "mig"},
            {"nvidia.com/vgpu-mode": "mps"},
            {"nvidia.com/vgpu-mode": "mig,hami-core,mps"},
        ]
    ):
        pods.append(
            pod_json(
                f"f{i}",
                "x",
                containers=[gpu_container("main", gpus=2, mem=4096, cores=30)],
                annotations=marks,
            )
        )
    percent = pod_json("pct", "x", containers=[gpu_container("main")])
    percent["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpumem-percentage"] = 40
    pods.append(percent)
    return pods


def corpus_pods() -> Iterator[tuple[dict[str, Any], tuple[int, ...]]]:
    for case_id in case_ids():
        case = load(case_id)
        sizes = tuple(
            sorted({c["memory_mib"] for r in case["inventory"].values() for c in r["cards"]})
        )
        for entry in case["pods"]:
            yield entry["admission_review"]["request"]["object"], sizes


def test_every_template_is_accepted_and_read_back_as_the_same_spec(
    webhook_kube: RealKube, admin: Any
) -> None:
    pods = [(p, (23028, 81920)) for p in feature_pods()]
    if CORPUS is not None:
        pods += list(corpus_pods())
    written = 0
    for pod, sizes in pods:
        try:
            request = parse_pod(pod, CONFIG)
            if request is None:
                continue
            translation = translate(pod, request, CONFIG, sizes)
        except RequestError:
            continue  # refused at admission: nothing is written
        ns = namespace(admin, "hami")
        for template in translation.templates:
            ensure_template(webhook_kube, ns, template, dry_run=False)  # created (or found)
            ensure_template(webhook_kube, ns, template, dry_run=False)  # found, the same spec
            stored = webhook_kube.get_claim_template(ns, template.name)
            assert stored is not None and stored["metadata"]["labels"]
            written += 1
    assert written >= len(feature_pods())


def test_a_template_planted_under_the_name_is_refused(webhook_kube: RealKube, admin: Any) -> None:
    from kubernetes import client

    pod = pod_json("p", "x", containers=[gpu_container("main", mem=2048, cores=10)])
    request = parse_pod(pod, CONFIG)
    assert request is not None
    (template,) = translate(pod, request, CONFIG).templates
    ns = namespace(admin, "planted")
    forged = template.manifest(ns)
    exact = forged["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    exact["capacity"]["requests"]["memory"] = "1Mi"
    client.CustomObjectsApi(admin).create_namespaced_custom_object(
        "resource.k8s.io", "v1", ns, "resourceclaimtemplates", forged
    )
    with pytest.raises(TemplateRefused, match=template.name):
        ensure_template(webhook_kube, ns, template, dry_run=False)


def test_the_webhooks_account_may_not_change_or_delete_templates_nor_write_claims(
    webhook_kube: RealKube, admin: Any
) -> None:
    from kubernetes import client

    ns = namespace(admin, "rbac")
    pod = pod_json("p", "x", containers=[gpu_container("main", mem=1024)])
    request = parse_pod(pod, CONFIG)
    assert request is not None
    (template,) = translate(pod, request, CONFIG).templates
    ensure_template(webhook_kube, ns, template, dry_run=False)
    custom = client.CustomObjectsApi(webhook_kube.api.api_client)
    with pytest.raises(client.ApiException) as err:
        custom.delete_namespaced_custom_object(
            "resource.k8s.io", "v1", ns, "resourceclaimtemplates", template.name
        )
    assert err.value.status == 403
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "c"}, "spec": template.spec["spec"]}  # fmt: skip
    with pytest.raises(client.ApiException) as err:
        custom.create_namespaced_custom_object("resource.k8s.io", "v1", ns, "resourceclaims", claim)
    assert err.value.status == 403
    with pytest.raises(KubeError) as kerr:
        webhook_kube.create_claim_template(template.manifest(ns))  # it exists: a 409, not a 403
    assert kerr.value.conflict


def test_the_api_server_compiles_the_selectors_a_bad_one_refuses_the_pod(
    webhook_kube: RealKube, admin: Any
) -> None:
    """The check above means something: a selector that does not compile is refused at create,
    and the webhook turns that into a refusal naming the API server's reason."""
    pod = pod_json("p", "x", containers=[gpu_container("main", mem=512)])
    request = parse_pod(pod, CONFIG)
    assert request is not None
    (template,) = translate(pod, request, CONFIG).templates
    broken = copy.deepcopy(template.spec)
    exact = broken["spec"]["devices"]["requests"][0]["exactly"]
    exact["selectors"] = [{"cel": {"expression": 'device.attributes["gpu.tessera.io"].model.('}}]
    bad = type(template)(template.name, broken)
    with pytest.raises(TemplateRefused, match="refused by the API server"):
        ensure_template(webhook_kube, namespace(admin, "broken"), bad, dry_run=False)
