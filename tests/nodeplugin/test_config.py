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


def proc_with_memory(tmp_path: Path, kib: int) -> dict[str, str]:
    (tmp_path / "meminfo").write_text(f"MemTotal:       {kib} kB\nMemFree:        1024 kB\n")
    return {"TESSERA_PROC_ROOT": str(tmp_path)}


def test_virtual_memory_is_off_by_default(tmp_path: Path) -> None:
    s = config.load({**BASE, **proc_with_memory(tmp_path, 64 * 1024 * 1024)})
    assert (s.memory_oversubscription, s.spill_reserve_mib, s.host_memory_mib) == ("1", 0, 65536)


@pytest.mark.parametrize(
    ("raw", "want"), [("1.5", "1.5"), ("1.50", "1.5"), ("2", "2"), ("2.0", "2"), ("16", "16")]
)
def test_the_factor_and_reserve_are_read(tmp_path: Path, raw: str, want: str) -> None:
    s = config.load(
        {
            **BASE,
            **proc_with_memory(tmp_path, 64 * 1024 * 1024),
            "TESSERA_MEMORY_OVERSUBSCRIPTION": raw,
            "TESSERA_SPILL_RESERVE_MIB": "16384",
        }
    )
    assert (s.memory_oversubscription, s.spill_reserve_mib) == (want, 16384)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("0.5", "TESSERA_MEMORY_OVERSUBSCRIPTION='0.5' is out of range: use 1 to 16"),
        ("-2", "TESSERA_MEMORY_OVERSUBSCRIPTION='-2' is out of range: use 1 to 16"),
        ("17", "TESSERA_MEMORY_OVERSUBSCRIPTION='17' is out of range: use 1 to 16"),
        ("double", "TESSERA_MEMORY_OVERSUBSCRIPTION='double' is not a decimal number"),
        ("1,5", "TESSERA_MEMORY_OVERSUBSCRIPTION='1,5' is not a decimal number"),
        ("1e1", "TESSERA_MEMORY_OVERSUBSCRIPTION='1e1' is not a decimal number"),
        ("1.255", "TESSERA_MEMORY_OVERSUBSCRIPTION='1.255' has more than two decimal places"),
    ],
)
def test_a_bad_factor_stops_the_plugin_naming_it(raw: str, message: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load({**BASE, "TESSERA_MEMORY_OVERSUBSCRIPTION": raw})
    assert message in str(err.value)


def test_a_reserve_above_the_node_memory_stops_the_plugin(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load(
            {
                **BASE,
                **proc_with_memory(tmp_path, 8 * 1024 * 1024),
                "TESSERA_SPILL_RESERVE_MIB": "8193",
            }
        )
    assert "TESSERA_SPILL_RESERVE_MIB=8193 is more than this node's memory (8192 MiB" in str(
        err.value
    )
    s = config.load(
        {**BASE, **proc_with_memory(tmp_path, 8 * 1024 * 1024), "TESSERA_SPILL_RESERVE_MIB": "8192"}
    )
    assert s.spill_reserve_mib == 8192


@pytest.mark.parametrize(
    ("raw", "message"),
    [("-1", "TESSERA_SPILL_RESERVE_MIB=-1 is out of range"), ("lots", "is not a whole number")],
)
def test_a_bad_reserve_stops_the_plugin_naming_it(tmp_path: Path, raw: str, message: str) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load(
            {**BASE, **proc_with_memory(tmp_path, 1 << 20), "TESSERA_SPILL_RESERVE_MIB": raw}
        )
    assert message in str(err.value)


def test_a_reserve_without_a_readable_meminfo_is_refused(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load({**BASE, "TESSERA_PROC_ROOT": str(tmp_path), "TESSERA_SPILL_RESERVE_MIB": "1"})
    assert "MemTotal cannot be read" in str(err.value)
    s = config.load({**BASE, "TESSERA_PROC_ROOT": str(tmp_path)})
    assert s.host_memory_mib is None and s.spill_reserve_mib == 0
