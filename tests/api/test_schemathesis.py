"""The REST API against the OpenAPI schema it serves, once per role, with schemathesis.

A live server (its own database, a small cluster in it) serves `/api/schema/`; for each role -
none (no credentials), viewer, operator, admin and node (a node plugin's identity) - a
schemathesis run loads that schema over HTTP and drives every operation through all four phases
(examples, coverage, fuzzing, stateful, the last along the schema's links) with every built-in
check (no 5xx; status code, content type, headers and body as documented; bad input refused;
the auth checks) and the role check of tests/api/schemathesis_hooks.py, which judges every answer
against the documented role matrix (tests/api/role_matrix.py).

Bound (tests/api/schemathesis.toml): the examples and the coverage phase's finite set of cases
per operation, 10 fuzzed cases per operation and 40 stateful scenarios, from a fixed seed
(TESSERA_SWEEP_SEED overrides it); about 3 minutes for the five roles on two cores. A run that has
not ended after DEADLINE_S is killed and fails the test.

A one-line summary per role ("Schemathesis summary per role") goes to the end of pytest's report.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from io import StringIO
from pathlib import Path
from typing import Any

import pytest
import requests
from django.core.management import call_command

from controlplane.api.schema import EXAMPLE, parameter_kind
from controlplane.ledger.models import AuditEvent, Card, NamespaceQuota, Node, PodBinding, Slice
from controlplane.ledger.services.nodes import InventoryReport, apply_inventory
from controlplane.ledger.services.quotas import QuotaLimitsInput, set_quota
from tests.api.role_matrix import MATRIX, NONE, ROLES
from tests.builders import card_report, make_node
from tests.dashboard.builders import decision, pod
from tests.pods import gpu_container

pytestmark = pytest.mark.django_db(transaction=True)

ROOT = Path(__file__).resolve().parents[2]
CONFIG = Path(__file__).with_name("schemathesis.toml")
PHASES = ("examples", "coverage", "fuzzing", "stateful")
DEADLINE_S = 150
SEED = int(os.environ.get("TESSERA_SWEEP_SEED", "20261203"))
OWN_NODE = EXAMPLE["node"]  # the node identity's node
OTHER_NODE = "gpu-node-2"


# Failure codes by what went wrong (schemathesis: 1xx the response, 2xx request handling,
# 3xx stateful, 4xx auth); the role check's failures are custom ones (ST9xx).
def failure_kind(failure: dict[str, Any]) -> str:
    code = failure["code"]
    if code in ("ST101", "ST102"):
        return "5xx"
    if "RoleBoundary" in failure["title"]:
        return "role"
    return {"ST1": "schema", "ST2": "input", "ST3": "stateful", "ST4": "auth"}.get(
        code[:3], "other"
    )


def createtoken(username: str, role: str) -> str:
    out = StringIO()
    call_command("createtoken", username, "--role", role, stdout=out)
    return out.getvalue().strip()


@pytest.fixture
def cluster() -> None:
    """The cluster the schema's examples describe (the node identity's node, its card, a pod
    bound there, the pod's namespace with a quota), and another node with a pod of its own."""
    report = InventoryReport("0.1.0", (card_report(EXAMPLE["card"], 0, 81920),))
    apply_inventory(OWN_NODE, report, actor="test")
    make_node(OTHER_NODE, cards=2, memory_mib=40960)
    trainer = gpu_container(EXAMPLE["container"], 1, 20480, 30)
    pod(EXAMPLE["pod"], OWN_NODE, trainer, namespace=EXAMPLE["namespace"], uid=EXAMPLE["pod_uid"])
    pod("infer-0", OTHER_NODE, gpu_container("server", 1, 10240, 20), namespace="team-b")
    decision("giant-0", namespace=EXAMPLE["namespace"], reason_counts={"insufficient_memory": 2})
    limits = QuotaLimitsInput(gpumem_mib=163840, gpucores=200, gpus=4)
    set_quota(EXAMPLE["namespace"], limits, "test")


def ledger_rows(node: str | None = None) -> tuple[Any, ...]:
    """What the API can change, on one node (None: everywhere); audit events count everywhere."""
    nodes = Node.objects.all() if node is None else Node.objects.filter(name=node)
    cards = Card.objects.filter(node__in=nodes)
    bindings = PodBinding.objects.filter(node__in=nodes)
    return (
        sorted(nodes.values_list("name", "cordoned", "last_heartbeat")),
        sorted(cards.values_list("uuid", "cordoned", "healthy", "present", "memory_mib")),
        sorted(bindings.values_list("pod_uid", "phase")),
        sorted(NamespaceQuota.objects.values_list("namespace", "gpumem_mib", "gpucores", "gpus"))
        if node is None
        else (),
        AuditEvent.objects.count() if node is None else (),
    )


def cluster_names() -> dict[str, list[str]]:
    """The names the cluster holds besides the schema's examples, by what they name (the kinds of
    controlplane.api.schema): the examples reach the example objects, these the rest."""
    bindings = PodBinding.objects.all()
    quotas = NamespaceQuota.objects.values_list("namespace", flat=True)
    names = {
        "node": set(Node.objects.values_list("name", flat=True)),
        "card": set(Card.objects.values_list("uuid", flat=True)),
        "namespace": {*bindings.values_list("namespace", flat=True), *quotas},
        "pod": set(bindings.values_list("name", flat=True)),
        "pod_uid": set(bindings.values_list("pod_uid", flat=True)),
        "container": set(Slice.objects.values_list("container_name", flat=True)),
    }
    return {kind: sorted(values - {EXAMPLE[kind]}) for kind, values in names.items()}


