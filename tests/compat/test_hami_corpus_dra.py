"""HAMi's corpus in DRA mode: every manifest through the real webhook with `TESSERA_MODE=dra`,
the claims it is given checked against the outcome HAMi gives it (``../shared/compat/hami/``,
read where it lies, as ``test_hami_corpus.py`` reads it).

Per case: the nodes report their inventory (so the webhook judges asks against the cards); each
pod is admitted as the API server sends it; the ResourceClaimTemplates the webhook creates (in a
fake API server) are read back per container and compared with HAMi's devices, memory and cores.
Where HAMi's outcome is a set of feasible nodes, the claims are allocated against the case's
cards as kube-scheduler's allocator does with Tessera's ResourceSlices (docs/dra.md section 2:
consumable memory, compute and slots per shared card, the claim's CEL selectors and
constraints), in the case's order of steps.

What differs is pinned exactly (``DIFFERENCES``): the migration guide lists the same cases with
the reason (docs/migrating-from-hami.md, *DRA mode*). A case that starts to match, or to differ
in another way, fails the test.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from controlplane.extender.dra_translate import DEVICE_CLASSES, DRIVER
from controlplane.kube import adapter
from tests.compat.test_hami_corpus import Cluster, case_ids, load, needs_corpus
from tests.extender.dra_pods import apply_json_patch, claims_by_container, decode_patch

pytestmark = pytest.mark.django_db

SLOTS = 10  # TESSERA_SLOTS' default: a shared card's slots capacity

#: case -> why DRA mode's outcome differs from HAMi's (docs/migrating-from-hami.md, DRA mode).
DIFFERENCES: dict[str, str] = {
    # a card whose compute is all booked still takes a 0 % claim (consumable capacity has no
    # "full" rule)
    "c01": "feasible cuda-sample-vector-add: ['a100', 'h200', 'mixed', 'rtx'] "
    "(HAMi: ['a100', 'mixed', 'rtx'])",
    # binpack/spread across nodes and cards: kube-scheduler's own scoring decides
    "d01": "node choice: kube-scheduler's",
    "d02": "node choice: kube-scheduler's",
    "d03": "card choice: kube-scheduler's",
    "d04": "card choice: kube-scheduler's",
    # an init container's claim is held beside the app container's for the pod's life
    "d05": "feasible model-server: ['a100', 'h200', 'mixed'] "
    "(HAMi: ['a100', 'a10solo', 'h200', 'mixed'])",
    "h04": "refused: priority",
    # a percentage of several GPUs: one alternative per card size, so all on cards of one size
    "h12": "feasible gpu-pod: ['a100', 'rtx'] (HAMi: ['a100', 'mixed', 'rtx'])",
    "h14": "feasible vllm-cross-vgpu: ['a100', 'rtx'] (HAMi: ['a100', 'mixed', 'rtx'])",
    "w03": "feasible gpu-pod: ['a100', 'rtx'] (HAMi: ['a100', 'mixed', 'rtx'])",
    "w09": "refused: mutex",
}


class Differs(Exception):
    """The case's outcome in DRA mode is not HAMi's; the message is the reason's key."""


