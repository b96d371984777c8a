"""Settings of the node plugin, read once from the environment (documented in docs/nodeplugin.md).

Every variable has a safe default for a standard kubelet layout except the node name and the
control plane's URL. A bad value stops the plugin at start with a message naming the variable
and the fix; nothing is re-read later.
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path

from nodeplugin import dra_paths

# How the node plugin serves the kubelet (docs/dra.md): as a device plugin beside the scheduler
# extender, or as a DRA driver whose ResourceSlices kube-scheduler allocates from.
DEVICE_PLUGIN, DRA = "deviceplugin", "dra"
PLUGIN_MODES = (DEVICE_PLUGIN, DRA)
MIN_KEY_BYTES = 32  # as the control plane (controlplane/extender/signing.py)
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_RESOURCE = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_CDI_KIND = re.compile(r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the variable and the fix."""


@dataclass(frozen=True)
class Settings:
    node_name: str
    resource_name: str = "nvidia.com/gpu"
    slots: int = 10
    device_plugin_dir: Path = Path("/var/lib/kubelet/device-plugins")
    plugin_socket: str = "tessera-gpu.sock"
    pod_resources_socket: Path = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
    controlplane_url: str = ""
    token_file: Path = Path(f"{SA_DIR}/token")
    ca_file: Path | None = None
    allocation_source: str = "controlplane"  # or "annotation"
    # With the control plane as the source: when it does not answer within
    # controlplane_wait_s, take the pod's signed annotation from the API server instead.
    allocation_fallback: bool = False
    controlplane_wait_s: float = 5.0
    allocation_key: bytes = b""
    kube_api_url: str = ""
    kube_token_file: Path = Path(f"{SA_DIR}/token")
    kube_ca_file: Path | None = None
    device_mode: str = "cdi"  # or "paths"
    cdi_dir: Path = Path("/var/run/cdi")
    cdi_kind: str = "tessera.io/gpu"
    cdi_annotation: bool = False
    nvidia_cdi_kind: str = ""
    state_dir: Path = Path("/var/lib/tessera/nodeplugin")
    region_dir: Path = Path("/var/run/tessera/regions")
    region_container_dir: str = "/var/run/tessera"
    config_container_dir: str = "/etc/tessera"
    shim_library: Path = Path("/usr/local/tessera/lib/libtessera.so")
    shim_container_path: str = "/usr/local/tessera/lib/libtessera.so"
    preload: bool = True
    container_log_level: str = ""
    dev_root: Path = Path("/dev")
    heartbeat_s: float = 30.0
    health_probe_s: float = 5.0
    health_recovery_s: float = 60.0
    health_checks: bool = True
    ignored_xids: frozenset[int] = field(
        default_factory=lambda: frozenset({13, 31, 43, 45, 68, 109})
    )
    kubelet_poll_s: float = 0.2
    # On SIGTERM, after telling the control plane the cards take no new pods: how long the
    # kubelet keeps this plugin's stream, so that a pod bound just before is still admitted.
    stop_drain_s: float = 2.0
    prestart_timeout_s: float = 25.0
    http_timeout_s: float = 5.0
    metrics_port: int = 0
    metrics_interval_s: float = 10.0
    gc_interval_s: float = 300.0
    priority_poll_s: float = 0.1
    priority_busy_s: float = 1.0
    # MIG: where the driver's /proc files are (nvidia-caps minors).
    proc_root: Path = Path("/proc")
    # MPS: the control binary (a name on PATH or a path), the pipe directory inside containers,
    # and how often the daemon is checked.
    mps_control: str = "nvidia-cuda-mps-control"
    mps_container_dir: str = "/tmp/nvidia-mps"  # noqa: S108 - MPS's own default, inside the container
    mps_poll_s: float = 1.0
    plugin_mode: str = DEVICE_PLUGIN
    # DRA mode: where the kubelet's plugin watcher looks for registration sockets, and the
    # driver's own directory for the socket the kubelet calls (the kubelet's defaults,
    # KubeletRegistryDir and KubeletPluginsDir/<driver> in dynamic-resource-allocation).
    dra_registry_dir: Path = Path("/var/lib/kubelet/plugins_registry")
    dra_plugin_dir: Path = Path("/var/lib/kubelet/plugins/gpu.tessera.io")
    # Virtual device memory (docs/nodeplugin.md): the default oversubscription factor of this
    # node's cards (a decimal string, "1" = off), the host memory set aside for what slices
    # spill (MiB), and the node's memory (MemTotal, MiB; None when it cannot be read).
    memory_oversubscription: str = "1"
    spill_reserve_mib: int = 0
    host_memory_mib: int | None = None

    @property
    def plugin_socket_path(self) -> Path:
        return self.device_plugin_dir / self.plugin_socket

    @property
    def kubelet_socket_path(self) -> Path:
        return self.device_plugin_dir / "kubelet.sock"


