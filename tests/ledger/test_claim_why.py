"""Tessera's answer for a claim that is not allocated, over the node plugins' own ResourceSlices
and the allocated claims' consumed capacity: room per card, the closest cards, what would make
it fit, the quota in the way."""

from __future__ import annotations

import pytest

from controlplane.ledger.claim_why import answer_claim, answer_request, card_rooms
from controlplane.ledger.services import quotas
from controlplane.ledger.services.quotas import QuotaLimitsInput
from controlplane.scheduling.claim_demand import parse_claim_spec
from nodeplugin.cards import Health
from tests.claim_builders import allocated, claim, claim_spec, device_request, published


def ask(**kw):
    (alternatives,) = parse_claim_spec(claim_spec(device_request(**kw))).requests
    return alternatives[0]


def test_card_rooms_subtract_the_allocated_claims_consumed_capacity() -> None:
    slices = published("n1", [24576, 16384]) + published("n2", [24576])
    claims = [
        allocated("a", "ns", "n1", "gpu-0", 8192, 30),
        allocated("b", "ns", "n1", "gpu-0", 4096, 50),
        allocated("c", "ns", "n2", "gpu-0", 20000, 10),
        claim("pending", "ns", device_request()),  # not allocated: holds nothing
    ]
    rooms = {(r.node, r.device): r for r in card_rooms(slices, claims)}
    assert set(rooms) == {("n1", "gpu-0"), ("n1", "gpu-1"), ("n2", "gpu-0")}
    n1 = rooms[("n1", "gpu-0")]
    assert (n1.uuid, n1.mode, n1.memory_mib) == ("GPU-n1-0", "shared", 24576)
    assert (n1.free_memory_mib, n1.free_compute, n1.free_slots) == (24576 - 12288, 20, 2)
    assert rooms[("n1", "gpu-1")].free_memory_mib == 16384
    assert rooms[("n2", "gpu-0")].free_memory_mib == 4576


def test_an_exclusive_card_is_taken_whole_by_one_allocation() -> None:
    slices = published("n1", [24576], modes={"GPU-n1-0": "exclusive"})
    whole = allocated("a", "ns", "n1", "gpu-0", 1, 0)
    result = whole["status"]["allocation"]["devices"]["results"][0]
    del result["consumedCapacity"]  # the allocator writes none for such a device
    (room,) = card_rooms(slices, [whole])
    assert (room.free_memory_mib, room.free_compute, room.free_slots) == (0, 0, 0)


def test_the_closest_cards_and_what_would_make_a_claim_fit() -> None:
    slices = published("n1", [24576, 16384]) + published("n2", [24576])
    claims = [
        allocated("a", "ns", "n1", "gpu-0", 16384, 10),
        allocated("c", "ns", "n2", "gpu-0", 12288, 10),
    ]
    rooms = card_rooms(slices, claims)
    answer = answer_request(ask(memory="20Gi"), rooms)
    assert (answer.candidates, answer.fitting) == (3, 0)
    # closest: the card with the most free memory first (n1 gpu-1: 16384 free of 16384)
    assert [(c.node, c.device) for c in answer.closest] == [
        ("n1", "gpu-1"), ("n2", "gpu-0"), ("n1", "gpu-0"),
    ]  # fmt: skip
    assert answer.to_fit == (
        "ask at most 16384 MiB, or wait until claims on gpu-1 (GPU-n1-1) on node n1 free 4096 MiB"
    )
    # within the room it fits, and the answer says the scheduler's reason is what stops it
    fits = answer_request(ask(memory="8Gi"), rooms)
    assert fits.fitting == 3 and fits.to_fit.startswith("3 card(s) hold it now")


def test_a_claim_that_fits_nowhere_because_no_card_is_that_large() -> None:
    rooms = card_rooms(published("n1", [24576]), [])
    answer = answer_request(ask(memory="40Gi", compute="50"), rooms)
    assert answer.fitting == 0
    assert answer.to_fit.startswith("ask at most 24576 MiB, or wait")


def test_unhealthy_cards_and_missing_classes_say_so() -> None:
    health = {"GPU-n1-0": Health(False, "XID 79")}
    rooms = card_rooms(published("n1", [24576], health=health), [])
    assert rooms[0].tainted
    tainted = answer_request(ask(memory="1Gi"), rooms)
    assert tainted.fitting == 0 and "tainted unhealthy" in tainted.to_fit
    mps = answer_request(ask(memory="1Gi", device_class="mps.gpu.tessera.io"), rooms)
    assert mps.candidates == 0 and "no node publishes a card of class" in mps.to_fit


def test_slots_run_out_before_memory() -> None:
    slices = published("n1", [24576], slots=2)
    claims = [allocated(n, "ns", "n1", "gpu-0", 1024, 0) for n in ("a", "b")]
    answer = answer_request(ask(memory="1Gi"), card_rooms(slices, claims))
    assert answer.fitting == 0
    assert answer.to_fit == "wait until claims on gpu-0 (GPU-n1-0) on node n1 free 1 slot"


@pytest.mark.django_db
def test_answer_claim_names_the_quota_in_the_way_counting_other_claims_only() -> None:
    quotas.set_quota("team-a", QuotaLimitsInput(gpumem_mib=10240), "test")
    waiting = claim("w", "team-a", device_request(memory="6Gi"), uid="uid-w")
    other = claim("o", "team-a", device_request(memory="5Gi"), uid="uid-o")
    rooms = card_rooms(published("n1", [24576]), [])
    answer = answer_claim(waiting, rooms, [waiting, other], 24576)
    assert not answer.allocated
    assert answer.quota == (
        "namespace team-a is over its GPU quota: "
        "GPU memory: 5120 MiB used + 6144 MiB requested > 10240 MiB limit"
    )
    assert "Quota: namespace team-a is over its GPU quota" in answer.text
    alone = answer_claim(waiting, rooms, [waiting], 24576)
    assert alone.quota == ""
    done = answer_claim(allocated("x", "team-a", "n1", "gpu-0", 1024, 0), rooms, [], 24576)
    assert done.allocated and done.text == "Claim x is allocated."