class FakeApiServer:
    """Just what the webhook asks of the API server in DRA mode: templates."""

    mode = "fake"

    def __init__(self) -> None:
        self.templates: dict[tuple[str, str], dict[str, Any]] = {}

    def get_claim_template(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.templates.get((namespace, name))

    def create_claim_template(self, template: dict[str, Any]) -> dict[str, Any]:
        meta = template["metadata"]
        self.templates[(meta["namespace"], meta["name"])] = template
        return template


# --------------------------------------------------------------------------- the allocator


_CEL_NAMES = {
    f'device.attributes["{DRIVER}"].model.lowerAscii()': "model",
    f'device.attributes["{DRIVER}"].uuid.lowerAscii()': "uuid",
    f'device.attributes["{DRIVER}"].mode': "mode",
}
_MEMORY_VS = re.compile(
    re.escape(f'device.capacity["{DRIVER}"].memory.compareTo(quantity("') + r'(\d+)Mi"\)\)'
)


def cel_matches(expression: str, card: Card) -> bool:
    """The CEL the translation writes (substring, list membership, equality, a memory
    comparison, !, ||), read as Python over the card's attributes and capacity; anything else
    is a test failure, not a guess."""
    text = _MEMORY_VS.sub(r"(memory - \1)", expression)
    for cel, name in _CEL_NAMES.items():
        text = text.replace(cel, name)
    text = text.replace("||", " or ").replace("!(", " not (")
    text = re.sub(r"\.contains\(", ".__contains__(", text)
    assert re.fullmatch(r'[\w\s().,"\-\[\]=<>]*', text), f"not the translation's CEL: {expression}"
    names = {
        "model": card.model.lower(),
        "uuid": card.uuid.lower(),
        "mode": "shared",
        "memory": card.memory_mib,
    }
    return bool(eval(text, {"__builtins__": {}}, names))  # noqa: S307 (the test's own CEL subset)


@dataclass
class Card:
    """A card of the case's inventory, published shared, and what the claims placed on it
    consume of its memory, compute and slots."""

    uuid: str
    model: str
    memory_mib: int
    used_mib: int = 0
    used_compute: int = 0
    slots: int = 0


@dataclass
class Ask:
    """One alternative of a container's claim (its request, or one `firstAvailable`
    subrequest), as the allocator reads it."""

    device_class: str
    count: int
    memory_mib: int | None  # None: the request policy's default, the whole card
    compute: int
    selectors: list[str]
    card_mib: int | None = None  # only cards of this size (a memory percentage's alternative)

    @classmethod
    def of(cls, exact: dict[str, Any]) -> Ask:
        amounts = (exact.get("capacity") or {}).get("requests") or {}
        memory = amounts.get("memory")
        selectors = [s["cel"]["expression"] for s in exact.get("selectors") or []]
        sizes = [int(m) for e in selectors if e.endswith("== 0") for m in _MEMORY_VS.findall(e)]
        if exact["deviceClassName"] == DEVICE_CLASSES["mig"]:
            # a MIG placement is allocated whole: the ask is a placement at least that large
            (memory,) = [f"{m}Mi" for e in selectors for m in _MEMORY_VS.findall(e)]
        return cls(
            device_class=exact["deviceClassName"],
            count=exact["count"],
            memory_mib=int(memory.removesuffix("Mi")) if memory else None,
            compute=int(amounts.get("compute", "0")),
            selectors=selectors,
            card_mib=sizes[0] if sizes else None,
        )

    def need(self, card: Card) -> int:
        return card.memory_mib if self.memory_mib is None else self.memory_mib

    def fits(self, card: Card) -> bool:
        if self.device_class != DEVICE_CLASSES["hami-core"]:
            return False  # the corpus' cards are all shared: no MIG or MPS device is published
        return (
            card.used_mib + self.need(card) <= card.memory_mib
            and card.used_compute + self.compute <= 100
            and card.slots < SLOTS
            and all(cel_matches(s, card) for s in self.selectors)
        )

    def take(self, card: Card, sign: int = 1) -> None:
        card.used_mib += sign * self.need(card)
        card.used_compute += sign * self.compute
        card.slots += sign


#: One container's claim: its alternatives, in the order the allocator tries them.
Claim = list[Ask]


def claim_of(request: dict[str, Any]) -> Claim:
    if "firstAvailable" in request:
        return [Ask.of(sub) for sub in request["firstAvailable"]]
    return [Ask.of(request["exactly"])]


@dataclass
class Nodes:
    cards: dict[str, list[Card]] = field(default_factory=dict)

    def place(
        self,
        short: str,
        claims: list[Claim],
        only: set[str] | None = None,
        avoid: frozenset[str] = frozenset(),
    ) -> list[tuple[Ask, Card]] | None:
        """Allocate the pod's claims on node ``short``: per claim the first alternative that
        fits, on the first fitting distinct cards (the allocator tries devices in order); what
        was taken, or None (nothing taken) when it does not fit."""
        taken: list[tuple[Ask, Card]] = []
        for claim in claims:
            for ask in claim:
                chosen: list[Card] = []
                for card in self.cards[short]:
                    allowed = (only is None or card.uuid in only) and card.uuid not in avoid
                    if len(chosen) < ask.count and allowed and ask.fits(card):
                        chosen.append(card)  # distinct cards: the claim's distinctAttribute
                if len(chosen) == ask.count:
                    for card in chosen:
                        ask.take(card)
                        taken.append((ask, card))
                    break
            else:
                self.release(taken)
                return None
        return taken

    @staticmethod
    def release(taken: list[tuple[Ask, Card]]) -> None:
        for ask, card in taken:
            ask.take(card, -1)

    def feasible(self, claims: list[Claim]) -> list[str]:
        out = []
        for short in self.cards:
            placed = self.place(short, claims)
            if placed is not None:
                out.append(short)
                self.release(placed)
        return sorted(out)


# --------------------------------------------------------------------------- the pass


def admit(cluster: Cluster, kube: FakeApiServer, key: str) -> tuple[dict[str, Any], dict[str, Any]]:
    entry = cluster.entry(key)
    response = cluster.client.post(
        "/webhook/mutate", json.dumps(entry["admission_review"]), "application/json"
    )
    assert response.status_code == 200, response.content
    answer = response.json()["response"]
    pod = apply_json_patch(entry["admission_review"]["request"]["object"], decode_patch(answer))
    return answer, pod


def refusal_key(message: str) -> str:
    for needle, key in (
        ("mutex", "refused: mutex"),
        ("nvidia.com/priority", "refused: priority"),
        ("gpumem-percentage", "refused: gpumem-percentage"),
    ):
        if needle in message:
            return key
    return f"refused: {message}"


def check_claims(
    key: str, pod: dict[str, Any], kube: FakeApiServer, want: dict[str, Any]
) -> list[Claim]:
    """The pod's claims against HAMi's devices, memory and cores per container."""
    templates = {name: t["spec"] for (_, name), t in kube.templates.items()}
    per = claims_by_container(pod, templates)
    assert sorted(per) == sorted(c["name"] for c in want["containers"]), (key, sorted(per))
    wanted = {c["name"]: c for c in want["containers"]}
    claims = []
    for name, found in per.items():  # init containers first, as the pod lists its claims
        c = wanted[name]
        claim = claim_of(found["request"])
        for ask in claim:
            assert ask.count == c["gpus"], (key, name, ask)
            memory = c["memory"]
            if "mib" in memory:
                assert ask.memory_mib == memory["mib"], (key, name, ask)
            elif "percent" in memory and memory["percent"] != 100:
                # HAMi's floor(card MiB x percent / 100), on cards of the alternative's size
                assert ask.card_mib is not None, (key, name, ask)
                assert ask.memory_mib == ask.card_mib * memory["percent"] // 100, (key, ask)
            else:
                assert ask.memory_mib is None, (key, name, ask)  # the whole card
            if c.get("exclusive_default"):
                # HAMi books 100 % for a whole card asked without cores; the claim books the
                # whole card's memory and no compute share: nothing else fits there either way.
                assert ask.compute in (0, 100) and ask.memory_mib is None, (key, ask)
            else:
                assert ask.compute == c["cores"], (key, name, ask)
        claims.append(claim)
    return claims


def run_case(case: dict[str, Any], kube: FakeApiServer) -> str:
    """ "same", or the key of the first way the DRA outcome differs from HAMi's."""
    cluster = Cluster(case)
    cluster.report_inventory()
    nodes = Nodes(
        {
            short: [Card(c["uuid"], c["model"], c["memory_mib"]) for c in report["cards"]]
            for short, report in case["inventory"].items()
        }
    )
    expect = case["expect"]
    asks: dict[str, list[Claim]] = {}
    placed: dict[str, set[str]] = {}
    refused: dict[str, str] = {}
    for entry in case["pods"]:
        key = entry["key"]
        want = expect[key]
        answer, pod = admit(cluster, kube, key)
        if not answer["allowed"]:
            if want["admission"]["allowed"]:
                refused[key] = refusal_key(answer["status"]["message"])
            continue
        assert want["admission"]["allowed"], f"{key}: HAMi refuses it, DRA mode admitted it"
        if want["admission"].get("scheduler") is None or want.get("not_ours"):
            assert "patch" not in answer, f"{key}: HAMi leaves it alone; the webhook patched it"
            continue
        if "resourceClaims" not in pod["spec"]:
            assert not want.get("containers"), f"{key}: no claim for a GPU pod"
            continue
        asks[key] = check_claims(key, pod, kube, want)
    if refused:
        return next(iter(refused.values()))
    difference = ""
    for step in case["steps"]:
        key, op = step["pod"], step["op"]
        if key not in asks:
            continue
        if op == "filter":
            got = nodes.feasible(asks[key])
            if got != sorted(expect[key]["feasible"]):
                return f"feasible {key}: {got} (HAMi: {sorted(expect[key]['feasible'])})"
        elif op == "prioritize":
            difference = difference or "node choice: kube-scheduler's"
        elif op == "bind":
            relation = step.get("same_card_as") or step.get("other_card_than")
            if relation is not None:
                other = placed[relation]
                # kept only when no other placement exists: DRA does not apply the policy
                if "same_card_as" in step:
                    trial = nodes.place(step["node"], asks[key], avoid=frozenset(other))
                else:
                    trial = nodes.place(step["node"], asks[key], only=other)
                if trial is not None:
                    nodes.release(trial)
                    difference = difference or "card choice: kube-scheduler's"
            got = nodes.place(step["node"], asks[key])
            assert got is not None, (key, step)
            placed[key] = {card.uuid for _, card in got}
        elif op == "bind_each":
            for short in expect[key]["feasible"]:
                assert nodes.place(short, asks[key]) is not None, (key, short)
        else:
            raise AssertionError(f"unknown step {op!r}")
    return difference or "same"


def outcome(case_id: str, monkeypatch: pytest.MonkeyPatch, settings: Any) -> str:
    settings.TESSERA = {**settings.TESSERA, "MODE": "dra"}
    kube = FakeApiServer()
    monkeypatch.setattr(adapter, "get_kube", lambda: kube)
    return run_case(load(case_id), kube)


@needs_corpus
@pytest.mark.parametrize("case_id", case_ids() or ["none"])
def test_hami_case_in_dra_mode(
    case_id: str, monkeypatch: pytest.MonkeyPatch, settings: Any
) -> None:
    got = outcome(case_id, monkeypatch, settings)
    wanted = DIFFERENCES.get(case_id, "same")
    assert got == wanted, f"{case_id} ({load(case_id)['title']}): {got}"


@needs_corpus
def test_the_differences_are_the_migration_guides() -> None:
    """Every pinned difference is in the guide's DRA table, and nothing else is."""
    from tests.compat.test_hami_corpus import ROOT

    guide = (ROOT / "docs" / "migrating-from-hami.md").read_text()
    section = guide.split("## DRA mode", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `?([cdhtw]\d\d)`? \|", section, flags=re.M))
    assert listed == set(DIFFERENCES), sorted(listed ^ set(DIFFERENCES))