def run_config(paths: set[str], names: dict[str, list[str]]) -> str:
    """tests/api/schemathesis.toml, and the cluster's other names as dictionaries that generation
    draws path parameters from half the time: the other half stays made up, so a run reaches the
    example objects, the others (another node's among them) and missing ones."""
    parts = [CONFIG.read_text(), "\n# The cluster's names (added by the test)\n"]
    parts += [
        f"[dictionaries.{kind}]\nvalues = {json.dumps(values)}\n" for kind, values in names.items()
    ]
    for path in sorted(paths):
        bindings = ", ".join(
            f'"path.{p}" = {{ dictionary = "{parameter_kind(p, path)}", probability = 0.5 }}'
            for p in re.findall(r"\{(\w+)\}", path)
        )
        if bindings:
            parts.append(f"[[operations]]\ninclude-path = {json.dumps(path)}\n")
            parts.append(f"parameters = {{ {bindings} }}\n")
    return "\n".join(parts)


def run_schemathesis(base: str, role: str, token: str, out: Path, config: str) -> dict[str, Any]:
    """One role's run; returns its JSON report, with the role check's tally under `tally`."""
    report, tally, config_file = out / "report.json", out / "tally.json", out / "schemathesis.toml"
    config_file.write_text(config)
    command = [
        sys.executable, "-m", "schemathesis.cli", "--config-file", str(config_file), "--no-color",
        "run", f"{base}/api/schema/",
        "--phases", ",".join(PHASES),
        "--seed", str(SEED),
        "--report", "json", "--report-json-path", str(report),
        # A fresh connection per request: on a kept-alive one, the test server's replies wait
        # out the client's delayed ACK (about 40 ms each, fifteen times the request itself).
        "--header", "Connection: close",
    ]  # fmt: skip
    authorization = f"Bearer {token}" if token else ""
    if authorization:
        command += ["--header", f"Authorization: {authorization}"]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "SCHEMATHESIS_HOOKS": "tests.api.schemathesis_hooks",
        "TESSERA_SWEEP_ROLE": role,
        "TESSERA_SWEEP_AUTHORIZATION": authorization,
        "TESSERA_SWEEP_NODE": OWN_NODE,
        "TESSERA_SWEEP_FOREIGN_PODS": ",".join(
            PodBinding.objects.exclude(node__name=OWN_NODE).values_list("pod_uid", flat=True)
        ),
        "TESSERA_SWEEP_TALLY": str(tally),
    }
    done = subprocess.run(
        command,
        cwd=out,  # schemathesis' own files stay out of the tree
        env=env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
        check=False,
    )
    log = done.stdout + done.stderr
    assert report.exists(), f"schemathesis wrote no report (exit {done.returncode}):\n{log[-6000:]}"
    result = json.loads(report.read_text())
    result["log"] = log
    result["tally"] = json.loads(tally.read_text()) if tally.exists() else None
    return result


@pytest.mark.parametrize("role", ROLES)
def test_the_served_schema_holds_for_every_answer_to(
    role: str, live_server: Any, cluster: None, tmp_path: Path, sweep_summary: list[str]
) -> None:
    token = (
        "" if role == NONE else createtoken(OWN_NODE if role == "node" else f"sweep-{role}", role)
    )
    served = requests.get(f"{live_server.url}/api/schema/", params={"format": "json"}, timeout=30)
    assert served.status_code == 200
    operations = {
        (method.upper(), path)
        for path, item in served.json()["paths"].items()
        for method in item
        if method in ("get", "put", "post", "patch", "delete")
    }
    assert operations == set(MATRIX), "the role matrix must list exactly the served operations"
    everywhere, other_node = ledger_rows(), ledger_rows(OTHER_NODE)

    config = run_config({path for _, path in operations}, cluster_names())
    result = run_schemathesis(live_server.url, role, token, tmp_path, config)

    kinds = dict.fromkeys(("5xx", "schema", "role", "input", "stateful", "auth", "other"), 0)
    for failure in result["failures"]:
        kinds[failure_kind(failure)] += failure["count"]
    errors = sum(error["count"] for error in result["errors"])
    sweep_summary.append(
        f"{role:>8}: {result['operations']['tested']}/{len(operations)} operations, "
        f"{result['test_cases']['generated']} cases, {result['running_time']:.0f} s; failures: "
        + ", ".join(f"{kind} {count}" for kind, count in kinds.items())
        + f"; errors {errors}"
    )
    print(result["log"])  # pytest shows it when the test fails: failures with curl to replay
    assert result["operations"]["tested"] == len(operations)
    ran = {name: phase["status"] for name, phase in (result["phases"] or {}).items()}
    assert all(ran.get(name) in ("success", "failure") for name in PHASES), ran
    assert (result["failures"], errors) == ([], 0)
    tally = result["tally"]
    assert tally is not None and tally["judged"].get(role, 0) > 0  # the role check ran
    if role in (NONE, "viewer"):
        assert ledger_rows() == everywhere  # refused or read-only: nothing changed
    if role == "node":
        assert ledger_rows(OTHER_NODE) == other_node  # another node's rows are not its own
