"""HAMi's scheduler extender (github.com/Project-HAMi/HAMi, HAMI_VERSION in e2e/versions.env) on
the harness cluster: set-up (d) of bench/bench_e2e.py, Tessera measured against HAMi.

Everything HAMi's scheduler is told comes from HAMi's own chart, rendered with the pinned helm
(`helm template`, the chart e2e/build.sh copies beside the binary) with its plain-HTTP variant
(`scheduler.admissionWebhook.enabled=false`: the pods name the scheduler themselves, as they do
in the benchmark's other set-ups, and kube-scheduler reaches the extender over loopback HTTP, as
it reaches Tessera's sidecar):

- a second kube-scheduler, as the chart runs one beside the cluster's own: the chart's
  KubeSchedulerConfiguration (its `hami-scheduler` profile, filter and bind verbs, node names
  only, managed resources), with the extender's URL pointed at this run's port and what a process
  beside the harness needs instead of the chart's pod (the harness's kubeconfig for
  kube-scheduler, no leader election, and the API client rate the harness's own kube-scheduler
  has in (a) to (c), so that the extenders are what differs);
- the extender's command line: the chart Deployment's `vgpu-scheduler-extender` container,
  except what a process beside the harness must be told instead (listen and metrics addresses on
  loopback, the device configuration's path, no leader election: the harness runs one of each
  scheduler, its kube-scheduler included), the chart's debug logging (`--debug -v=4`, its
  default extra arguments; kube-scheduler and Tessera log at their quiet defaults here too), and
  its API client's rate limit, which the benchmark runs both ways: as shipped (client-go's
  5 requests/s, burst 10: the chart sets no `--kube-qps`/`--kube-burst`), and raised to what
  Tessera's client may do (`RAISED`);
- the device configuration (`device-config.yaml`): the chart's ConfigMap, as written.

HAMi's device plugin registers a node's cards in a node annotation, `hami.io/node-nvidia-register`:
a JSON list of one entry per card (its UUID, index, how many pods may share it, memory in MiB,
compute share, model, NUMA node, mode, health), each card's share count and memory scaled as
the device configuration says. `register_nodes` writes it for the kwok nodes from the same
inventory Tessera's nodes report, so both schedulers see the same cards. The plugin's other part,
allocating a bound pod's devices and taking HAMi's node lock off, is e2e/hami_plugin.py, run as a
component beside the scheduler.

HAMi's scheduler reads the cluster through the harness's admin kubeconfig (KUBECONFIG), and is
ready when its metrics list every registered card (`hami_gpu_memory_limit_bytes`, one series per
card): it registers nodes on a 15 s tick, so that can take a while after it starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
import yaml

from e2e.cluster import Cluster
from e2e.hami_plugin import READY
from e2e.harness import E2E_DIR, HarnessError, build_binaries, load_versions
from e2e.objects import Api
from e2e.ports import free_port
from e2e.processes import http_ok, probe_context

COMPONENT = "hami-scheduler"
KUBE_SCHEDULER = "hami-kube-scheduler"  # the chart's own kube-scheduler, beside the harness's
PLUGIN = "hami-plugin"
EXTENDER_CONTAINER = "vgpu-scheduler-extender"
REGISTER_ANNOTATION = "hami.io/node-nvidia-register"
# What HAMi's scheduler asks of each node it first sees (a GET and a PATCH per annotation) unless
# a device plugin has answered already; written with the registration, as a running plugin's are.
HANDSHAKE_ANNOTATIONS = tuple(
    f"hami.io/node-handshake{suffix}" for suffix in ("", "-dcu", "-xpu", "-biren", "-va")
)
HANDSHAKE_ANSWERED = "Requesting_2000-01-01 00:00:00"
ALLOCATED_ANNOTATION = "hami.io/vgpu-devices-allocated"
# The chart's values that select its plain-HTTP variant (see the module docstring).
CHART_VALUES = ("scheduler.admissionWebhook.enabled=false",)
# Flags the harness sets itself (see the module docstring); the chart's values are dropped.
OVERRIDDEN = (
    "--http_bind", "--metrics-bind-address", "--device-config-file", "--leader-elect",
    "--leader-elect-resource-name", "--leader-elect-resource-namespace", "--debug", "-v",
    "--v", "--kube-qps", "--kube-burst",
)  # fmt: skip
# Tessera's API client has no rate limit of its own; the most the harness gives any Go client
# is its kube-scheduler's 1,000 requests/s, burst 2,000: HAMi's "raised" setting gets that.
RAISED = (1000, 2000)
SHIPPED = None  # client-go's defaults, 5 requests/s, burst 10, as the chart leaves them


def binaries() -> dict[str, Path]:
    """HAMi's scheduler (built from HAMi's source tarball on first use, e2e/build.sh) and the
    pinned helm. HarnessError when it cannot be built here (no tarball beside the checkout)."""
    return build_binaries((COMPONENT, "helm"))


@dataclass(frozen=True)
class HamiChart:
    """What HAMi's rendered chart tells its scheduler (see the module docstring)."""

    scheduler: dict[str, Any]  # the chart's KubeSchedulerConfiguration
    extender: dict[str, Any]  # its extender entry
    profiles: tuple[dict[str, Any], ...]
    args: tuple[str, ...]  # the extender container's arguments, less its command
    env: dict[str, str]  # the container's plain-value environment
    device_config: str  # device-config.yaml
    source: str

    @classmethod
    def from_manifests(cls, docs: Iterable[Any], source: str) -> HamiChart:
        scheduler: dict[str, Any] | None = None
        device_config: str | None = None
        container: dict[str, Any] | None = None
        for doc in docs:
            if not isinstance(doc, dict):
                continue
            data = doc.get("data") or {}
            if doc.get("kind") == "ConfigMap" and "config.yaml" in data:
                parsed = yaml.safe_load(data["config.yaml"])
                if isinstance(parsed, dict) and parsed.get("kind") == "KubeSchedulerConfiguration":
                    scheduler = parsed
            if doc.get("kind") == "ConfigMap" and "device-config.yaml" in data:
                device_config = data["device-config.yaml"]
            if doc.get("kind") == "Deployment":
                spec = doc.get("spec", {}).get("template", {}).get("spec", {})
                for candidate in spec.get("containers") or []:
                    if candidate.get("name") == EXTENDER_CONTAINER:
                        container = candidate
        if scheduler is None:
            raise HarnessError(f"{source}: no ConfigMap with a KubeSchedulerConfiguration")
        if device_config is None:
            raise HarnessError(f"{source}: no ConfigMap with a device-config.yaml")
        if container is None:
            raise HarnessError(f"{source}: no Deployment container named {EXTENDER_CONTAINER}")
        binders = [e for e in scheduler.get("extenders") or [] if e.get("bindVerb")]
        profiles = tuple(scheduler.get("profiles") or [])
        if len(binders) != 1 or not profiles:
            raise HarnessError(
                f"{source}: expected one extender with a bindVerb and a profile in the "
                "KubeSchedulerConfiguration"
            )
        command = [*(container.get("command") or []), *(container.get("args") or [])]
        env = {e["name"]: str(e["value"]) for e in container.get("env") or [] if "value" in e}
        return cls(scheduler, binders[0], profiles, tuple(command[1:]), env, device_config, source)

    @property
    def scheduler_name(self) -> str:
        return str(self.profiles[0]["schedulerName"])

    def scheduler_config(
        self, url: str, kubeconfig: Path, client: dict[str, Any]
    ) -> dict[str, Any]:
        """The chart's KubeSchedulerConfiguration for a kube-scheduler beside the harness: its
        extender at `url`, `kubeconfig` and the rate `client` (qps, burst) for its API client,
        no leader election; the rest as the chart renders it."""
        config = json.loads(json.dumps(self.scheduler))
        config["clientConnection"] = {
            **(config.get("clientConnection") or {}),
            **client,
            "kubeconfig": str(kubeconfig),
        }
        config["leaderElection"] = {"leaderElect": False}
        config["extenders"] = [
            {**e, "urlPrefix": url} if e.get("bindVerb") else e for e in config["extenders"]
        ]
        return config

    def command_line(
        self,
        http_bind: str,
        metrics_bind: str,
        device_config: Path,
        client: tuple[int, int] | None,
    ) -> list[str]:
        """The chart's arguments, less those in OVERRIDDEN, then the harness's own; `client`:
        the API client's (qps, burst), None for HAMi's defaults."""
        kept = [a for a in self.args if a.split("=", 1)[0] not in OVERRIDDEN]
        limits = [f"--kube-qps={client[0]}", f"--kube-burst={client[1]}"] if client else []
        return [
            *kept,
            f"--http_bind={http_bind}",
            f"--metrics-bind-address={metrics_bind}",
            f"--device-config-file={device_config}",
            "--leader-elect=false",
            *limits,
        ]

    def device_settings(self) -> dict[str, Any]:
        """The nvidia section of the device configuration."""
        parsed = yaml.safe_load(self.device_config) or {}
        nvidia = parsed.get("nvidia")
        if not isinstance(nvidia, dict):
            raise HarnessError(f"{self.source}: device-config.yaml has no nvidia section")
        return nvidia


