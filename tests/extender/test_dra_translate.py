"""DRA mode's translation of HAMi-style pods (controlplane/extender/dra_translate.py), per HAMi
feature: the claim each container gets, the pod's patch, and the refusals, naming the field."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from controlplane.extender import dra_translate as dt
from controlplane.scheduling import RequestError, SchedulingConfig, parse_pod
from nodeplugin.dra_slices import DRIVER
from tests.extender.dra_pods import apply_json_patch, claims_by_container
from tests.pods import container, gpu_container, pod_json

CONFIG = SchedulingConfig()


def translated(pod: dict[str, Any], config: SchedulingConfig = CONFIG) -> dt.Translation:
    request = parse_pod(pod, config)
    assert request is not None
    return dt.translate(pod, request, config)


def claims(pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]], dt.Translation]:
    """The patched pod and, per container, its claim's request and constraints."""
    t = translated(pod)
    patched = apply_json_patch(pod, t.patch)
    by_name = {x.name: x.spec for x in t.templates}
    return patched, claims_by_container(patched, by_name), t


def hami_pod(*containers: dict[str, Any], annotations: dict[str, str] | None = None) -> dict:
    return pod_json("p", "team", containers=list(containers), annotations=annotations)


def test_the_driver_is_the_node_plugins() -> None:
    assert dt.DRIVER == DRIVER
    assert set(dt.DEVICE_CLASSES.values()) == {DRIVER, f"mps.{DRIVER}", f"mig.{DRIVER}"}


def test_gpu_gpumem_gpucores_become_a_claim_with_consumed_capacity() -> None:
    main = gpu_container("main", gpus=1, mem=4096, cores=30)
    main["resources"]["limits"]["cpu"] = "2"
    main["resources"]["requests"] = {"nvidia.com/gpumem": "4096", "memory": "1Gi"}
    patched, per, t = claims(hami_pod(main))
    exact = per["main"]["request"]["exactly"]
    assert exact["deviceClassName"] == DRIVER
    assert exact["count"] == 1 and exact["allocationMode"] == "ExactCount"
    assert exact["capacity"] == {"requests": {"memory": "4096Mi", "compute": "30"}}
    # a share of a card: shared cards only (an exclusive card takes whole-card slices)
    assert [s["cel"]["expression"] for s in exact["selectors"]] == [
        f'device.attributes["{DRIVER}"].mode == "shared"'
    ]
    resources = patched["spec"]["containers"][0]["resources"]
    # the HAMi names are gone (no node advertises them in DRA mode); the rest stays
    assert resources["limits"] == {"cpu": "2"}
    assert resources["requests"] == {"memory": "1Gi"}
    assert resources["claims"] == [{"name": "tessera-gpu-0", "request": "main"}]
    assert patched["spec"]["resourceClaims"] == [
        {"name": "tessera-gpu-0", "resourceClaimTemplateName": t.templates[0].name}
    ]
    assert t.warnings == ()


def test_cores_only_is_one_gpu_of_the_whole_cards_memory() -> None:
    c = container("main", limits={"nvidia.com/gpucores": "50"})
    patched, per, _ = claims(hami_pod(c))
    exact = per["main"]["request"]["exactly"]
    assert exact["count"] == 1
    assert exact["capacity"] == {"requests": {"compute": "50"}}  # memory: the policy's default
    assert "selectors" not in exact  # a whole card: shared or exclusive
    assert "limits" not in patched["spec"]["containers"][0]["resources"]


