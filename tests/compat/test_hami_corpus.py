"""HAMi's own manifests through Tessera's real endpoints, compared with the outcomes HAMi gives
them: the compatibility corpus in ``../shared/compat/hami/`` (its README has the format).

Each case is driven the way a cluster would drive it: the nodes report their inventory with
their own tokens (``PUT /api/v1/nodes/<name>/inventory``); every pod goes through the admission
webhook (``POST /webhook/mutate``) as the API server sends it, and Tessera's own patch makes the
pod kube-scheduler then sees; the pod is created in the embedded stand-in of the API server;
filter, prioritize and bind are the extender's endpoints with kube-scheduler's JSON; the
allocation is read from the Binding's ``tessera.io/allocation`` annotation and from
``GET /api/v1/allocations/<ns>/<name>`` with the node's token, which must agree.

The corpus is read where it lies, never copied into the project: ``TESSERA_HAMI_CORPUS``, else
``shared/compat/hami`` next to the checkout or above it, or next to the checkout this one was
cloned from.
"""

from __future__ import annotations

import base64
import copy
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.test import Client

from controlplane.access.roles import Role
from controlplane.kube.adapter import get_kube
from tests.builders import create_token

pytestmark = pytest.mark.django_db

ROOT = Path(__file__).resolve().parents[2]
CASES = 40  # the corpus' size: a case that goes missing must not pass unnoticed


def origin_checkout() -> Path | None:
    """The checkout this clone was made from, when it is a folder on this machine: a clean
    clone made for CI elsewhere still finds the corpus next to the checkout it came from."""
    try:
        url = subprocess.run(
            ["git", "-C", str(ROOT), "remote", "get-url", "origin"],
            capture_output=True, text=True, timeout=10, check=False,
        ).stdout.strip()  # fmt: skip
    except OSError:
        return None
    path = Path(url.removeprefix("file://"))
    return path if url and path.is_absolute() and path.is_dir() else None


def corpus_dir() -> Path | None:
    given = os.environ.get("TESSERA_HAMI_CORPUS")
    if given:
        return Path(given)
    origin = origin_checkout()
    for start in (ROOT, *([origin] if origin else [])):
        for parent in start.resolve().parents:
            found = parent / "shared" / "compat" / "hami"
            if (found / "cases").is_dir():
                return found
    return None


CORPUS = corpus_dir()
needs_corpus = pytest.mark.skipif(
    CORPUS is None,
    reason="the HAMi corpus is not here: set TESSERA_HAMI_CORPUS to its folder "
    "(shared/compat/hami next to the checkout)",
)


@cache
def case_ids() -> tuple[str, ...]:
    if CORPUS is None:
        return ()
    return tuple(sorted(p.stem for p in (CORPUS / "cases").glob("*.json")))


def load(case_id: str) -> dict[str, Any]:
    assert CORPUS is not None
    return json.loads((CORPUS / "cases" / f"{case_id}.json").read_text())


# --------------------------------------------------------------------------- the cluster