def render_chart(helm: Path, chart: Path) -> HamiChart:
    """`helm template` of HAMi's chart for this harness's Kubernetes version."""
    kube_version = load_versions()["KUBERNETES_VERSION"]
    argv = [str(helm), "template", "hami", str(chart), "--namespace", "kube-system"]
    argv += ["--kube-version", kube_version]
    for value in CHART_VALUES:
        argv += ["--set", value]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)  # noqa: S603
    if proc.returncode != 0:
        raise HarnessError(f"helm template {chart} failed: {proc.stderr.strip()[-2000:]}")
    source = f"HAMi's chart ({chart}, {' '.join(CHART_VALUES)})"
    return HamiChart.from_manifests(yaml.safe_load_all(proc.stdout), source)


def register_annotation(cards: Sequence[dict[str, Any]], settings: dict[str, Any]) -> str:
    """`hami.io/node-nvidia-register` for a node with these cards (objects.inventory's), as
    HAMi's device plugin writes it under the device configuration `settings`."""
    split = int(settings.get("deviceSplitCount", 10))
    memory_scaling = float(settings.get("deviceMemoryScaling", 1))
    core_scaling = float(settings.get("deviceCoreScaling", 1))
    devices = []
    for card in cards:
        model = str(card["model"])
        devices.append(
            {
                "id": card["uuid"],
                "index": int(card["index"]),
                "count": split,
                "devmem": int(int(card["memory_mib"]) * memory_scaling),
                "devcore": int(core_scaling * 100),
                "type": model if model.startswith("NVIDIA") else f"NVIDIA-{model}",
                "numa": int(card.get("numa_node", 0)),
                "mode": "hami-core",
                "health": bool(card.get("healthy", True)),
            }
        )
    return json.dumps(devices, separators=(",", ":"))