def _int(env: Mapping[str, str], name: str, default: int, lo: int, hi: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number (e.g. {name}={default})") from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range: use {lo}..{hi}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, lo: float, hi: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(
            f"{name}={raw!r} is not a number of seconds (e.g. {name}={default})"
        ) from None
    if not lo <= value <= hi:
        raise ConfigError(f"{name}={value} is out of range: use {lo}..{hi}")
    return value


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in {"1", "true", "yes", "on"}:
        return True
    if raw in {"0", "false", "no", "off"}:
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean: use true or false")


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    raw = env.get(name, "").strip().lower() or default
    if raw not in choices:
        raise ConfigError(f"{name}={raw!r} is not one of {', '.join(choices)}")
    return raw


def _abs_path(env: Mapping[str, str], name: str, default: Path) -> Path:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.startswith("/"):
        raise ConfigError(f"{name}={raw!r} must be an absolute path")
    return Path(raw)


def _optional_path(env: Mapping[str, str], name: str, default: Path | None) -> Path | None:
    raw = env.get(name, "").strip()
    if not raw:
        return default if default is not None and default.exists() else None
    if not raw.startswith("/"):
        raise ConfigError(f"{name}={raw!r} must be an absolute path")
    return Path(raw)


def _container_path(env: Mapping[str, str], name: str, default: str) -> str:
    raw = env.get(name, "").strip() or default
    if not raw.startswith("/") or "\n" in raw or "=" in raw:
        raise ConfigError(f"{name}={raw!r} must be an absolute path inside the container")
    return raw


def _allocation_key(env: Mapping[str, str]) -> bytes:
    path = env.get("TESSERA_ALLOCATION_KEY_FILE", "").strip()
    if path:
        try:
            key = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ConfigError(
                f"TESSERA_ALLOCATION_KEY_FILE={path!r} cannot be read ({exc.strerror}); mount the "
                "allocation-key Secret there"
            ) from None
    else:
        key = env.get("TESSERA_ALLOCATION_KEY", "").strip().encode()
    if key and len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"the allocation key holds {len(key)} bytes; it needs at least {MIN_KEY_BYTES} "
            "(the control plane's minimum; e.g. `openssl rand -base64 48`)"
        )
    return key


def _xids(env: Mapping[str, str], default: frozenset[int]) -> frozenset[int]:
    raw = env.get("TESSERA_IGNORED_XIDS")
    if raw is None:
        return default
    try:
        return frozenset(int(x) for x in raw.replace(" ", "").split(",") if x)
    except ValueError:
        raise ConfigError(
            f"TESSERA_IGNORED_XIDS={raw!r} must be a comma list of XID numbers, e.g. 13,31,43"
        ) from None


def _kube_api_url(env: Mapping[str, str]) -> str:
    raw = env.get("TESSERA_KUBE_API_URL", "").strip()
    if raw:
        return raw.rstrip("/")
    host = env.get("KUBERNETES_SERVICE_HOST", "").strip()
    port = env.get("KUBERNETES_SERVICE_PORT", "443").strip()
    if not host:
        return ""
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}:{port}"


