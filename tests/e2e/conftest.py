"""Real-cluster end-to-end fixtures: one harness cluster for the whole session.

The session brings up etcd, kube-apiserver, kube-scheduler, kwok and the control plane under
test (e2e/cluster.py) once, creates eight simulated GPU nodes, reports their inventory through
the real REST API with node tokens, and takes everything down at the end, also when a test fails
or the session is interrupted.

Chart mode: with TESSERA_E2E_CHART_VALUES=values-resources.yaml (comma-separated values files,
names in tests/deploy/ or paths) the control plane, kube-scheduler and the webhook registration
are configured from the Helm chart rendered with those values (e2e/chart.py), and the builders of
e2e/objects.py ask for the chart's resource names. Empty or unset: the harness's own set-up.

With TESSERA_E2E_POSTGRES_URL the control plane's ledger is a fresh PostgreSQL database.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e import objects
from e2e.chart import CHART_VALUES_ENV, ChartConfig, ChartError
from e2e.cluster import Cluster, Options
from e2e.database import ScratchDatabase
from e2e.harness import ROOT, HarnessError, build_binaries, run_folder

# A PostgreSQL server (URL of any database on it): the session's control plane runs on a fresh
# database there instead of SQLite, as production does.
POSTGRES_ENV = "TESSERA_E2E_POSTGRES_URL"
NODES = [f"gpu-e2e-{i}" for i in range(8)]  # the shared pool
RELEASE_NODE = "gpu-e2e-release"  # one card, pool "release": the release test's own
CARDS_PER_NODE = 8
CARD_MEMORY_MIB = 81920
SLOTS_PER_CARD = 10


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def binaries() -> dict[str, Path]:
    """The pinned binaries (built on first use; a cold build takes a while, see docs/e2e.md)."""
    try:
        return build_binaries()
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)


def chart_values() -> list[str]:
    """The values files of chart mode (TESSERA_E2E_CHART_VALUES); empty: chart mode is off."""
    return [v.strip() for v in os.environ.get(CHART_VALUES_ENV, "").split(",") if v.strip()]


@pytest.fixture(scope="session")
def chart() -> ChartConfig | None:
    """Chart mode's configuration: the chart rendered with the pinned helm, then read."""
    values = chart_values()
    if not values:
        return None
    from tests.deploy.chart import CHART, render

    source = " ".join(
        ["helm template", str(CHART.relative_to(ROOT)), *(f"--values {v}" for v in values)]
    )
    try:
        return ChartConfig.from_manifests(render(*values), source=source)
    except (RuntimeError, AssertionError, ChartError) as exc:
        pytest.fail(f"chart mode ({CHART_VALUES_ENV}={values}): {exc}", pytrace=False)


@pytest.fixture(scope="session")
def database() -> Iterator[ScratchDatabase | None]:
    """The control plane's database: a fresh one on the PostgreSQL server POSTGRES_ENV names
    (dropped at the end), or None: SQLite in the run folder."""
    server = os.environ.get(POSTGRES_ENV, "")
    if not server:
        yield None
        return
    try:
        scratch = ScratchDatabase(server, Path(), tag="e2e")
    except Exception as exc:  # psycopg's errors: no server, no rights
        pytest.fail(f"{POSTGRES_ENV}={server}: cannot make the e2e database: {exc}", pytrace=False)
    try:
        yield scratch
    finally:
        scratch.drop()


@pytest.fixture(scope="session")
def cluster(
    binaries: dict[str, Path], chart: ChartConfig | None, database: ScratchDatabase | None
) -> Iterator[Cluster]:
    run = "run-pytest-chart" if chart is not None else "run-pytest"
    options = Options(
        run_dir=run_folder(run),
        binaries=binaries,
        chart=chart,
        database_url=database.url if database is not None else "",
    )
    harness = Cluster(options)
    # Pods ask for, and nodes advertise, what this control plane manages.
    objects.use_resources(harness.resource_names, harness.node_resource)
    try:
        harness.up()
    except HarnessError as exc:
        pytest.fail(f"the e2e cluster did not come up: {exc}", pytrace=False)
    try:
        yield harness
    finally:
        harness.down()


@pytest.fixture(scope="session")
def kube(cluster: Cluster) -> Iterator[Any]:
    with contextlib.closing(cluster.api_client()) as api:
        yield api


@pytest.fixture(scope="session")
def core(kube: Any) -> Any:
    from kubernetes import client

    return client.CoreV1Api(kube)


@pytest.fixture(scope="session")
def tessera(cluster: Cluster) -> objects.Tessera:
    return objects.Tessera(cluster.controlplane_url, cluster.admin_token)


@pytest.fixture(scope="session")
def node_tokens(cluster: Cluster) -> dict[str, str]:
    """One node identity per simulated node, made with the documented `createtoken` command."""
    return {
        name: cluster.manage("createtoken", name, "--role", "node", "--label", "e2e").strip()
        for name in [*NODES, RELEASE_NODE]
    }


@pytest.fixture(scope="session")
def gpu_nodes(
    cluster: Cluster, core: Any, tessera: objects.Tessera, node_tokens: dict[str, str]
) -> dict[str, Any]:
    """Eight kwok GPU nodes (and the release test's one-card node), Ready in Kubernetes and
    with their cards in Tessera's ledger; returns the shared nodes' first inventory answers."""
    for name in NODES:
        core.create_node(objects.gpu_node(name, cards=CARDS_PER_NODE, slots=SLOTS_PER_CARD))
    core.create_node(objects.gpu_node(RELEASE_NODE, cards=1, pool="release"))
    reports = {}
    for name in NODES:
        report = objects.inventory(name, cards=CARDS_PER_NODE, memory_mib=CARD_MEMORY_MIB)
        reports[name] = tessera.with_token(node_tokens[name]).report_inventory(name, report)
    release = tessera.with_token(node_tokens[RELEASE_NODE]).report_inventory(
        RELEASE_NODE, objects.inventory(RELEASE_NODE, cards=1)
    )
    assert release.status_code == 201, release.text

    def all_ready() -> bool:
        ready = 0
        for node in core.list_node(label_selector="tessera.io/e2e-kwok=true").items:
            conditions = {c.type: c.status for c in node.status.conditions or []}
            ready += conditions.get("Ready") == "True"
        return ready == len(NODES) + 1

    objects.wait_for(all_ready, timeout=60, what="kwok to report the GPU nodes Ready")
    return reports


@pytest.fixture
def namespace(core: Any, request: pytest.FixtureRequest) -> str:
    """A fresh namespace (with the default ServiceAccount no controller-manager creates here)."""
    name = objects.unique(request.node.name.replace("_", "-")[:40].strip("-").lower())
    return objects.create_namespace(core, name)


@pytest.fixture
def unmanaged(core: Any, request: pytest.FixtureRequest) -> str:
    """A fresh namespace the webhook skips: the reconciler tests' pods, bound by the tests."""
    name = objects.unique(request.node.name.replace("_", "-")[:30].strip("-").lower())
    return objects.create_namespace(core, name, webhook=False)