def registered_cards(metrics: str) -> int:
    """How many cards HAMi's scheduler has registered, from its /metrics."""
    return sum(
        1 for line in metrics.splitlines() if line.startswith("hami_gpu_memory_limit_bytes{")
    )


def allocated_devices(value: str) -> list[tuple[str, int, int]]:
    """(card UUID, MiB, cores %) of each device in a pod's `hami.io/vgpu-devices-allocated`:
    containers apart by ";", a container's devices by ":", a device "UUID,type,MiB,cores"."""
    devices = []
    for container in value.split(";"):
        for device in container.split(":"):
            if device:
                uuid, _model, memory, cores = device.split(",")
                devices.append((uuid, int(memory), int(cores)))
    return devices


class Hami:
    """HAMi's scheduler, its kube-scheduler and the device plugin's stand-in on one harness
    cluster: `register_nodes()`, then per run `start()` (the plugin's stand-in and the
    extender, ready once it has registered the cards), `start_scheduler()` (the chart's
    kube-scheduler), and `stop()` whatever happened."""

    def __init__(self, cluster: Cluster, found: dict[str, Path]) -> None:
        self.cluster = cluster
        self.binary = found[COMPONENT]
        self.chart = render_chart(found["helm"], self.binary.parent / "chart")
        self.home = cluster.run_dir / "hami"
        taken = set(cluster.ports.values())
        self.ports = {name: free_port(taken) for name in ("http", "metrics", KUBE_SCHEDULER)}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports['http']}"

    @property
    def scheduler_name(self) -> str:
        return self.chart.scheduler_name

    @property
    def scheduler_port(self) -> int:
        """The secure port of HAMi's kube-scheduler (its /metrics, /healthz)."""
        return self.ports[KUBE_SCHEDULER]

    def register_nodes(self, api: Api, inventories: dict[str, dict[str, Any]]) -> None:
        """Write each node's card registration and handshake, as HAMi's device plugin would."""
        settings = self.chart.device_settings()
        handshake = dict.fromkeys(HANDSHAKE_ANNOTATIONS, HANDSHAKE_ANSWERED)

        def patch(item: tuple[str, dict[str, Any]]) -> None:
            name, inventory = item
            annotations = {REGISTER_ANNOTATION: register_annotation(inventory["cards"], settings)}
            response = api.session().patch(
                f"{api.base}/api/v1/nodes/{name}",
                data=json.dumps({"metadata": {"annotations": {**annotations, **handshake}}}),
                headers={"Content-Type": "application/merge-patch+json"},
                timeout=60,
            )
            if response.status_code != 200:
                raise HarnessError(f"hami: annotating {name}: {response.status_code}")

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(patch, inventories.items()))

    def start(self, cards: int, client: tuple[int, int] | None, timeout: float = 180) -> None:
        """The plugin's stand-in, then the extender with API client limits `client` (None:
        HAMi's defaults), ready once it has registered `cards`."""
        try:
            self._start(cards, client, timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, cards: int, client: tuple[int, int] | None, timeout: float) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        device_config = self.home / "device-config.yaml"
        device_config.write_text(self.chart.device_config)
        pki = self.cluster.pki
        plugin_log = self.cluster.logs / f"{PLUGIN}.log"
        self.cluster.start_component(
            PLUGIN,
            [
                sys.executable, str(E2E_DIR / "hami_plugin.py"),
                f"--apiserver={self.cluster.apiserver_url}", f"--ca={pki / 'ca.crt'}",
                f"--cert={pki / 'admin.crt'}", f"--key={pki / 'admin.key'}",
            ],
            probe=lambda: plugin_log.is_file() and READY in plugin_log.read_text(),
            what=f"'{READY}' in {plugin_log}",
        )  # fmt: skip
        metrics = f"http://127.0.0.1:{self.ports['metrics']}/metrics"
        argv = [
            str(self.binary),
            *self.chart.command_line(
                f"127.0.0.1:{self.ports['http']}", f"127.0.0.1:{self.ports['metrics']}",
                device_config, client,
            ),
        ]  # fmt: skip
        env = {**self.chart.env, "KUBECONFIG": str(self.cluster.kubeconfig)}
        env.setdefault("POD_NAMESPACE", "kube-system")
        env.setdefault("POD_NAME", COMPONENT)
        self.cluster.start_component(
            COMPONENT,
            argv,
            probe=lambda: self._registered(metrics) >= 0,
            what=f"GET {metrics}",
            env=env,
        )
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            seen = self._registered(metrics)
            if seen >= cards:
                return
            time.sleep(1)
        raise HarnessError(
            f"hami: its scheduler registered {seen} of {cards} cards within {timeout:.0f} s "
            f"(log: {self.cluster.logs / (COMPONENT + '.log')})"
        )

    def start_scheduler(self) -> None:
        """The chart's kube-scheduler (the harness's pinned binary), with the harness's
        scheduler identity and the API client rate of the harness's own kube-scheduler."""
        harness = self.cluster.scheduler_config("none")["clientConnection"]
        client = {key: harness[key] for key in ("qps", "burst")}
        kubeconfig = self.cluster.run_dir / "scheduler.kubeconfig"
        config_path = self.home / "scheduler-config.yaml"
        config_path.write_text(
            json.dumps(self.chart.scheduler_config(self.url, kubeconfig, client), indent=2)
        )
        port = self.ports[KUBE_SCHEDULER]
        url = f"https://127.0.0.1:{port}/healthz"
        insecure = probe_context()  # its self-signed serving certificate
        self.cluster.start_component(
            KUBE_SCHEDULER,
            [
                self.cluster.state["binaries"]["kube-scheduler"], f"--config={config_path}",
                "--bind-address=127.0.0.1", f"--secure-port={port}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}", "--v=1",
            ],
            probe=lambda: http_ok(url, insecure, lambda b: b"ok" in b),
            what=f"GET {url}",
        )  # fmt: skip

    @staticmethod
    def _registered(url: str) -> int:
        try:
            response = requests.get(url, timeout=10)
        except requests.RequestException:
            return -1
        return registered_cards(response.text) if response.status_code == 200 else -1

    def plugin_summary(self) -> str:
        """The plugin stand-in's last account of its releases (from its log)."""
        path = self.cluster.logs / f"{PLUGIN}.log"
        lines = [line for line in path.read_text().splitlines() if "pods allocated" in line]
        return lines[-1] if lines else f"(no releases reported in {path} yet)"

    def stop(self) -> None:
        self.cluster.stop_component(KUBE_SCHEDULER)
        self.cluster.stop_component(COMPONENT)
        self.cluster.stop_component(PLUGIN)