def load(env: Mapping[str, str] | None = None) -> Settings:
    """Build the settings from ``env`` (the process environment by default)."""
    env = os.environ if env is None else env
    d = Settings(node_name="-")
    node = (env.get("TESSERA_NODE_NAME") or env.get("NODE_NAME") or "").strip()
    if not node:
        node = socket.gethostname()
    resource = env.get("TESSERA_RESOURCE_GPU", "").strip() or d.resource_name
    if not _RESOURCE.match(resource) or resource.split("/")[0].endswith("kubernetes.io"):
        raise ConfigError(
            f"TESSERA_RESOURCE_GPU={resource!r} must be a domain-prefixed extended resource name "
            "outside kubernetes.io, e.g. nvidia.com/gpu"
        )
    slots_default = _int(env, "TESSERA_DEFAULT_SLOTS", d.slots, 1, 1000)
    slots = _int(env, "TESSERA_SLOTS", slots_default, 1, 1000)
    plugin_socket = env.get("TESSERA_PLUGIN_SOCKET", "").strip() or d.plugin_socket
    if "/" in plugin_socket or not plugin_socket.endswith(".sock"):
        raise ConfigError(
            f"TESSERA_PLUGIN_SOCKET={plugin_socket!r} must be a bare file name ending in .sock"
        )
    source = _choice(
        env, "TESSERA_ALLOCATION_SOURCE", d.allocation_source, ("controlplane", "annotation")
    )
    url = env.get("TESSERA_CONTROLPLANE_URL", "").strip().rstrip("/")
    if url and not re.match(r"^https?://", url):
        raise ConfigError(f"TESSERA_CONTROLPLANE_URL={url!r} must start with http:// or https://")
    if not url:
        raise ConfigError(
            "TESSERA_CONTROLPLANE_URL is not set: give the control plane's base URL, e.g. "
            "http://tessera.tessera-system.svc:8000"
        )
    key = _allocation_key(env)
    kube_url = _kube_api_url(env)
    fallback = _bool(env, "TESSERA_ALLOCATION_FALLBACK", d.allocation_fallback)
    if source == "annotation" or fallback:
        what = (
            "TESSERA_ALLOCATION_SOURCE=annotation"
            if source == "annotation"
            else "TESSERA_ALLOCATION_FALLBACK=true"
        )
        if not key:
            raise ConfigError(
                f"{what} needs TESSERA_ALLOCATION_KEY_FILE (the allocation-key Secret) to "
                "verify the signed annotation"
            )
        if not kube_url:
            raise ConfigError(
                f"{what} needs the API server: set TESSERA_KUBE_API_URL or run in a cluster "
                "(KUBERNETES_SERVICE_HOST)"
            )
    cdi_kind = env.get("TESSERA_CDI_KIND", "").strip() or d.cdi_kind
    if not _CDI_KIND.match(cdi_kind):
        raise ConfigError(f"TESSERA_CDI_KIND={cdi_kind!r} must look like vendor.example/class")
    nvidia_kind = env.get("TESSERA_NVIDIA_CDI_KIND", "").strip()
    if nvidia_kind and not _CDI_KIND.match(nvidia_kind):
        raise ConfigError(f"TESSERA_NVIDIA_CDI_KIND={nvidia_kind!r} must look like nvidia.com/gpu")
    level = env.get("TESSERA_CONTAINER_LOG_LEVEL", "").strip()
    if level and not re.match(r"^[A-Za-z0-9]+$", level):
        raise ConfigError(f"TESSERA_CONTAINER_LOG_LEVEL={level!r} must be a single word")
    heartbeat = _float(env, "TESSERA_HEARTBEAT_S", d.heartbeat_s, 1.0, 3600.0)
    device_mode = _choice(env, "TESSERA_DEVICE_MODE", d.device_mode, ("cdi", "paths"))
    plugin_mode = _plugin_mode(env, kube_url, device_mode)
    dra_registry_dir = _abs_path(env, "TESSERA_DRA_REGISTRY_DIR", d.dra_registry_dir)
    dra_plugin_dir = _abs_path(env, "TESSERA_DRA_PLUGIN_DIR", d.dra_plugin_dir)
    longest = dra_paths.longest_socket_path(dra_registry_dir, dra_plugin_dir)
    if plugin_mode == DRA and longest > dra_paths.MAX_SOCKET_PATH:
        raise ConfigError(
            f"TESSERA_DRA_REGISTRY_DIR={str(dra_registry_dir)!r} and TESSERA_DRA_PLUGIN_DIR="
            f"{str(dra_plugin_dir)!r} make a socket path of {longest} bytes; a unix socket's "
            f"path holds at most {dra_paths.MAX_SOCKET_PATH}: use shorter directories"
        )
    proc_root = _abs_path(env, "TESSERA_PROC_ROOT", d.proc_root)
    factor, reserve, host_mib = _virtual_memory(env, proc_root)
    return Settings(
        node_name=node,
        resource_name=resource,
        slots=slots,
        device_plugin_dir=_abs_path(env, "TESSERA_DEVICE_PLUGIN_DIR", d.device_plugin_dir),
        plugin_socket=plugin_socket,
        pod_resources_socket=_abs_path(env, "TESSERA_POD_RESOURCES_SOCKET", d.pod_resources_socket),
        controlplane_url=url,
        token_file=_abs_path(env, "TESSERA_TOKEN_FILE", d.token_file),
        ca_file=_optional_path(env, "TESSERA_CA_FILE", None),
        allocation_source=source,
        allocation_fallback=fallback and source == "controlplane",
        controlplane_wait_s=_float(
            env, "TESSERA_CONTROLPLANE_WAIT_S", d.controlplane_wait_s, 0.1, 20.0
        ),
        allocation_key=key,
        kube_api_url=kube_url,
        kube_token_file=_abs_path(env, "TESSERA_KUBE_TOKEN_FILE", d.kube_token_file),
        kube_ca_file=_optional_path(env, "TESSERA_KUBE_CA_FILE", Path(f"{SA_DIR}/ca.crt")),
        device_mode=device_mode,
        cdi_dir=_abs_path(env, "TESSERA_CDI_DIR", d.cdi_dir),
        cdi_kind=cdi_kind,
        cdi_annotation=_bool(env, "TESSERA_CDI_ANNOTATION", d.cdi_annotation),
        nvidia_cdi_kind=nvidia_kind,
        state_dir=_abs_path(env, "TESSERA_STATE_DIR", d.state_dir),
        region_dir=_abs_path(env, "TESSERA_REGION_DIR", d.region_dir),
        region_container_dir=_container_path(
            env, "TESSERA_REGION_CONTAINER_DIR", d.region_container_dir
        ),
        config_container_dir=_container_path(
            env, "TESSERA_CONFIG_CONTAINER_DIR", d.config_container_dir
        ),
        shim_library=_abs_path(env, "TESSERA_SHIM_LIBRARY", d.shim_library),
        shim_container_path=_container_path(
            env, "TESSERA_SHIM_CONTAINER_PATH", d.shim_container_path
        ),
        preload=_bool(env, "TESSERA_PRELOAD", d.preload),
        container_log_level=level,
        dev_root=_abs_path(env, "TESSERA_DEV_ROOT", d.dev_root),
        heartbeat_s=heartbeat,
        health_probe_s=_float(env, "TESSERA_HEALTH_PROBE_S", d.health_probe_s, 0.05, 600.0),
        health_recovery_s=_float(
            env, "TESSERA_HEALTH_RECOVERY_S", d.health_recovery_s, 0.0, 86400.0
        ),
        health_checks=_bool(env, "TESSERA_HEALTH_CHECKS", d.health_checks),
        ignored_xids=_xids(env, d.ignored_xids),
        kubelet_poll_s=_float(env, "TESSERA_KUBELET_POLL_S", d.kubelet_poll_s, 0.01, 60.0),
        stop_drain_s=_float(env, "TESSERA_STOP_DRAIN_S", d.stop_drain_s, 0.0, 10.0),
        prestart_timeout_s=_float(
            env, "TESSERA_PRESTART_TIMEOUT_S", d.prestart_timeout_s, 0.5, 29.0
        ),
        http_timeout_s=_float(env, "TESSERA_HTTP_TIMEOUT_S", d.http_timeout_s, 0.1, 60.0),
        metrics_port=_int(env, "TESSERA_METRICS_PORT", d.metrics_port, 0, 65535),
        metrics_interval_s=_float(
            env, "TESSERA_METRICS_INTERVAL_S", d.metrics_interval_s, 0.05, 3600.0
        ),
        gc_interval_s=_float(env, "TESSERA_GC_INTERVAL_S", d.gc_interval_s, 1.0, 86400.0),
        # At most 1 s: a hold's lease is 5 polls, and the shim ignores one over 10 s ahead.
        priority_poll_s=_float(env, "TESSERA_PRIORITY_POLL_S", d.priority_poll_s, 0.01, 1.0),
        priority_busy_s=_float(env, "TESSERA_PRIORITY_BUSY_S", d.priority_busy_s, 0.01, 600.0),
        proc_root=proc_root,
        mps_control=_mps_control(env, d.mps_control),
        mps_container_dir=_container_path(env, "TESSERA_MPS_CONTAINER_DIR", d.mps_container_dir),
        mps_poll_s=_float(env, "TESSERA_MPS_POLL_S", d.mps_poll_s, 0.01, 60.0),
        plugin_mode=plugin_mode,
        dra_registry_dir=dra_registry_dir,
        dra_plugin_dir=dra_plugin_dir,
        memory_oversubscription=factor,
        spill_reserve_mib=reserve,
        host_memory_mib=host_mib,
    )