class Cluster:
    """One case's nodes, pods and what Tessera answered."""

    def __init__(self, case: dict[str, Any]) -> None:
        self.case = case
        self.namespace: str = case["namespace"]
        self.client = Client()  # kube-scheduler and the API server: loopback, no token
        self.group: str = case["group"]
        self.node_clients: dict[str, Client] = {}
        self.card_mib: dict[str, int] = {}
        self.card_model: dict[str, str] = {}
        self.pods: dict[str, dict[str, Any]] = {}  # key -> the pod kube-scheduler sees
        self.admissions: dict[str, dict[str, Any]] = {}
        self.records: dict[str, dict[str, Any]] = {}  # pod key -> its allocation record
        self.feasible: dict[str, list[str]] = {}

    def node(self, short: str) -> str:
        return f"{self.group}-{short}"

    def short(self, node: str) -> str:
        prefix = f"{self.group}-"
        assert node.startswith(prefix), node
        return node[len(prefix) :]

    def report_inventory(self) -> None:
        for short, report in self.case["inventory"].items():
            name = self.node(short)
            token = create_token(name, Role.NODE)
            client = Client(HTTP_AUTHORIZATION=f"Bearer {token}")
            response = client.put(
                f"/api/v1/nodes/{name}/inventory", json.dumps(report), "application/json"
            )
            assert response.status_code in (200, 201), (name, response.content)
            self.node_clients[name] = client
            for card in report["cards"]:
                self.card_mib[card["uuid"]] = card["memory_mib"]
                self.card_model[card["uuid"]] = card["model"]

    # ---- admission

    def admit(self, key: str) -> None:
        """The webhook's answer for the pod, and the pod as kube-scheduler then sees it."""
        entry = self.entry(key)
        review = entry["admission_review"]
        response = self.client.post("/webhook/mutate", json.dumps(review), "application/json")
        assert response.status_code == 200, response.content
        answer = response.json()["response"]
        assert answer["uid"] == review["request"]["uid"]
        self.admissions[key] = answer
        if not answer["allowed"]:
            return
        pod = apply_patch(review["request"]["object"], answer)
        served = entry["extender_args"]["Pod"] if entry.get("extender_args") else None
        if served is not None:
            # What the API server adds at creation (name of a generated pod, uid, version).
            meta = pod.setdefault("metadata", {})
            for k in ("name", "uid", "resourceVersion", "creationTimestamp"):
                meta[k] = served["metadata"][k]
            pod["status"] = copy.deepcopy(served.get("status") or {"phase": "Pending"})
        self.pods[key] = pod

    def entry(self, key: str) -> dict[str, Any]:
        (found,) = [p for p in self.case["pods"] if p["key"] == key]
        return found

    # ---- the extender, as kube-scheduler calls it

    def node_names(self, key: str) -> list[str]:
        return list(self.entry(key)["extender_args"]["NodeNames"])

    def filter(self, key: str, pod: dict[str, Any] | None = None) -> dict[str, Any]:
        args = {"Pod": pod or self.pods[key], "Nodes": None, "NodeNames": self.node_names(key)}
        response = self.client.post("/scheduler/filter", json.dumps(args), "application/json")
        assert response.status_code == 200, response.content
        result = response.json()
        assert not result.get("Error"), result
        return result

    def prioritize(self, key: str, names: list[str]) -> dict[str, int]:
        args = {"Pod": self.pods[key], "Nodes": None, "NodeNames": names}
        response = self.client.post("/scheduler/prioritize", json.dumps(args), "application/json")
        assert response.status_code == 200, response.content
        return {h["Host"]: h["Score"] for h in response.json()}

    def bind(self, key: str, pod: dict[str, Any], node: str) -> dict[str, Any]:
        meta = pod["metadata"]
        get_kube().create_pod(pod)
        args = {
            "PodName": meta["name"],
            "PodNamespace": meta["namespace"],
            "PodUID": meta["uid"],
            "Node": node,
        }
        response = self.client.post("/scheduler/bind", json.dumps(args), "application/json")
        assert response.status_code == 200, response.content
        assert not response.json().get("Error"), (key, node, response.json())
        served = get_kube().get_pod(meta["namespace"], meta["name"])
        assert served is not None and served["spec"].get("nodeName") == node
        record = json.loads(served["metadata"]["annotations"]["tessera.io/allocation"])
        asked = self.node_clients[node].get(
            f"/api/v1/allocations/{meta['namespace']}/{meta['name']}"
        )
        assert asked.status_code == 200, asked.content
        assert asked.json() == record, "the annotation and the REST record differ"
        return record


def apply_patch(obj: dict[str, Any], answer: dict[str, Any]) -> dict[str, Any]:
    """RFC 6902 'add'/'replace' ops, all the webhook sends."""
    doc = copy.deepcopy(obj)
    if "patch" not in answer:
        return doc
    assert answer["patchType"] == "JSONPatch"
    for op in json.loads(base64.b64decode(answer["patch"])):
        assert op["op"] in ("add", "replace"), op
        *parents, last = [
            p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]
        ]
        target = doc
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        if isinstance(target, list):
            target.insert(int(last), op["value"])
        else:
            target[last] = op["value"]
    return doc