@pytest.mark.parametrize("percent", ["100", "0"])
def test_whole_card_percentages_ask_no_memory(percent: str) -> None:
    c = container("main", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": percent})
    _, per, _ = claims(hami_pod(c))
    assert "capacity" not in per["main"]["request"]["exactly"]


def test_a_percentage_is_that_share_of_each_card_size_in_the_cluster() -> None:
    c = container("main", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50"})
    pod = hami_pod(c)
    request = parse_pod(pod, CONFIG)
    assert request is not None
    t = dt.translate(pod, request, CONFIG, card_sizes=(23028, 81920))
    patched = apply_json_patch(pod, t.patch)
    per = claims_by_container(patched, {x.name: x.spec for x in t.templates})
    first = per["main"]["request"]["firstAvailable"]
    assert [(s["name"], s["capacity"]["requests"]["memory"]) for s in first] == [
        ("shared-23028mi", "11514Mi"),  # HAMi's floor(card MiB x percent / 100)
        ("shared-81920mi", "40960Mi"),
    ]
    size = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("23028Mi")) == 0'
    assert {"cel": {"expression": size}} in first[0]["selectors"]


@pytest.mark.parametrize(
    ("sizes", "annotations", "needle"),
    [
        ((), {}, "no shared card is registered yet"),
        (tuple(range(1000, 10000, 1000)), {}, "at most 8"),
        ((81920,), {"nvidia.com/vgpu-mode": "hami-core,mig"}, "MIG placement is allocated whole"),
    ],
)
def test_a_percentage_a_claim_cannot_carry_is_refused_with_the_field(
    sizes: tuple[int, ...], annotations: dict[str, str], needle: str
) -> None:
    c = container("main", limits={"nvidia.com/gpu": "1", "nvidia.com/gpumem-percentage": "50"})
    pod = hami_pod(c, annotations=annotations)
    request = parse_pod(pod, CONFIG)
    assert request is not None
    with pytest.raises(RequestError) as err:
        dt.translate(pod, request, CONFIG, card_sizes=sizes)
    assert err.value.field == "spec.containers[0].resources.limits.nvidia.com/gpumem-percentage"
    assert needle in err.value.message


def test_several_gpus_are_distinct_cards_and_numa_bind_one_numa_node() -> None:
    c = gpu_container("train", gpus=2, mem=8000)
    _, per, _ = claims(hami_pod(c))
    assert per["train"]["request"]["exactly"]["count"] == 2
    assert per["train"]["constraints"] == [
        {"requests": ["train"], "distinctAttribute": f"{DRIVER}/uuid"}
    ]
    _, per, _ = claims(hami_pod(c, annotations={"nvidia.com/numa-bind": "true"}))
    assert {"requests": ["train"], "matchAttribute": "resource.kubernetes.io/numaNode"} in per[
        "train"
    ]["constraints"]


def test_card_type_and_uuid_annotations_become_cel_selectors() -> None:
    pod = hami_pod(
        gpu_container("main", mem=1000),
        annotations={
            "nvidia.com/use-gputype": "A100, H100",
            "nvidia.com/nouse-gputype": "MIG",
            "nvidia.com/use-gpuuuid": "GPU-AAA,gpu-bbb",
            "nvidia.com/nouse-gpuuuid": "GPU-ccc",
        },
    )
    _, per, _ = claims(pod)
    got = [s["cel"]["expression"] for s in per["main"]["request"]["exactly"]["selectors"]]
    a = f'device.attributes["{DRIVER}"]'
    assert got == [
        f'{a}.model.lowerAscii().contains("a100") || {a}.model.lowerAscii().contains("h100")',
        f'!({a}.model.lowerAscii().contains("mig"))',
        f'{a}.uuid.lowerAscii() in ["gpu-aaa", "gpu-bbb"]',
        f'!({a}.uuid.lowerAscii() in ["gpu-ccc"])',
        f'{a}.mode == "shared"',
    ]


def test_a_quote_in_an_annotation_stays_inside_the_cel_string() -> None:
    pod = hami_pod(
        gpu_container("main"), annotations={"nvidia.com/use-gputype": 'a") || true || ("'}
    )
    _, per, _ = claims(pod)
    (expression, *_) = [
        s["cel"]["expression"] for s in per["main"]["request"]["exactly"]["selectors"]
    ]
    assert expression.endswith('.contains("a\\") || true || (\\"")')


@pytest.mark.parametrize(
    ("mode", "device_class"), [("mps", f"mps.{DRIVER}"), ("hami-core", DRIVER)]
)
def test_vgpu_mode_picks_the_class(mode: str, device_class: str) -> None:
    pod = hami_pod(
        gpu_container("main", mem=2048, cores=20), annotations={"nvidia.com/vgpu-mode": mode}
    )
    _, per, _ = claims(pod)
    exact = per["main"]["request"]["exactly"]
    assert exact["deviceClassName"] == device_class
    assert exact["capacity"]["requests"] == {"memory": "2048Mi", "compute": "20"}


def test_mig_asks_a_placement_at_least_that_large() -> None:
    pod = hami_pod(
        gpu_container("main", gpus=2, mem=8000), annotations={"nvidia.com/vgpu-mode": "mig"}
    )
    _, per, _ = claims(pod)
    exact = per["main"]["request"]["exactly"]
    assert exact["deviceClassName"] == f"mig.{DRIVER}"
    assert "capacity" not in exact  # a placement is allocated whole
    at_least = f'device.capacity["{DRIVER}"].memory.compareTo(quantity("8000Mi")) >= 0'
    assert exact["selectors"] == [{"cel": {"expression": at_least}}]


def test_several_modes_are_tried_in_the_order_written() -> None:
    pod = hami_pod(
        gpu_container("main", mem=4000), annotations={"nvidia.com/vgpu-mode": "mig,hami-core"}
    )
    _, per, _ = claims(pod)
    first = per["main"]["request"]["firstAvailable"]
    assert [(s["name"], s["deviceClassName"]) for s in first] == [
        ("mig", f"mig.{DRIVER}"),
        ("shared", DRIVER),
    ]
    assert first[1]["capacity"] == {"requests": {"memory": "4000Mi"}}


def test_the_clusters_default_memory_and_cores_apply() -> None:
    config = SchedulingConfig(default_memory_mib=1024, default_cores=10)
    pod = hami_pod(container("main", limits={"nvidia.com/gpu": "1"}))
    t = translated(pod, config)
    (template,) = t.templates
    exact = template.spec["spec"]["devices"]["requests"][0]["exactly"]
    assert exact["capacity"] == {"requests": {"memory": "1024Mi", "compute": "10"}}


@pytest.mark.parametrize(
    ("annotations", "limits", "field", "needle"),
    [
        ({"hami.io/gpu-scheduler-policy": "binpack,mutex"}, {},
         "metadata.annotations.hami.io/gpu-scheduler-policy", "mutex"),
        ({"tessera.io/memory-oversubscription": "true"}, {},
         "metadata.annotations.tessera.io/memory-oversubscription", "virtual device memory"),
        ({}, {"nvidia.com/priority": "0"},
         "spec.containers[0].resources.limits.nvidia.com/priority", "task priority"),
    ],
)  # fmt: skip
def test_what_a_claim_cannot_carry_is_refused(annotations, limits, field, needle) -> None:
    c = gpu_container("main", mem=1000)
    c["resources"]["limits"].update(limits)
    with pytest.raises(RequestError) as err:
        translated(hami_pod(c, annotations=annotations))
    assert err.value.field == field and needle in err.value.message


def test_nvidia_mig_profile_resources_are_refused() -> None:
    config = SchedulingConfig(mig_resources=True)
    pod = hami_pod(container("main", limits={"nvidia.com/mig-3g.40gb": "1"}))
    with pytest.raises(RequestError) as err:
        translated(pod, config)
    assert "extender mode only" in err.value.message


def test_placement_preferences_are_accepted_with_a_warning() -> None:
    pod = hami_pod(
        gpu_container("main", mem=1000),
        annotations={
            "hami.io/node-scheduler-policy": "spread",
            "hami.io/gpu-scheduler-policy": "binpack",
        },
    )
    t = translated(pod)
    assert len(t.warnings) == 2
    assert all("not applied in DRA mode" in w for w in t.warnings)
    assert "hami.io/node-scheduler-policy='spread'" in t.warnings[0]


def test_one_claim_per_container_init_containers_included() -> None:
    pod = pod_json(
        "p",
        "team",
        containers=[gpu_container("app", mem=10240), gpu_container("side", mem=512)],
        init_containers=[gpu_container("load", mem=20480)],
    )
    patched, per, t = claims(pod)
    assert set(per) == {"load", "app", "side"}
    names = [e["name"] for e in patched["spec"]["resourceClaims"]]
    assert names == ["tessera-gpu-init-0", "tessera-gpu-0", "tessera-gpu-1"]
    assert len(t.templates) == 3
    assert any("init container" in w for w in t.warnings)


def test_the_template_name_is_the_shape_not_the_pod() -> None:
    one = translated(pod_json("a", "x", containers=[gpu_container("main", mem=4096, cores=30)]))
    two = translated(pod_json("b", "y", containers=[gpu_container("main", mem=4096, cores=30)]))
    other = translated(pod_json("a", "x", containers=[gpu_container("main", mem=4096, cores=31)]))
    assert one.templates == two.templates
    assert one.templates[0].name != other.templates[0].name
    assert one.templates[0].name.startswith(dt.TEMPLATE_PREFIX)
    assert len(one.templates[0].name) <= 63


def test_claims_the_pod_already_names_are_kept() -> None:
    pod = hami_pod(gpu_container("main", mem=1000))
    pod["spec"]["resourceClaims"] = [{"name": "nic", "resourceClaimName": "rdma"}]
    pod["spec"]["containers"][0]["resources"]["claims"] = [{"name": "nic"}]
    patched, _, _ = claims(pod)
    assert [e["name"] for e in patched["spec"]["resourceClaims"]] == ["nic", "tessera-gpu-0"]
    assert patched["spec"]["containers"][0]["resources"]["claims"] == [
        {"name": "nic"},
        {"name": "tessera-gpu-0", "request": "main"},
    ]
    pod["spec"]["resourceClaims"].append({"name": "tessera-gpu-0", "resourceClaimName": "x"})
    with pytest.raises(RequestError) as err:
        translated(pod)
    assert err.value.field == "spec.resourceClaims"


def test_a_stored_template_compares_equal_as_the_api_server_writes_it_back() -> None:
    (template,) = translated(hami_pod(gpu_container("main", mem=4096, cores=30))).templates
    stored = copy.deepcopy(template.spec)
    exact = stored["spec"]["devices"]["requests"][0]["exactly"]
    exact["capacity"]["requests"]["memory"] = "4Gi"  # the canonical form of 4096Mi
    assert dt.same_spec(stored, template.spec)
    del exact["allocationMode"], exact["count"]  # defaults the API server fills in
    assert dt.same_spec(stored, template.spec)


@pytest.mark.parametrize(
    "forge",
    [
        lambda e: e.update(adminAccess=True),
        lambda e: e.update(tolerations=[{"key": "gpu.tessera.io/unhealthy", "operator": "Exists"}]),
        lambda e: e.update(deviceClassName="other.example.com"),
        lambda e: e.pop("selectors"),
        lambda e: e["capacity"]["requests"].update(memory="1Mi"),
        lambda e: e.update(count=2),
    ],
)
def test_a_template_with_another_spec_is_not_the_same(forge) -> None:
    (template,) = translated(hami_pod(gpu_container("main", mem=4096, cores=30))).templates
    forged = copy.deepcopy(template.spec)
    forge(forged["spec"]["devices"]["requests"][0]["exactly"])
    assert not dt.same_spec(forged, template.spec)
