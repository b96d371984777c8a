"""The harness's chart mode: the control plane configured from the Helm chart's rendered manifests.

`TESSERA_E2E_CHART_VALUES=values-resources.yaml` (comma-separated values files, names in
tests/deploy/ or paths) makes the e2e session render deploy/helm/tessera with the pinned helm
(`helm template`, tests/deploy/chart.py) and hand the manifests to `ChartConfig.from_manifests`.
The harness then takes from the chart, instead of its own defaults:

- the control plane's environment: the `env` of every Tessera Django container of the chart
  (controlplane `app` and `webhook`, the scheduler's `extender` sidecar, `worker`, `beat`,
  `migrate`), which must agree wherever two of them set the same name, since the harness runs
  one set of processes for all of them; less the names in `OVERRIDDEN`, which only the harness
  can know (its database, Redis, API server, secrets, folders, host names);
- kube-scheduler's `KubeSchedulerConfiguration` from the scheduler ConfigMap: the profile and
  the binding extender as rendered (schedulerName, verbs, weight, managedResources,
  nodeCacheCapable, httpTimeout, ignorable), with only the extender's address (this control
  plane on loopback, plain HTTP as the sidecar is), the kubeconfig and leader election replaced;
- the `MutatingWebhookConfiguration` as rendered (rules, selectors, matchConditions, failure
  policy, timeout), with `clientConfig` the harness's URL and CA;
- the resource name the simulated nodes advertise: the node plugin DaemonSet's
  `TESSERA_RESOURCE_GPU`;
- the extender sidecar's command (its server and settings), with only its listening address
  replaced (`e2e/manifests.py sidecar_argv`).

The chart's parts are checked against each other on the way (the profile's schedulerName is the
control plane's TESSERA_SCHEDULER_NAME, managedResources and the node plugin's name are the
control plane's TESSERA_RESOURCE_*): a chart whose parts disagree fails here with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from controlplane.scheduling import ResourceNames
from e2e.manifests import extender_command_in

CHART_VALUES_ENV = "TESSERA_E2E_CHART_VALUES"

# (component label, container name) of the chart's Tessera Django containers. The harness's two
# gunicorns, its Celery worker (with --beat) and its manage.py calls play all of them at once.
DJANGO_CONTAINERS = (
    ("controlplane", "app"),
    ("controlplane", "webhook"),
    ("scheduler", "extender"),
    ("worker", "worker"),
    ("beat", "beat"),
    ("migrate", "migrate"),
)
REQUIRED_CONTAINERS = (("controlplane", "app"), ("scheduler", "extender"))

# The chart's settings the harness replaces with its own, and why. Everything else the chart's
# containers set is passed to the control plane as rendered (TESSERA_ENV=production included:
# the harness then supplies what production demands, a secret key and an allocation key file).
# A `valueFrom` on a name not listed here stops chart mode with a message asking for a line here.
OVERRIDDEN: dict[str, str] = {
    "DATABASE_URL": "the harness's database (SQLite in the run folder, or "
    "TESSERA_E2E_DATABASE_URL); the chart's names its in-cluster PostgreSQL or a Secret",
    "TESSERA_DB_PASSWORD": "a Secret reference, used only to build the chart's DATABASE_URL",
    "REDIS_URL": "the harness's Redis, on a database index of the run's own; the chart's names "
    "its in-cluster Redis or a Secret",
    "TESSERA_REDIS_PASSWORD": "a Secret reference, used only to build the chart's REDIS_URL",
    "TESSERA_SECRET_KEY": "a Secret reference; the harness generates a key per run",
    "TESSERA_ALLOCATION_KEY_FILE": "the chart's path is its Secret's mount in the scheduler pod; "
    "the harness writes the run's key to a file in the run folder (the tests sign with it too)",
    "TESSERA_KUBE_MODE": "incluster needs a pod's ServiceAccount; the harness's processes reach "
    "its API server with kubeconfig mode and its admin KUBECONFIG",
    "TESSERA_LOCAL_DIR": "the chart's is the pod's emptyDir; the harness's is in its run folder",
    "TESSERA_ALLOWED_HOSTS": "the chart lists its Services' DNS names and $(POD_IP); the "
    "harness serves on 127.0.0.1",
    "POD_IP": "a fieldRef of the pod; the harness runs no pod",
    "TESSERA_NODE_STALE_AFTER_S": "the tests report each node's inventory once, at the start "
    "of the session, so the harness keeps nodes fresh for the whole session",
}

# kube-scheduler settings the harness sets itself: its kubeconfig and client rate (no pod
# ServiceAccount), and no leader election (one scheduler, and the chart's Lease namespace does
# not exist here). The extender's urlPrefix, enableHTTPS and tlsConfig: the control plane's
# plain HTTP listener on loopback, as the chart's sidecar is reached on 127.0.0.1.
SCHEDULER_OVERRIDDEN = ("clientConnection", "leaderElection", "extenders[].urlPrefix",
                        "extenders[].enableHTTPS", "extenders[].tlsConfig")  # fmt: skip

_REFERENCE = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class ChartError(ValueError):
    """The rendered chart lacks something the harness needs, or its parts disagree."""


@dataclass(frozen=True)
class ChartConfig:
    """What the harness takes from one rendering of the chart (see the module docstring)."""

    source: str  # how it was rendered, for messages and the run's state.json
    env: dict[str, str]  # the chart's settings the control plane runs with
    overridden: dict[str, str]  # the names the chart sets that the harness replaces -> why
    scheduler_config: dict[str, Any]  # the rendered KubeSchedulerConfiguration
    webhook_config: dict[str, Any]  # the rendered MutatingWebhookConfiguration
    node_resource: str  # what the node plugin advertises (its TESSERA_RESOURCE_GPU)
    containers: tuple[str, ...] = field(default=())  # the containers the env came from
    # The scheduler pod's extender sidecar: its command and args as rendered.
    extender_command: tuple[str, ...] = field(default=())

    @property
    def resources(self) -> ResourceNames:
        """The resource names the control plane runs with (settings.py's defaults if unset)."""
        default = ResourceNames()
        return ResourceNames(
            gpu=self.env.get("TESSERA_RESOURCE_GPU", default.gpu),
            gpumem=self.env.get("TESSERA_RESOURCE_GPUMEM", default.gpumem),
            gpumem_percentage=self.env.get(
                "TESSERA_RESOURCE_GPUMEM_PERCENTAGE", default.gpumem_percentage
            ),
            gpucores=self.env.get("TESSERA_RESOURCE_GPUCORES", default.gpucores),
            priority=self.env.get("TESSERA_RESOURCE_PRIORITY", default.priority),
        )

    @property
    def scheduler_name(self) -> str:
        return self.env.get("TESSERA_SCHEDULER_NAME", "tessera-scheduler")

    @classmethod
    def from_manifests(cls, docs: list[dict[str, Any]], source: str) -> ChartConfig:
        env, overridden, containers = _django_env(docs)
        config = cls(
            source=source,
            env=env,
            overridden=overridden,
            scheduler_config=_scheduler_config(docs),
            webhook_config=_only(docs, "MutatingWebhookConfiguration"),
            node_resource=_node_resource(docs),
            containers=containers,
            extender_command=_extender_command(docs),
        )
        config.check()
        return config

    def scheduler_parts(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The binding extender and the profile(s) named TESSERA_SCHEDULER_NAME."""
        extenders = [e for e in self.scheduler_config.get("extenders") or [] if e.get("bindVerb")]
        profiles = [
            p
            for p in self.scheduler_config.get("profiles") or []
            if p.get("schedulerName") == self.scheduler_name
        ]
        if len(extenders) != 1 or not profiles:
            raise ChartError(
                f"{self.source}: the scheduler ConfigMap should hold one extender with a bindVerb "
                f"and a profile named {self.scheduler_name!r} (the control plane's "
                f"TESSERA_SCHEDULER_NAME); it has profiles "
                f"{[p.get('schedulerName') for p in self.scheduler_config.get('profiles') or []]}"
            )
        return dict(extenders[0]), profiles

    def check(self) -> None:
        """The chart's parts agree on the scheduler's name and the resource names."""
        extender, _ = self.scheduler_parts()
        names = set(self.resources.all())
        managed = {m.get("name") for m in extender.get("managedResources") or []}
        if managed != names:
            raise ChartError(
                f"{self.source}: the scheduler's managedResources {sorted(managed)} are not the "
                f"control plane's TESSERA_RESOURCE_* {sorted(names)}"
            )
        if self.node_resource != self.resources.gpu:
            raise ChartError(
                f"{self.source}: the node plugin advertises {self.node_resource!r} but the "
                f"control plane's TESSERA_RESOURCE_GPU is {self.resources.gpu!r}"
            )
        if not self.webhook_config.get("webhooks"):
            raise ChartError(f"{self.source}: the MutatingWebhookConfiguration has no webhooks")


def _component(doc: dict[str, Any]) -> str:
    return str(((doc.get("metadata") or {}).get("labels") or {}).get("app.kubernetes.io/component"))


def _pod_spec(doc: dict[str, Any]) -> dict[str, Any]:
    return dict(((doc.get("spec") or {}).get("template") or {}).get("spec") or {})


def _extender_command(docs: list[dict[str, Any]]) -> tuple[str, ...]:
    """The command and args of the scheduler Deployment's `extender` container."""
    argv = extender_command_in([d for d in docs if _component(d) == "scheduler"])
    if argv is None:
        raise ChartError(
            "the rendered chart's scheduler Deployment has no extender container command"
        )
    return tuple(argv)


def _only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d.get("kind") == kind]
    if len(found) != 1:
        raise ChartError(f"the rendered chart has {len(found)} {kind} objects; expected one")
    return found[0]


def _expand(value: str, known: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion: names set before it in the container; others stay."""
    return _REFERENCE.sub(lambda m: known.get(m[1], m[0]), value)


def _django_env(
    docs: list[dict[str, Any]],
) -> tuple[dict[str, str], dict[str, str], tuple[str, ...]]:
    """The union of the Django containers' env, less OVERRIDDEN; references expanded."""
    env: dict[str, str] = {}
    origin: dict[str, str] = {}
    overridden: dict[str, str] = {}
    seen: list[str] = []
    for doc in docs:
        if doc.get("kind") not in ("Deployment", "Job", "StatefulSet", "DaemonSet"):
            continue
        for container in _pod_spec(doc).get("containers") or []:
            where = (_component(doc), container.get("name"))
            if where not in DJANGO_CONTAINERS:
                continue
            label = f"{doc['kind']} {doc['metadata']['name']}/{container['name']}"
            seen.append(label)
            own: dict[str, str] = {}
            for item in container.get("env") or []:
                name = item["name"]
                if name in OVERRIDDEN:
                    overridden[name] = OVERRIDDEN[name]
                    continue
                if "valueFrom" in item:
                    raise ChartError(
                        f"{label}: env {name} comes from {item['valueFrom']}, which the harness "
                        "cannot resolve; give it a reason in e2e/chart.py OVERRIDDEN and set "
                        "the harness's own value in e2e/cluster.py"
                    )
                value = _expand(str(item.get("value", "")), own)
                own[name] = value
                if name in env and env[name] != value:
                    raise ChartError(
                        f"{name} is {env[name]!r} in {origin[name]} but {value!r} in {label}; "
                        "the harness runs one control plane for both and cannot honour both"
                    )
                env[name] = value
                origin.setdefault(name, label)
    found = {
        (_component(d), c.get("name")) for d in docs for c in _pod_spec(d).get("containers") or []
    }
    missing = [f"{c}/{n}" for c, n in REQUIRED_CONTAINERS if (c, n) not in found]
    if missing:
        raise ChartError(f"the rendered chart has no container {missing} (component/name)")
    return env, overridden, tuple(seen)


def _scheduler_config(docs: list[dict[str, Any]]) -> dict[str, Any]:
    for doc in docs:
        if doc.get("kind") != "ConfigMap":
            continue
        for value in (doc.get("data") or {}).values():
            try:
                inner = yaml.safe_load(value)
            except yaml.YAMLError:
                continue
            if isinstance(inner, dict) and inner.get("kind") == "KubeSchedulerConfiguration":
                return inner
    raise ChartError("the rendered chart has no ConfigMap holding a KubeSchedulerConfiguration")


def _node_resource(docs: list[dict[str, Any]]) -> str:
    for doc in docs:
        if doc.get("kind") == "DaemonSet" and _component(doc) == "nodeplugin":
            for container in _pod_spec(doc).get("containers") or []:
                for item in container.get("env") or []:
                    if item["name"] == "TESSERA_RESOURCE_GPU":
                        return str(item["value"])
    return ResourceNames().gpu  # the node plugin's default