def _plugin_mode(env: Mapping[str, str], kube_url: str, device_mode: str) -> str:
    raw = env.get("TESSERA_PLUGIN_MODE", "").strip() or DEVICE_PLUGIN
    if raw not in PLUGIN_MODES:
        raise ConfigError(
            f"TESSERA_PLUGIN_MODE={raw!r} is not a mode of the node plugin: use {DEVICE_PLUGIN} "
            f"(the default: a kubelet device plugin beside the scheduler extender) or {DRA} "
            "(a DRA driver: kube-scheduler allocates from its ResourceSlices)"
        )
    if raw == DRA and not kube_url:
        raise ConfigError(
            f"TESSERA_PLUGIN_MODE={DRA} needs the API server (it reads ResourceClaims and "
            "publishes ResourceSlices): set TESSERA_KUBE_API_URL or run in a cluster "
            "(KUBERNETES_SERVICE_HOST)"
        )
    if raw == DRA and device_mode != "cdi":
        raise ConfigError(
            f"TESSERA_PLUGIN_MODE={DRA} hands containers their devices as CDI IDs only: unset "
            f"TESSERA_DEVICE_MODE={device_mode}"
        )
    return raw


def _mps_control(env: Mapping[str, str], default: str) -> str:
    raw = env.get("TESSERA_MPS_CONTROL", "").strip() or default
    if "/" in raw and not raw.startswith("/"):
        raise ConfigError(
            f"TESSERA_MPS_CONTROL={raw!r} must be a command name on PATH or an absolute path"
        )
    return raw


