"""One real node next to the harness's kwok nodes: an OCI registry, containerd with CDI, the
kubelet, and kube-controller-manager's DaemonSet controller (docs/e2e.md, "The real node").

`RealNodeCluster` is the harness's `Cluster` plus, after kwok, in this order:

- **registry**: the distribution registry on 127.0.0.1 (its data in the run folder); the images
  of images/build.sh are pushed to it with skopeo, and every image below is pulled from it.
- **containerd** 2.x: its own root, state and socket in the run folder, CDI on with the run's
  spec directory, cgroupfs, no NRI, `restrict_oom_score_adj` (this host may not lower an
  oom_score_adj), the pause image and the registry (plain HTTP on loopback) from the registry.
- **kubelet** of the pinned Kubernetes: a client certificate of `system:node:<name>` (group
  system:nodes, bound to the `system:node` role here since no Node authorizer runs), cgroupfs,
  cgroup v1 allowed, swap allowed, serving on 127.0.0.1 only (the API server reaches it there
  for logs), its root folder in the run folder. Its device-plugin folder cannot move: the
  kubelet always uses /var/lib/kubelet/device-plugins/, so one real node runs per machine
  (a lock file there says which run holds it).
- **kube-controller-manager** with only the DaemonSet controller, so the chart's node plugin
  DaemonSet gets its pod (and a new one when it is deleted), and the root CA publisher, so a
  pod that reads the API server (the node plugin, for pods' signed annotations) gets its
  token volume; nothing else of the harness changes.

Pods on the node use the host's network (no CNI here). Stopping removes every pod through
containerd first, then stops the daemons (each by its pid and its descendants) and removes what
the kubelet and containerd left: mounts under the run folder and the cgroups `kubepods`,
`k8s.io`, `default`.
A component that fails stops the start-up with its name and the end of its log.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil

from e2e import images as image_build
from e2e.certificates import sign_leaf, write_kubeconfig
from e2e.cluster import Cluster, Options
from e2e.dra import CLAIM_CONTROLLER, FEATURE_GATES, feature_gates_flag
from e2e.harness import HarnessError, build_binaries, log
from e2e.ports import free_port, listening
from e2e.processes import get_ok

NODE_NAME = "tessera-e2e-node"
NODE_LABEL = "tessera.io/e2e-real"
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")  # fixed by the kubelet
LOCK_FILE = Path("/var/lib/kubelet/.tessera-e2e-node.lock")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CGROUPS = ("kubepods", "k8s.io", "default")
NODE_BINARIES = ("kubelet", "kube-controller-manager", "containerd", "containerd-shim-runc-v2",
                 "ctr", "crictl", "registry")  # fmt: skip
NODE_COMPONENTS = ("kube-controller-manager", "kubelet", "containerd", "registry")  # stop order
NODE_PORTS = ("registry", "kubelet", "kubelet-healthz", "kube-controller-manager")


def ensure_runc() -> Path:
    """runc from Debian's package (installed when absent, as scripts/services.sh does)."""
    found = shutil.which("runc") or ("/usr/sbin/runc" if Path("/usr/sbin/runc").exists() else "")
    if found:
        return Path(found)
    log("containerd: installing runc from Debian's packages")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], env=env, check=False)  # noqa: S607
    proc = subprocess.run(
        ["apt-get", "install", "-y", "-qq", "runc"],  # noqa: S607
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    found = shutil.which("runc") or ""
    if proc.returncode != 0 or not found:
        raise HarnessError(f"containerd: runc is missing and apt-get install runc failed:\n"
                           f"{proc.stderr[-2000:]}")  # fmt: skip
    return Path(found)


class RealNodeCluster(Cluster):
    """The harness with the real node (module docstring); `up()`/`down()` as the harness."""

    def __init__(self, options: Options | None = None) -> None:
        super().__init__(options)
        self._lock_fd: int | None = None
        self.images: dict[str, image_build.Image] = {}

    # -- paths -------------------------------------------------------------------------------
    @property
    def node_dir(self) -> Path:
        return self.run_dir / "node"

    @property
    def containerd_socket(self) -> Path:
        return self.node_dir / "containerd" / "containerd.sock"

    @property
    def kubelet_root(self) -> Path:
        return self.node_dir / "kubelet"

    @property
    def pod_resources_dir(self) -> Path:
        return self.kubelet_root / "pod-resources"

    @property
    def cdi_dir(self) -> Path:
        return self.node_dir / "cdi"

    @property
    def pod_logs_dir(self) -> Path:
        return self.node_dir / "pod-logs"

    @property
    def registry(self) -> str:
        return f"127.0.0.1:{self.ports['registry']}"

    def image_ref(self, name: str) -> str:
        """Where the node pulls image `name` from (the run's registry)."""
        return f"{self.registry}/{self.images[name].ref}"

    # -- up ----------------------------------------------------------------------------------
    def _up(self) -> None:
        binaries = dict(self.options.binaries)
        if not set(NODE_BINARIES) <= binaries.keys():
            # Built (or found) ones, less those the caller set (the failure tests' stand-ins).
            binaries = {**build_binaries(NODE_BINARIES), **binaries}
            self.options.binaries = binaries
        self._take_lock()
        super()._up()
        self.state["binaries"].update({k: str(v) for k, v in binaries.items()})
        taken = set(self.state["ports"].values())
        for name in NODE_PORTS:
            self.state["ports"][name] = free_port(taken)
        self.state["real_node"] = {"name": NODE_NAME, "dir": str(self.node_dir)}
        self._save_state()
        started = time.monotonic()
        try:
            self.images = image_build.build()
        except image_build.ImageError as exc:
            raise HarnessError(str(exc)) from None
        log(f"images ready in {time.monotonic() - started:.0f} s")
        self._start_registry(Path(binaries["registry"]))
        self._push_images()
        self._start_containerd(
            Path(binaries["containerd"]), Path(binaries["containerd-shim-runc-v2"])
        )
        self._start_kubelet(Path(binaries["kubelet"]))
        self._start_controller_manager(Path(binaries["kube-controller-manager"]))

    def _take_lock(self) -> None:
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Path(LOCK_FILE).read_text().strip()
            os.close(fd)
            raise HarnessError(
                f"kubelet: another real node runs on this machine ({holder}); the kubelet's "
                f"device-plugin folder {DEVICE_PLUGIN_DIR} is fixed, so only one can: stop it "
                "first (its run folder's `python e2e/cluster.py down --run-dir ...`)"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"run folder {self.run_dir}, pid {os.getpid()}\n".encode())
        self._lock_fd = fd

    def _release_lock(self) -> None:
        if self._lock_fd is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._lock_fd, 0)
            os.close(self._lock_fd)
            self._lock_fd = None

    def _start_registry(self, binary: Path) -> None:
        # In the run folder: each run pushes its images afresh (seconds), and nothing piles up.
        data = self.node_dir / "registry"
        data.mkdir(parents=True, exist_ok=True)
        config = self.node_dir / "registry.yaml"
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(json.dumps({
            "version": 0.1,
            "log": {"level": "warn", "accesslog": {"disabled": True}},
            "storage": {"filesystem": {"rootdirectory": str(data)}, "delete": {"enabled": True}},
            "http": {"addr": self.registry},
        }, indent=2))  # fmt: skip
        self._spawn("registry", [str(binary), "serve", str(config)], port_names=("registry",))
        url = f"http://{self.registry}/v2/"
        self._wait_ready("registry", lambda: get_ok(url), f"GET {url}")

    def _push_images(self) -> None:
        started = time.monotonic()
        for image in self.images.values():
            try:
                image_build.push(image, self.registry)
            except image_build.ImageError as exc:
                raise HarnessError(f"registry: {exc}") from None
        log(f"pushed {len(self.images)} images to {self.registry} in "
            f"{time.monotonic() - started:.0f} s")  # fmt: skip

    def _start_containerd(self, binary: Path, shim: Path) -> None:
        runc = ensure_runc()
        root = self.node_dir / "containerd"
        hosts = root / "certs.d" / self.registry
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts.toml").write_text(
            f'server = "http://{self.registry}"\n\n[host."http://{self.registry}"]\n'
            '  capabilities = ["pull", "resolve"]\n'
        )
        self.cdi_dir.mkdir(parents=True, exist_ok=True)
        cri_images = "plugins.'io.containerd.cri.v1.images'"
        cri_runtime = "plugins.'io.containerd.cri.v1.runtime'"
        runc_runtime = f"{cri_runtime}.containerd.runtimes.runc"
        config = "\n".join([
            "version = 3",
            f"root = '{root / 'root'}'",
            f"state = '{root / 'state'}'",
            "disabled_plugins = ['io.containerd.nri.v1.nri']",
            "[grpc]",
            f"  address = '{self.containerd_socket}'",
            "[ttrpc]",
            f"  address = '{self.containerd_socket}.ttrpc'",
            "[debug]",
            "  level = 'info'",
            f"[{cri_images}]",
            "  snapshotter = 'overlayfs'",
            f"[{cri_images}.pinned_images]",
            f"  sandbox = '{self.image_ref('pause')}'",
            f"[{cri_images}.registry]",
            f"  config_path = '{root / 'certs.d'}'",
            f"[{cri_runtime}]",
            "  enable_cdi = true",
            f"  cdi_spec_dirs = ['{self.cdi_dir}']",
            # This host may not lower an oom_score_adj (no CAP_SYS_RESOURCE): without this every
            # sandbox fails in runc ("can't get final child's PID from pipe").
            "  restrict_oom_score_adj = true",
            f"[{cri_runtime}.containerd]",
            "  default_runtime_name = 'runc'",
            f"[{runc_runtime}]",
            "  runtime_type = 'io.containerd.runc.v2'",
            f"[{runc_runtime}.options]",
            f"  BinaryName = '{runc}'",
            "  SystemdCgroup = false",
            "[plugins.'io.containerd.grpc.v1.cri']",
            "  stream_server_address = '127.0.0.1'",
            "  stream_server_port = '0'",
            "",
        ])  # fmt: skip
        (root / "config.toml").write_text(config)
        env = {"PATH": f"{shim.parent}:{runc.parent}:{os.environ.get('PATH', '')}"}
        self._spawn("containerd", [str(binary), f"--config={root / 'config.toml'}"],
                    port_names=(), env=env)  # fmt: skip
        self._wait_ready("containerd", lambda: self._crictl_ok("info"), "crictl info")

    def crictl(self, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """crictl against the node's containerd."""
        return subprocess.run(  # noqa: S603 - the pinned binary, our arguments
            [self.state["binaries"]["crictl"], f"--runtime-endpoint=unix://{self.containerd_socket}",
             f"--image-endpoint=unix://{self.containerd_socket}", "--timeout=20s", *args],
            capture_output=True, text=True, timeout=timeout, check=False,
        )  # fmt: skip

    def _crictl_ok(self, *args: str) -> bool:
        if not self.containerd_socket.exists():
            return False
        try:
            return self.crictl(*args, timeout=10).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def _node_certificate(self) -> None:
        sign_leaf(self.pki, "node", f"/O=system:nodes/CN=system:node:{NODE_NAME}", "clientAuth")

    def _bind_node_role(self) -> None:
        """The bootstrap `system:node` role for the system:nodes group (RBAC is the only
        authorizer here; clusters bind nodes through the Node authorizer instead)."""
        from kubernetes import client

        body = {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "tessera-e2e-nodes"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                        "name": "system:node"},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group",
                          "name": "system:nodes"}],
        }  # fmt: skip
        with contextlib.closing(self.api_client()) as api:
            client.RbacAuthorizationV1Api(api).create_cluster_role_binding(body)

    def _start_kubelet(self, binary: Path) -> None:
        self._node_certificate()
        self._bind_node_role()
        kubeconfig = self.node_dir / "kubelet.kubeconfig"
        write_kubeconfig(kubeconfig, self.apiserver_url, self.pki, "node")
        for folder in (self.kubelet_root, self.pod_logs_dir):
            folder.mkdir(parents=True, exist_ok=True)
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "address": "127.0.0.1",
            "port": self.ports["kubelet"],
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.ports["kubelet-healthz"],
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(self.pki / "ca.crt")},
            },
            # Only holders of the harness CA's client certificates get past authentication.
            "authorization": {"mode": "AlwaysAllow"},
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "cgroupDriver": "cgroupfs",
            "failCgroupV1": False,  # this host has cgroup v1 hierarchies only
            "failSwapOn": False,
            "oomScoreAdj": 0,  # the kubelet may not lower its own here
            "podLogsDir": str(self.pod_logs_dir),
            "serializeImagePulls": False,
            "nodeStatusUpdateFrequency": "5s",
            "syncFrequency": "10s",
            "fileCheckFrequency": "5s",
            # The disk and memory are shared with the rest of the machine: evict only when
            # nearly full, never because another process filled the disk a little.
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 99,
            "imageGCLowThresholdPercent": 98,
            "resolvConf": "/etc/resolv.conf",
            "protectKernelDefaults": False,
            "localStorageCapacityIsolation": False,
            "maxPods": 110,
            "featureGates": dict(FEATURE_GATES),  # DRA mode's (e2e/dra.py)
        }  # fmt: skip
        config_path = self.node_dir / "kubelet-config.json"
        config_path.write_text(json.dumps(config, indent=2))
        self._spawn(
            "kubelet",
            [
                str(binary),
                f"--config={config_path}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.kubelet_root}",
                f"--cert-dir={self.node_dir / 'kubelet-pki'}",
                f"--hostname-override={NODE_NAME}",
                "--node-ip=127.0.0.1",
                f"--node-labels={NODE_LABEL}=true,tessera.io/gpu=true",
                "--v=2",
            ],
            port_names=("kubelet", "kubelet-healthz"),
        )
        url = f"http://127.0.0.1:{self.ports['kubelet-healthz']}/healthz"
        self._wait_ready("kubelet", lambda: get_ok(url) and self._node_registered(), url)

    def _node_registered(self) -> bool:
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        with contextlib.closing(self.api_client()) as api:
            try:
                client.CoreV1Api(api).read_node(NODE_NAME)
            except ApiException:
                return False
        return True

    def _start_controller_manager(self, binary: Path) -> None:
        port = self.ports["kube-controller-manager"]
        self._spawn(
            "kube-controller-manager",
            [
                str(binary),
                f"--kubeconfig={self.kubeconfig}",
                f"--authentication-kubeconfig={self.kubeconfig}",
                f"--authorization-kubeconfig={self.kubeconfig}",
                # Only what the chart's node plugin needs: its DaemonSet gets its pods, and
                # each namespace the kube-root-ca.crt ConfigMap a pod's API token volume holds;
                # in DRA mode a pod's claims are made from its ResourceClaimTemplates.
                f"--controllers=daemonset,root-ca-cert-publisher,{CLAIM_CONTROLLER}",
                feature_gates_flag(),
                f"--root-ca-file={self.pki / 'ca.crt'}",
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--v=1",
            ],
            port_names=("kube-controller-manager",),
        )
        url = f"https://127.0.0.1:{port}/healthz"
        self._wait_ready("kube-controller-manager", lambda: get_ok(url, insecure=True), url)

    # -- down --------------------------------------------------------------------------------
    def down(self, quiet: bool = False) -> list[int]:
        if not self.state and not self.load_state():
            self._release_lock()
            return super().down(quiet)
        components = self.state.get("components", {})
        if "containerd" in components:
            self._remove_pods()
        for name in NODE_COMPONENTS:
            self.stop_component(name)
        swept = super().down(quiet)
        if self.state.get("real_node"):
            self._clean_host()
        self._release_lock()
        return swept

    def _remove_pods(self) -> None:
        """Every pod sandbox through containerd (their containers' processes are not the
        daemons' children: stopping containerd alone would leave them running)."""
        if "kubelet" in self.state.get("components", {}):
            self.stop_component("kubelet")  # or it starts them again
        try:
            proc = self.crictl("rmp", "--all", "--force", timeout=120)
        except subprocess.TimeoutExpired:
            log("containerd: removing the node's pods took over 120 s; killing what is left")
            return
        if proc.returncode != 0 and "no such" not in proc.stderr.lower():
            log(f"containerd: crictl rmp --all failed: {proc.stderr.strip()[-500:]}")

    def _clean_host(self) -> None:
        """Processes left in the node's cgroups, then its mounts, then the cgroups."""
        for cgroup in self._cgroups():
            with contextlib.suppress(OSError):
                for pid in (cgroup / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
        prefix = str(self.run_dir) + "/"
        mounts = [
            part.mountpoint
            for part in psutil.disk_partitions(all=True)
            if part.mountpoint.startswith(prefix)
        ]
        for point in sorted(mounts, key=len, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)  # noqa: S603,S607
        deadline = time.monotonic() + 10
        for cgroup in sorted(self._cgroups(), key=lambda p: len(p.parts), reverse=True):
            while True:
                try:
                    cgroup.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        log(f"could not remove cgroup {cgroup} (processes still in it?)")
                        break
                    time.sleep(0.1)

    def _cgroups(self) -> list[Path]:
        found = []
        for hierarchy in CGROUP_ROOT.iterdir():
            for name in CGROUPS:
                top = hierarchy / name
                if top.is_dir() and not top.is_symlink():
                    found += [Path(d) for d, _, _ in os.walk(top)]
        return found

    # -- what the tests ask of the node ------------------------------------------------------
    def restart_kubelet(self) -> None:
        """Stop the kubelet and start it again with the same settings (its pods keep running)."""
        info = self.state["components"]["kubelet"]
        argv = list(info["argv"])
        self.stop_component("kubelet")
        # Closed connections of the old kubelet keep its ports in TIME_WAIT for a minute; the
        # kubelet (as any Go server) binds with SO_REUSEADDR, so only a listener is in the way.
        deadline = time.monotonic() + 30
        while any(listening(self.ports[p]) for p in ("kubelet", "kubelet-healthz")):
            if time.monotonic() > deadline:
                raise HarnessError("kubelet: the stopped kubelet's ports are still listening")
            time.sleep(0.2)
        self._spawn("kubelet", argv, port_names=())
        self.state["components"]["kubelet"]["ports"] = dict(info["ports"])
        self._save_state()
        url = f"http://127.0.0.1:{self.ports['kubelet-healthz']}/healthz"
        self._wait_ready("kubelet", lambda: get_ok(url), url)

    def pod_log(self, namespace: str, name: str, container: str) -> list[str]:
        """The lines a container wrote, every start of it, oldest first (from the CRI logs,
        `<podLogsDir>/<ns>_<name>_<uid>/<container>/<restart>.log`)."""
        lines: list[str] = []
        for pod_dir in self.pod_logs_dir.glob(f"{namespace}_{name}_*"):
            logs = sorted((pod_dir / container).glob("*.log"), key=lambda p: int(p.stem))
            for path in logs:
                for raw in path.read_text(errors="replace").splitlines():
                    # CRI log format: <time> <stream> <P|F> <text>
                    parts = raw.split(" ", 3)
                    lines.append(parts[3] if len(parts) == 4 else raw)
        return lines
