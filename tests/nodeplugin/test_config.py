from __future__ import annotations

from pathlib import Path

import pytest

from nodeplugin import config

BASE = {"TESSERA_NODE_NAME": "n1", "TESSERA_CONTROLPLANE_URL": "http://cp:8000/"}


def test_defaults() -> None:
    s = config.load(BASE)
    assert s.node_name == "n1" and s.controlplane_url == "http://cp:8000"
    assert s.resource_name == "nvidia.com/gpu" and s.slots == 10
    assert s.kubelet_socket_path == Path("/var/lib/kubelet/device-plugins/kubelet.sock")
    assert s.pod_resources_socket == Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    assert s.cdi_dir == Path("/var/run/cdi") and s.device_mode == "cdi"
    assert s.allocation_source == "controlplane"
    assert 13 in s.ignored_xids and 79 not in s.ignored_xids
    assert (s.priority_poll_s, s.priority_busy_s) == (0.1, 1.0)


def test_overrides() -> None:
    s = config.load(
        {
            **BASE,
            "TESSERA_RESOURCE_GPU": "tessera.io/gpu",
            "TESSERA_SLOTS": "4",
            "TESSERA_DEVICE_MODE": "paths",
            "TESSERA_IGNORED_XIDS": "13, 43",
            "TESSERA_CDI_ANNOTATION": "true",
        }
    )
    assert (s.resource_name, s.slots, s.device_mode) == ("tessera.io/gpu", 4, "paths")
    assert s.ignored_xids == frozenset({13, 43}) and s.cdi_annotation


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"TESSERA_CONTROLPLANE_URL": ""}, "TESSERA_CONTROLPLANE_URL is not set"),
        ({"TESSERA_CONTROLPLANE_URL": "cp:8000"}, "must start with http"),
        ({"TESSERA_RESOURCE_GPU": "gpu"}, "domain-prefixed"),
        ({"TESSERA_RESOURCE_GPU": "kubernetes.io/gpu"}, "outside kubernetes.io"),
        ({"TESSERA_SLOTS": "zero"}, "TESSERA_SLOTS='zero' is not a whole number"),
        ({"TESSERA_SLOTS": "0"}, "out of range"),
        ({"TESSERA_DEVICE_MODE": "magic"}, "TESSERA_DEVICE_MODE='magic' is not one of cdi, paths"),
        ({"TESSERA_CDI_DIR": "relative/cdi"}, "must be an absolute path"),
        ({"TESSERA_PLUGIN_SOCKET": "a/b.sock"}, "bare file name"),
        ({"TESSERA_ALLOCATION_SOURCE": "annotation"}, "needs TESSERA_ALLOCATION_KEY_FILE"),
        (
            {"TESSERA_ALLOCATION_SOURCE": "annotation", "TESSERA_ALLOCATION_KEY": "k" * 32},
            "needs the API server",
        ),
        (
            {"TESSERA_ALLOCATION_FALLBACK": "true"},
            "TESSERA_ALLOCATION_FALLBACK=true needs TESSERA_ALLOCATION_KEY_FILE",
        ),
        (
            {"TESSERA_ALLOCATION_FALLBACK": "true", "TESSERA_ALLOCATION_KEY": "k" * 32},
            "TESSERA_ALLOCATION_FALLBACK=true needs the API server",
        ),
        ({"TESSERA_ALLOCATION_FALLBACK": "sometimes"}, "not a boolean"),
        ({"TESSERA_CONTROLPLANE_WAIT_S": "60"}, "TESSERA_CONTROLPLANE_WAIT_S=60.0 is out of range"),
        ({"TESSERA_ALLOCATION_KEY": "k" * 31}, "holds 31 bytes; it needs at least 32"),
        ({"TESSERA_ALLOCATION_KEY_FILE": "/nonexistent/key"}, "cannot be read"),
        ({"TESSERA_IGNORED_XIDS": "13,x"}, "comma list"),
        ({"TESSERA_PRESTART_TIMEOUT_S": "40"}, "out of range"),
        ({"TESSERA_CDI_ANNOTATION": "maybe"}, "not a boolean"),
        # a poll over 1 s would give leases longer than the shim honours (10 s)
        ({"TESSERA_PRIORITY_POLL_S": "2"}, "TESSERA_PRIORITY_POLL_S=2.0 is out of range"),
        ({"TESSERA_PRIORITY_BUSY_S": "soon"}, "TESSERA_PRIORITY_BUSY_S='soon' is not a number"),
        ({"TESSERA_METRICS_INTERVAL_S": "10s"}, "TESSERA_METRICS_INTERVAL_S='10s' is not a number"),
        ({"TESSERA_METRICS_INTERVAL_S": "0"}, "TESSERA_METRICS_INTERVAL_S=0.0 is out of range"),
    ],
)
def test_bad_settings_name_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load({**BASE, **env})
    assert message in str(err.value)


def test_annotation_mode_from_the_cluster_environment(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("x" * 32 + "\n")
    s = config.load(
        {
            **BASE,
            "TESSERA_ALLOCATION_SOURCE": "annotation",
            "TESSERA_ALLOCATION_KEY_FILE": str(key),
            "KUBERNETES_SERVICE_HOST": "10.0.0.1",
            "KUBERNETES_SERVICE_PORT": "6443",
        }
    )
    assert s.allocation_key == b"x" * 32
    assert s.kube_api_url == "https://10.0.0.1:6443"


def test_the_fallback_to_the_signed_annotation_from_the_cluster_environment(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("x" * 32 + "\n")
    cluster = {"KUBERNETES_SERVICE_HOST": "10.0.0.1", "KUBERNETES_SERVICE_PORT": "6443"}
    s = config.load(
        {**BASE, **cluster, "TESSERA_ALLOCATION_FALLBACK": "true",
         "TESSERA_ALLOCATION_KEY_FILE": str(key)}
    )  # fmt: skip
    assert s.allocation_source == "controlplane" and s.allocation_fallback
    assert s.controlplane_wait_s == 5.0
    assert not config.load({**BASE, **cluster}).allocation_fallback