MAX_OVERSUBSCRIPTION = 16
_DECIMAL = re.compile(r"^-?[0-9]+(\.[0-9]+)?$")


def oversubscription_factor(name: str, raw: str) -> str:
    """``raw`` as the inventory report carries a factor: a decimal from 1 to 16 with at most two
    decimal places, written without trailing zeros ("1.50" -> "1.5"); ConfigError naming
    ``name`` otherwise."""
    text = raw.strip()
    if not _DECIMAL.match(text):
        raise ConfigError(
            f"{name}={raw!r} is not a decimal number: use 1 to {MAX_OVERSUBSCRIPTION}, e.g. "
            f"{name}=1.5 (1 = no oversubscription)"
        )
    value = Decimal(text)
    if "." in text and len(text.rstrip("0").split(".")[1]) > 2:
        raise ConfigError(f"{name}={raw!r} has more than two decimal places, e.g. use 1.25")
    if not 1 <= value <= MAX_OVERSUBSCRIPTION:
        raise ConfigError(
            f"{name}={raw!r} is out of range: use 1 to {MAX_OVERSUBSCRIPTION} "
            "(1 = no oversubscription; a factor below 1 would shrink the cards)"
        )
    return format(value.normalize(), "f")


def host_memory_mib(proc_root: Path) -> int | None:
    """The node's memory in MiB (``MemTotal`` of ``<proc_root>/meminfo``); None when unknown."""
    try:
        text = (proc_root / "meminfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "MemTotal:" and parts[1].isdigit():
            mib = int(parts[1]) // 1024  # the kernel writes kB (KiB)
            return mib if mib >= 1 else None
    return None


def _virtual_memory(env: Mapping[str, str], proc_root: Path) -> tuple[str, int, int | None]:
    """The node's oversubscription factor, spill reserve and memory. A reserve the node cannot
    hold stops the plugin: the control plane would place spills on memory that is not there."""
    factor = oversubscription_factor(
        "TESSERA_MEMORY_OVERSUBSCRIPTION", env.get("TESSERA_MEMORY_OVERSUBSCRIPTION", "") or "1"
    )
    reserve = _int(env, "TESSERA_SPILL_RESERVE_MIB", 0, 0, 1 << 40)
    host = host_memory_mib(proc_root)
    if reserve and host is None:
        raise ConfigError(
            f"TESSERA_SPILL_RESERVE_MIB={reserve} cannot be checked: MemTotal cannot be read from "
            f"{proc_root / 'meminfo'} (set TESSERA_PROC_ROOT to the host's /proc)"
        )
    if host is not None and reserve > host:
        raise ConfigError(
            f"TESSERA_SPILL_RESERVE_MIB={reserve} is more than this node's memory ({host} MiB, "
            f"MemTotal in {proc_root / 'meminfo'}): set aside at most what the node has, and "
            "leave room for its pods"
        )
    return factor, reserve, host
