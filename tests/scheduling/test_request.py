"""parse_pod: Kubernetes Pod JSON -> PodRequest, and every way it refuses bad input."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.scheduling import (
    ContainerRequest,
    PodRequest,
    RequestError,
    ResourceNames,
    SchedulingConfig,
    parse_pod,
)
from tests.pods import container as k8s_container
from tests.scheduling.builders import container, pod, pod_json

GPU = "nvidia.com/gpu"
MEM = "nvidia.com/gpumem"
PCT = "nvidia.com/gpumem-percentage"
CORES = "nvidia.com/gpucores"
PRIORITY = "nvidia.com/priority"


def only(request: PodRequest | None) -> ContainerRequest:
    assert request is not None
    assert len(request.containers) == 1
    return request.containers[0]


# ------------------------------------------------------------------ resources


def test_full_ask_from_limits() -> None:
    req = parse_pod(pod_json(k8s_container(limits={GPU: 2, MEM: "3000", CORES: "30"})))
    assert req is not None
    assert (req.uid, req.namespace, req.name) == ("4f1c", "ml", "trainer")
    assert req.containers == (
        ContainerRequest(
            name="main",
            index=0,
            init=False,
            gpus=2,
            memory_mib=3000,
            memory_percent=None,
            cores=30,
        ),
    )


def test_limits_win_over_requests_per_resource() -> None:
    c = only(
        parse_pod(
            pod_json(
                k8s_container(
                    limits={GPU: 1, MEM: 2000},
                    requests={GPU: 1, MEM: 9999, CORES: 40},
                )
            )
        )
    )
    # gpumem from limits, gpucores only in requests: each resource falls back on its own.
    assert (c.memory_mib, c.cores) == (2000, 40)


def test_requests_alone_are_read() -> None:
    c = only(parse_pod(pod_json(k8s_container(requests={GPU: "1", MEM: "1k"}))))
    assert (c.gpus, c.memory_mib) == (1, 1000)


@pytest.mark.parametrize(
    ("value", "mib"),
    [("4096", 4096), (4096, 4096), ("4k", 4000), ("4Ki", 4096), ("4e3", 4000), ("1000m", 1)],
)
def test_gpumem_takes_quantity_forms(value: object, mib: int) -> None:
    assert only(parse_pod(pod_json(k8s_container(limits={MEM: value})))).memory_mib == mib


@pytest.mark.parametrize("resource", [MEM, PCT, CORES])
def test_other_resources_without_gpu_mean_one_gpu(resource: str) -> None:
    assert only(parse_pod(pod_json(k8s_container(limits={resource: "10"})))).gpus == 1


def test_percentage_is_kept_when_gpumem_is_absent() -> None:
    c = only(parse_pod(pod_json(k8s_container(limits={GPU: 1, PCT: 25}))))
    assert (c.memory_mib, c.memory_percent) == (None, 25)


def test_gpumem_wins_over_percentage() -> None:
    c = only(parse_pod(pod_json(k8s_container(limits={GPU: 1, PCT: 25, MEM: 512}))))
    assert (c.memory_mib, c.memory_percent) == (512, None)


def test_only_gpu_means_whole_card_by_default() -> None:
    c = only(parse_pod(pod_json(k8s_container(limits={GPU: 1}))))
    assert (c.memory_mib, c.memory_percent, c.cores) == (None, None, 0)
    assert c.memory_on(40960) == 40960


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (SchedulingConfig(default_memory_mib=2048), (2048, None, 0)),
        (SchedulingConfig(default_memory_percent=50), (None, 50, 0)),
        (SchedulingConfig(default_memory_mib=2048, default_memory_percent=50), (2048, None, 0)),
        (SchedulingConfig(default_cores=20), (None, None, 20)),
    ],
)
def test_config_defaults_fill_missing_asks(
    config: SchedulingConfig, expected: tuple[int | None, int | None, int]
) -> None:
    c = only(parse_pod(pod_json(k8s_container(limits={GPU: 1})), config))
    assert (c.memory_mib, c.memory_percent, c.cores) == expected


def test_explicit_values_beat_config_defaults() -> None:
    config = SchedulingConfig(default_memory_mib=2048, default_cores=20)
    c = only(parse_pod(pod_json(k8s_container(limits={GPU: 1, MEM: 100, CORES: 0})), config))
    assert (c.memory_mib, c.cores) == (100, 0)


def test_custom_resource_names() -> None:
    names = ResourceNames(
        gpu="example.com/vgpu",
        gpumem="example.com/vmem",
        gpumem_percentage="example.com/vmem-pct",
        gpucores="example.com/vcores",
    )
    config = SchedulingConfig(resources=names)
    raw = pod_json(k8s_container(limits={"example.com/vgpu": 2, "example.com/vmem": 10}))
    c = only(parse_pod(raw, config))
    assert (c.gpus, c.memory_mib) == (2, 10)
    # The HAMi names mean nothing under this configuration.
    assert parse_pod(pod_json(k8s_container(limits={GPU: 1})), config) is None


def test_no_managed_resource_gives_none() -> None:
    assert parse_pod(pod_json(k8s_container(limits={"cpu": "1", "memory": "1Gi"}))) is None
    assert parse_pod(pod_json(k8s_container())) is None
    assert parse_pod({"metadata": {}, "spec": {}}) is None


def test_gpu_zero_alone_asks_for_nothing() -> None:
    assert parse_pod(pod_json(k8s_container(limits={GPU: 0}))) is None


def test_only_gpu_containers_are_listed_with_their_spec_index() -> None:
    req = parse_pod(
        pod_json(
            k8s_container("sidecar-log"),
            k8s_container("train", limits={GPU: 1}),
            k8s_container("eval", limits={MEM: 100}),
        )
    )
    assert req is not None
    assert [(c.name, c.index, c.init) for c in req.containers] == [
        ("train", 1, False),
        ("eval", 2, False),
    ]


def test_init_containers_come_first_flagged_init() -> None:
    req = parse_pod(
        pod_json(
            k8s_container("train", limits={GPU: 1}),
            init=(k8s_container("warmup", limits={MEM: 100}), k8s_container("fetch")),
        )
    )
    assert req is not None
    assert [(c.name, c.index, c.init) for c in req.containers] == [
        ("warmup", 0, True),
        ("train", 0, False),
    ]


def test_gpu_init_container_without_app_gpu_container() -> None:
    req = parse_pod(pod_json(k8s_container("app"), init=(k8s_container("w", limits={GPU: 1}),)))
    assert req is not None
    assert [c.init for c in req.containers] == [True]


def test_missing_metadata_fields_get_safe_values() -> None:
    raw: dict[str, Any] = {
        "metadata": {"generateName": "job-"},
        "spec": {"containers": [k8s_container(limits={GPU: 1})]},
    }
    req = parse_pod(raw)
    assert req is not None
    # An admission request for a new pod has no uid yet and may only have generateName.
    assert (req.uid, req.namespace, req.name) == ("", "default", "job-")


# ---------------------------------------------------------------- annotations


def test_type_and_uuid_annotations_are_split_trimmed_lowered() -> None:
    req = parse_pod(
        pod_json(
            k8s_container(limits={GPU: 1}),
            annotations={
                "nvidia.com/use-gputype": " A100, ,H100 ,a100",
                "nvidia.com/nouse-gputype": "MIG",
                "nvidia.com/use-gpuuuid": "GPU-AAA,gpu-bbb",
                "nvidia.com/nouse-gpuuuid": " GPU-CCC ",
            },
        )
    )
    assert req is not None
    assert req.use_types == ("a100", "h100")
    assert req.nouse_types == ("mig",)
    assert req.use_uuids == ("gpu-aaa", "gpu-bbb")
    assert req.nouse_uuids == ("gpu-ccc",)


@pytest.mark.parametrize(
    ("annotations", "node_policy", "gpu_policy"),
    [
        ({}, "binpack", "spread"),
        ({"tessera.io/node-policy": "spread"}, "spread", "spread"),
        ({"tessera.io/gpu-policy": "Binpack "}, "binpack", "binpack"),
        ({"hami.io/node-scheduler-policy": "spread"}, "spread", "spread"),
        ({"hami.io/gpu-scheduler-policy": "binpack"}, "binpack", "binpack"),
        (
            {"tessera.io/node-policy": "binpack", "hami.io/node-scheduler-policy": "spread"},
            "binpack",
            "spread",
        ),
        (
            {"tessera.io/gpu-policy": "spread", "hami.io/gpu-scheduler-policy": "binpack"},
            "binpack",
            "spread",
        ),
    ],
)
def test_policy_annotations_and_hami_aliases(
    annotations: dict[str, str], node_policy: str, gpu_policy: str
) -> None:
    req = parse_pod(pod_json(k8s_container(limits={GPU: 1}), annotations=annotations))
    assert req is not None
    assert (req.node_policy, req.gpu_policy) == (node_policy, gpu_policy)


def test_policy_defaults_come_from_config() -> None:
    config = SchedulingConfig(default_node_policy="spread", default_gpu_policy="binpack")
    req = parse_pod(pod_json(k8s_container(limits={GPU: 1})), config)
    assert req is not None
    assert (req.node_policy, req.gpu_policy) == ("spread", "binpack")


# ------------------------------------------------------------------ refusals

C0 = "spec.containers[0]"


@pytest.mark.parametrize(
    ("raw", "field", "fragment"),
    [
        (
            pod_json(k8s_container(limits={GPU: "1.5"})),
            f"{C0}.resources.limits.{GPU}",
            "whole number",
        ),
        (
            pod_json(k8s_container(requests={MEM: "-100"})),
            f"{C0}.resources.requests.{MEM}",
            "negative",
        ),
        (
            pod_json(k8s_container(limits={CORES: "lots"})),
            f"{C0}.resources.limits.{CORES}",
            "not a Kubernetes quantity",
        ),
        (pod_json(k8s_container(limits={GPU: 65})), f"{C0}.resources.limits.{GPU}", "at most 64"),
        (
            pod_json(k8s_container(limits={GPU: 0, MEM: 100})),
            f"{C0}.resources.limits.{GPU}",
            "at least 1 GPU",
        ),
        (pod_json(k8s_container(limits={MEM: 0})), f"{C0}.resources.limits.{MEM}", "at least 1"),
        (
            pod_json(k8s_container(limits={MEM: "1Gi"})),
            f"{C0}.resources.limits.{MEM}",
            "write 1024 for 1 GiB",
        ),
        (pod_json(k8s_container(limits={PCT: 101})), f"{C0}.resources.limits.{PCT}", "0 to 100"),
        (
            pod_json(k8s_container(limits={CORES: 101})),
            f"{C0}.resources.limits.{CORES}",
            "0 to 100",
        ),
        (
            pod_json(k8s_container(limits={GPU: True})),
            f"{C0}.resources.limits.{GPU}",
            "boolean",
        ),
        (
            pod_json(
                k8s_container(limits={GPU: 1}),
                annotations={"tessera.io/node-policy": "random"},
            ),
            "metadata.annotations.tessera.io/node-policy",
            "'binpack' or 'spread'",
        ),
        (
            pod_json(
                k8s_container(limits={GPU: 1}),
                annotations={"hami.io/gpu-scheduler-policy": "binpack,fastest"},
            ),
            "metadata.annotations.hami.io/gpu-scheduler-policy",
            "'fastest' is not a GPU policy; use one of binpack, spread, numa, mutex, "
            "topology-aware",
        ),
        (
            pod_json(k8s_container(limits={GPU: 1}), annotations={"tessera.io/gpu-policy": " , "}),
            "metadata.annotations.tessera.io/gpu-policy",
            "names no policy",
        ),
        (
            pod_json(k8s_container(limits={GPU: 1}), annotations={"nvidia.com/numa-bind": "yes"}),
            "metadata.annotations.nvidia.com/numa-bind",
            "'true' or 'false'",
        ),
        (
            pod_json(k8s_container(limits={GPU: 1}), annotations={"nvidia.com/vgpu-mode": "vgpu"}),
            "metadata.annotations.nvidia.com/vgpu-mode",
            "among hami-core, mig, mps",
        ),
        (
            pod_json(k8s_container(limits={GPU: 1}), annotations={"nvidia.com/vgpu-mode": ""}),
            "metadata.annotations.nvidia.com/vgpu-mode",
            "among hami-core, mig, mps",
        ),
        (
            pod_json(k8s_container(limits={GPU: 1, PRIORITY: 2})),
            f"{C0}.resources.limits.{PRIORITY}",
            "0 (high) or 1 (low), got 2",
        ),
        (
            pod_json(k8s_container(limits={MEM: 100}, requests={PRIORITY: "5"})),
            f"{C0}.resources.requests.{PRIORITY}",
            "0 (high) or 1 (low), got 5",
        ),
        (
            pod_json(k8s_container(limits={GPU: 1, PRIORITY: "high"})),
            f"{C0}.resources.limits.{PRIORITY}",
            "not a Kubernetes quantity",
        ),
        (
            pod_json(
                k8s_container(limits={GPU: 1}),
                annotations={"nvidia.com/use-gputype": 5},
            ),
            "metadata.annotations.nvidia.com/use-gputype",
            "string",
        ),
        (
            pod_json({"image": "x", "resources": {"limits": {GPU: 1}}}),
            f"{C0}.name",
            "needs a name",
        ),
        (pod_json(k8s_container(limits=[GPU])), f"{C0}.resources.limits", "object"),  # type: ignore[arg-type]
        ({"spec": {"containers": "main"}}, "spec.containers", "list"),
        ({"spec": {"containers": ["main"]}}, C0, "object"),
        ({"spec": []}, "spec", "object"),
        ({"metadata": {"annotations": []}, "spec": {}}, "metadata.annotations", "object"),
        ("a pod", "", "JSON object"),
    ],
)
def test_bad_input_names_the_field(raw: Any, field: str, fragment: str) -> None:
    with pytest.raises(RequestError) as caught:
        parse_pod(raw)
    assert caught.value.field == field
    assert fragment in caught.value.message
    assert str(caught.value).startswith(field)


def test_error_on_second_container_names_its_index() -> None:
    raw = pod_json(k8s_container("a", limits={GPU: 1}), k8s_container("b", limits={GPU: "x"}))
    with pytest.raises(RequestError) as caught:
        parse_pod(raw)
    assert caught.value.field == f"spec.containers[1].resources.limits.{GPU}"


def test_absurd_memory_is_refused() -> None:
    raw = pod_json(k8s_container(limits={MEM: 16 * 1024 * 1024 + 1}))
    with pytest.raises(RequestError, match="16 TiB"):
        parse_pod(raw)
    assert only(parse_pod(pod_json(k8s_container(limits={MEM: 16 * 1024 * 1024})))).memory_mib


# ------------------------------------------------------------- round trip


def test_to_dict_from_dict_round_trip() -> None:
    req = pod(
        container("w", init=True, gpus=1, memory_mib=None, memory_percent=30, cores=100),
        container("m", gpus=2, memory_mib=5000, cores=20, index=3),
        use_types=("a100",),
        nouse_uuids=("gpu-x",),
        node_policy="spread",
        gpu_policy="binpack",
    )
    data = req.to_dict()
    import json

    assert PodRequest.from_dict(json.loads(json.dumps(data))) == req


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.pop("containers"), "containers"),
        (lambda d: d["containers"][0].update(gpus="2"), "containers[0].gpus"),
        (lambda d: d["containers"][0].update(init=1), "containers[0].init"),
        (lambda d: d["containers"][0].update(gpus=0), "containers[0]"),
        (lambda d: d["containers"][0].update(memory_mib=True), "containers[0].memory_mib"),
        (lambda d: d.update(use_types="a100"), "use_types"),
        (lambda d: d.update(node_policy="fast"), ""),
        (lambda d: d.update(containers=[]), ""),
    ],
)
def test_from_dict_refuses_malformed_records(mutate: Any, field: str) -> None:
    data = pod(container()).to_dict()
    mutate(data)
    with pytest.raises(RequestError) as caught:
        PodRequest.from_dict(data)
    assert caught.value.field == field


@pytest.mark.parametrize(
    "kwargs",
    [
        {"default_memory_mib": 0},
        {"default_memory_percent": 101},
        {"default_cores": -1},
        {"default_node_policy": "fast"},
        {"default_gpu_policy": ""},
    ],
)
def test_bad_config_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SchedulingConfig(**kwargs)


def test_resource_names_must_be_distinct() -> None:
    with pytest.raises(ValueError, match="distinct"):
        ResourceNames(gpumem="nvidia.com/gpu")


# ------------------------------------------------------- HAMi's other asks


@pytest.mark.parametrize("where", ["limits", "requests"])
def test_zero_memory_percentage_means_the_whole_card(where: str) -> None:
    # HAMi accepts gpumem-percentage 0 and books the whole card (device.go, the percentage
    # is ignored when not positive); 101 is still refused.
    c = only(parse_pod(pod_json(k8s_container(**{where: {GPU: 1, PCT: 0}}))))
    assert (c.memory_mib, c.memory_percent, c.cores) == (None, None, 0)
    assert c.memory_on(81920) == 81920


def test_zero_memory_percentage_takes_the_configured_default() -> None:
    config = SchedulingConfig(default_memory_mib=2048)
    c = only(parse_pod(pod_json(k8s_container(limits={GPU: 1, PCT: "0"})), config))
    assert (c.memory_mib, c.memory_percent) == (2048, None)


@pytest.mark.parametrize(
    ("value", "chain"),
    [
        ("mutex", "mutex,spread"),
        ("Mutex", "mutex,spread"),
        ("binpack,numa", "binpack,numa"),
        ("numa, binpack", "numa,binpack"),
        ("numa", "numa,spread"),
        ("topology-aware", "topology-aware,spread"),
        ("mutex,topology-aware", "mutex,topology-aware,spread"),
        ("binpack,binpack,mutex,", "binpack,mutex"),
        # binpack and spread both: the first named orders; the second could only break ties
        # the first already broke (HAMi's chain compares the same score twice).
        ("spread,numa,binpack", "spread,numa"),
    ],
)
def test_gpu_policy_chains_read_like_hami(value: str, chain: str) -> None:
    req = parse_pod(
        pod_json(
            k8s_container(limits={GPU: 1}), annotations={"hami.io/gpu-scheduler-policy": value}
        )
    )
    assert req is not None and req.gpu_policy == chain


def test_a_gpu_policy_without_binpack_or_spread_takes_the_configured_one() -> None:
    config = SchedulingConfig(default_gpu_policy="binpack")
    raw = pod_json(k8s_container(limits={GPU: 1}), annotations={"tessera.io/gpu-policy": "mutex"})
    req = parse_pod(raw, config)
    assert req is not None and req.gpu_policy == "mutex,binpack"


@pytest.mark.parametrize(
    ("value", "bound"), [("true", True), ("True", True), ("1", True), ("t", True),
                         ("false", False), ("0", False), ("F", False)]
)  # fmt: skip
def test_numa_bind_reads_go_booleans(value: str, bound: bool) -> None:
    raw = pod_json(k8s_container(limits={GPU: 2}), annotations={"nvidia.com/numa-bind": value})
    req = parse_pod(raw)
    assert req is not None and req.numa_bind is bound


@pytest.mark.parametrize(
    ("value", "modes"),
    [("mig", ("mig",)), ("hami-core", ("hami-core",)), (" MIG, hami-core", ("mig", "hami-core"))],
)
def test_vgpu_mode_is_a_pod_annotation(value: str, modes: tuple[str, ...]) -> None:
    raw = pod_json(
        k8s_container(limits={GPU: 2, MEM: 8000}), annotations={"nvidia.com/vgpu-mode": value}
    )
    req = parse_pod(raw)
    assert req is not None and req.vgpu_modes == modes


def test_priority_is_read_per_container_limits_then_requests() -> None:
    req = parse_pod(
        pod_json(
            k8s_container("a", limits={GPU: 1, PRIORITY: 0}),
            k8s_container("b", limits={GPU: 1}, requests={PRIORITY: "1"}),
            k8s_container("c", limits={GPU: 1, PRIORITY: 1}, requests={PRIORITY: 0}),
            k8s_container("d", limits={GPU: 1}),
        )
    )
    assert req is not None
    assert [c.priority for c in req.containers] == [0, 1, 1, None]


def test_a_container_asking_only_priority_gets_no_gpu() -> None:
    # HAMi's webhook only passes the priority on as an environment variable; without a GPU
    # resource the container is no GPU container and the pod is not HAMi's to schedule.
    assert parse_pod(pod_json(k8s_container(limits={PRIORITY: 0}))) is None
    assert parse_pod(pod_json(k8s_container(limits={GPU: 0, PRIORITY: 1}))) is None
    req = parse_pod(
        pod_json(k8s_container("p", limits={PRIORITY: 5}), k8s_container("g", limits={GPU: 1}))
    )
    assert req is not None and [c.name for c in req.containers] == ["g"]


def test_custom_priority_resource_name() -> None:
    names = ResourceNames(priority="example.com/prio")
    assert names.all()[-1] == "example.com/prio" and len(names.all()) == 5
    config = SchedulingConfig(resources=names)
    raw = pod_json(k8s_container(limits={GPU: 1, "example.com/prio": 1, PRIORITY: 7}))
    assert only(parse_pod(raw, config)).priority == 1
    with pytest.raises(ValueError, match="distinct"):
        ResourceNames(priority="nvidia.com/gpucores")


def test_restartable_init_containers_are_sidecars() -> None:
    req = parse_pod(
        pod_json(
            k8s_container("app", limits={GPU: 1}, restartPolicy="Always"),
            init=(
                k8s_container("fetch", limits={MEM: 100}),
                k8s_container("proxy", limits={GPU: 1, MEM: 500}, restartPolicy="Always"),
            ),
        )
    )
    assert req is not None
    assert [(c.name, c.index, c.init, c.sidecar) for c in req.containers] == [
        ("fetch", 0, True, False),
        ("proxy", 1, True, True),
        ("app", 0, False, False),  # restartPolicy on an app container is no sidecar
    ]


def test_the_peak_counts_sidecars_beside_later_containers() -> None:
    req = pod(
        container("early", init=True, index=0, memory_mib=9000),  # before the sidecar: alone
        container("side", init=True, index=1, memory_mib=1000, sidecar=True),
        container("late", init=True, index=2, memory_mib=7000),  # 7000 + 1000
        container("app", memory_mib=2000, gpus=2),
    )
    assert req.peak(lambda c: c.gpus * (c.memory_mib or 0)) == 9000
    assert req.peak(lambda c: c.gpus) == 3  # the app's two slices beside the sidecar's one
    no_early = pod(*req.containers[1:])
    assert no_early.peak(lambda c: c.gpus * (c.memory_mib or 0)) == 8000


def test_new_fields_round_trip_and_old_records_still_load() -> None:
    req = pod(
        container("side", init=True, sidecar=True, priority=0),
        container("m", priority=1),
        gpu_policy="numa,binpack,mutex",
        numa_bind=True,
        vgpu_modes=("hami-core",),
    )
    import json

    assert PodRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req
    old = pod(container("m")).to_dict()
    for key in ("numa_bind", "vgpu_modes"):
        del old[key]
    for c in old["containers"]:
        del c["sidecar"], c["priority"]
    loaded = PodRequest.from_dict(old)
    assert loaded == pod(container("m"))
    assert (loaded.containers[0].sidecar, loaded.containers[0].priority) == (False, None)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["containers"][0].update(priority=2), "containers[0]"),
        (lambda d: d["containers"][0].update(priority="0"), "containers[0].priority"),
        (lambda d: d["containers"][0].update(sidecar=1), "containers[0].sidecar"),
        (lambda d: d["containers"][0].update(sidecar=True), "containers[0]"),  # not an init
        (lambda d: d.update(numa_bind="yes"), "numa_bind"),
        (lambda d: d.update(vgpu_modes=["vgpu"]), ""),
        (lambda d: d.update(gpu_policy="mutex"), ""),  # not canonical: no binpack/spread
    ],
)
def test_from_dict_refuses_malformed_new_fields(mutate: Any, field: str) -> None:
    data = pod(container()).to_dict()
    mutate(data)
    with pytest.raises(RequestError) as caught:
        PodRequest.from_dict(data)
    assert caught.value.field == field


def test_the_pods_priority_and_preemption_policy_are_read_and_kept() -> None:
    raw = pod_json(k8s_container(limits={"nvidia.com/gpu": 1}))
    raw["spec"]["priority"] = 1000
    raw["spec"]["preemptionPolicy"] = "Never"
    request = parse_pod(raw)
    assert request is not None
    assert (request.pod_priority, request.preempt_never) == (1000, True)
    assert PodRequest.from_dict(request.to_dict()) == request
    # A request stored before these fields existed reads as priority 0, may preempt.
    old = {k: v for k, v in request.to_dict().items() if k not in ("pod_priority", "preempt_never")}
    assert (PodRequest.from_dict(old).pod_priority, PodRequest.from_dict(old).preempt_never) == (
        0,
        False,
    )


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("priority", "high"),
        ("priority", 1 << 40),
        ("priority", True),
        ("preemptionPolicy", "Later"),
    ],
)
def test_a_malformed_priority_or_policy_names_the_field(key: str, value: Any) -> None:
    raw = pod_json(k8s_container(limits={"nvidia.com/gpu": 1}))
    raw["spec"][key] = value
    with pytest.raises(RequestError) as caught:
        parse_pod(raw)
    assert f"spec.{key}" in str(caught.value)