# --------------------------------------------------------------------------- comparisons


def check_admission(cluster: Cluster, key: str, expect: dict[str, Any]) -> None:
    answer = cluster.admissions[key]
    wanted = expect["admission"]
    assert answer["allowed"] is wanted["allowed"], (key, answer.get("status"))
    if not wanted["allowed"]:
        assert answer["status"]["message"], "a denial must say why"
        return
    review = cluster.entry(key)["admission_review"]["request"]["object"]
    if wanted.get("scheduler") is None:
        assert "patch" not in answer, f"{key}: HAMi leaves this pod alone; Tessera patched it"
        return
    pod = cluster.pods[key]
    assert pod["spec"]["schedulerName"] == wanted["scheduler"]
    gpu = "nvidia.com/gpu"
    added = []
    for before, after in zip(review["spec"]["containers"], pod["spec"]["containers"], strict=True):
        had = gpu in (before.get("resources") or {}).get("limits", {})
        has = (after.get("resources") or {}).get("limits", {}).get(gpu)
        if not had and has is not None:
            assert has == "1", (key, after["name"], has)
            added.append(after["name"])
    assert sorted(added) == sorted(wanted.get("add_gpu_count", [])), key


def check_filter(
    cluster: Cluster, key: str, result: dict[str, Any], expect: dict[str, Any]
) -> None:
    feasible = sorted(cluster.short(n) for n in result.get("NodeNames") or [])
    assert feasible == sorted(expect["feasible"]), (key, result)
    failed = {
        **(result.get("FailedNodes") or {}),
        **(result.get("FailedAndUnresolvableNodes") or {}),
    }
    for name in cluster.node_names(key):
        if cluster.short(name) not in feasible:
            assert failed.get(name), f"{key}: {name} is refused without a reason: {result}"


def card_allowed(pod: dict[str, Any], card: str, model: str) -> bool:
    annotations = pod["metadata"].get("annotations") or {}

    def split(key: str) -> list[str]:
        return [v.strip().lower() for v in annotations.get(key, "").split(",") if v.strip()]

    model_l = model.lower()
    use, nouse = split("nvidia.com/use-gputype"), split("nvidia.com/nouse-gputype")
    if use and not any(t in model_l for t in use):
        return False
    if any(t in model_l for t in nouse):
        return False
    uuids, no_uuids = split("nvidia.com/use-gpuuuid"), split("nvidia.com/nouse-gpuuuid")
    if uuids and card.lower() not in uuids:
        return False
    return card.lower() not in no_uuids


def check_allocation(
    cluster: Cluster, key: str, pod: dict[str, Any], record: dict[str, Any], expect: dict[str, Any]
) -> None:
    wanted = expect["containers"]
    got = {(c["name"], c["init"]): c for c in record["containers"]}
    assert sorted(got) == sorted((c["name"], c["init"]) for c in wanted), (key, record)
    for want in wanted:
        container = got[(want["name"], want["init"])]
        cards = [d["uuid"] for d in container["devices"]]
        assert len(cards) == len(set(cards)) == want["gpus"], (key, want["name"], cards)
        for device in container["devices"]:
            uuid_ = device["uuid"]
            total = cluster.card_mib[uuid_]
            assert card_allowed(pod, uuid_, cluster.card_model[uuid_]), (key, uuid_)
            memory = want["memory"]
            if "mib" in memory:
                expected_mib = memory["mib"]
            elif "percent" in memory:
                expected_mib = total * memory["percent"] // 100
            else:
                expected_mib = total
            assert device["memory_mib"] == expected_mib, (key, want["name"], device)
            if want.get("exclusive_default"):
                # HAMi books 100 % for a whole card asked without cores; Tessera books 0 (no
                # limit) on a whole card: either way nothing else can have that card.
                assert device["cores"] == 100 or (
                    device["cores"] == 0 and device["memory_mib"] == total
                ), (key, device)
            else:
                assert device["cores"] == want["cores"], (key, want["name"], device)


def cards_of(record: dict[str, Any]) -> set[str]:
    return {d["uuid"] for c in record["containers"] for d in c["devices"]}


def copy_for(pod: dict[str, Any], suffix: str) -> dict[str, Any]:
    """Another pod of the same shape (a ReplicaSet's next replica): own name and uid."""
    twin = copy.deepcopy(pod)
    twin["metadata"]["name"] = f"{pod['metadata']['name']}-{suffix}"
    twin["metadata"]["uid"] = str(uuid.uuid5(uuid.NAMESPACE_URL, twin["metadata"]["name"]))
    return twin


# --------------------------------------------------------------------------- the test


def run_case(case: dict[str, Any]) -> Iterator[str]:
    """Drive the case's steps; yields a line per step for the failure message."""
    cluster = Cluster(case)
    cluster.report_inventory()
    expect = case["expect"]
    for entry in case["pods"]:
        cluster.admit(entry["key"])
        check_admission(cluster, entry["key"], expect[entry["key"]])
        yield f"admission {entry['key']}: {cluster.admissions[entry['key']]['allowed']}"
    for step in case["steps"]:
        key, op = step["pod"], step["op"]
        want = expect[key]
        if want.get("feasible") is None:
            # Denied, or another scheduler's: kube-scheduler never asks Tessera about it.
            assert not want["admission"]["allowed"] or want["admission"]["scheduler"] is None
            continue
        if op == "filter":
            result = cluster.filter(key)
            check_filter(cluster, key, result, want)
            cluster.feasible[key] = sorted(result.get("NodeNames") or [])
        elif op == "prioritize":
            scores = cluster.prioritize(key, cluster.feasible[key])
            best = max(scores.values())
            top = [cluster.short(h) for h, s in scores.items() if s == best]
            assert top == [step["top"]], (key, scores)
        elif op == "bind":
            node = cluster.node(step["node"])
            record = cluster.bind(key, cluster.pods[key], node)
            check_allocation(cluster, key, cluster.pods[key], record, want)
            cluster.records[key] = record
            if "same_card_as" in step:
                assert cards_of(record) == cards_of(cluster.records[step["same_card_as"]]), key
            if "other_card_than" in step:
                assert not cards_of(record) & cards_of(cluster.records[step["other_card_than"]])
        elif op == "bind_each":
            if want.get("not_ours"):
                continue  # no managed resource: the default binder's, not Tessera's
            for short in want["feasible"]:
                twin = copy_for(cluster.pods[key], short)
                result = cluster.filter(key, twin)
                assert cluster.node(short) in (result.get("NodeNames") or []), (key, short)
                record = cluster.bind(key, twin, cluster.node(short))
                check_allocation(cluster, key, twin, record, want)
        else:
            raise AssertionError(f"unknown step {op!r} in {case['id']}")
        yield f"{op} {key}: ok"


@needs_corpus
def test_the_corpus_is_whole() -> None:
    assert len(case_ids()) == CASES, f"{len(case_ids())} cases in {CORPUS}, expected {CASES}"


@needs_corpus
@pytest.mark.parametrize("case_id", case_ids() or ["none"])
def test_hami_case(case_id: str) -> None:
    case = load(case_id)
    done: list[str] = []
    try:
        for line in run_case(case):
            done.append(line)
    except AssertionError as exc:
        raise AssertionError(
            f"{case_id} ({case['title']}), after: {'; '.join(done) or 'nothing'}\n{exc}"
        ) from exc


@needs_corpus
def test_the_scheduler_ignores_what_hami_users_ask_of_it() -> None:
    """A managed resource kube-scheduler must not count (no node advertises it), or the pod
    would stay Pending: the reviewed scheduler profile lists every one the corpus names."""
    profile = yaml.safe_load((ROOT / "deploy/scheduler/scheduler-config.yaml").read_text())
    (extender,) = profile["extenders"]
    ignored = {r["name"] for r in extender["managedResources"] if r["ignoredByScheduler"]}
    named = {
        name
        for case_id in case_ids()
        for want in load(case_id)["expect"].values()
        for name in want.get("scheduler_ignores", [])
    }
    assert named, "the corpus names resources the scheduler must ignore"
    assert named <= ignored, f"not ignored by kube-scheduler: {sorted(named - ignored)}"
