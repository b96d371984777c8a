"""A ResourceClaim's spec in Tessera's quota units: what each request naming Tessera's classes
consumes, the request policy's defaults, lower bounds, and clear refusals of bad specs."""

from __future__ import annotations

import pytest

from controlplane.scheduling import QuotaUsage, RequestError
from controlplane.scheduling.claim_demand import (
    MIG_CLASS,
    MPS_CLASS,
    parse_claim_spec,
    parse_template_spec,
)
from tests.claim_builders import claim_spec, device_request, template

CAP = "spec.devices.requests[0].exactly.capacity.requests."
CARD = 24576  # the smallest card's MiB, what "the whole card" is valued at


def demand(*requests: dict) -> QuotaUsage:
    return parse_claim_spec(claim_spec(*requests)).demand(CARD)


def test_memory_and_compute_per_device_times_count() -> None:
    assert demand(device_request(count=2, memory="8Gi", compute="30")) == QuotaUsage(
        2 * 8192, 60, 2
    )


def test_no_capacity_named_takes_the_policy_defaults_whole_card_and_no_compute() -> None:
    assert demand(device_request()) == QuotaUsage(CARD, 0, 1)
    assert demand(device_request(compute="25")) == QuotaUsage(CARD, 25, 1)


def test_memory_rounds_up_to_whole_mib_at_least_one() -> None:
    assert demand(device_request(memory="1500Ki")) == QuotaUsage(2, 0, 1)
    assert demand(device_request(memory="0")) == QuotaUsage(1, 0, 1)
    assert demand(device_request(memory=str(5 * (1 << 20) + 1))) == QuotaUsage(6, 0, 1)


def test_other_classes_count_nothing_and_tessera_classes_add_up() -> None:
    spec = claim_spec(
        device_request("nic", "sriov.example.com"),
        device_request("a", memory="1Gi"),
        device_request("b", MPS_CLASS, memory="2Gi", compute="10"),
        device_request("c", MIG_CLASS, memory="10Gi"),
    )
    ask = parse_claim_spec(spec)
    assert [r[0].device_class for r in ask.requests] == [
        "gpu.tessera.io", MPS_CLASS, MIG_CLASS,
    ]  # fmt: skip
    assert ask.demand(CARD) == QuotaUsage(1024 + 2048 + 10240, 10, 3)
    assert not parse_claim_spec(claim_spec(device_request("nic", "other.example.com"))).tessera


def test_admin_access_consumes_nothing() -> None:
    assert demand(device_request(memory="8Gi", adminAccess=True)) == QuotaUsage()


def test_allocation_mode_all_counts_at_least_one_device() -> None:
    assert demand(device_request(memory="1Gi", allocationMode="All")) == QuotaUsage(1024, 0, 1)


def test_prioritized_list_counts_its_least_demanding_alternative() -> None:
    request = {
        "name": "gpu",
        "firstAvailable": [
            {"name": "big", "deviceClassName": "gpu.tessera.io", "count": 2,
             "capacity": {"requests": {"memory": "16Gi", "compute": "50"}}},
            {"name": "small", "deviceClassName": "gpu.tessera.io",
             "capacity": {"requests": {"memory": "4Gi", "compute": "60"}}},
        ],
    }  # fmt: skip
    assert demand(request) == QuotaUsage(4096, 60, 1)
    ask = parse_claim_spec(claim_spec(request))
    assert [a.request for a in ask.requests[0]] == ["gpu/big", "gpu/small"]
    # an alternative of another driver may be the one allocated: then nothing counts
    request["firstAvailable"].append({"name": "nic", "deviceClassName": "other.example.com"})
    assert demand(request) == QuotaUsage()


def test_a_template_reads_its_claim_spec() -> None:
    body = template("t", "ns", device_request(count=3, memory="2Gi"))
    assert parse_template_spec(body["spec"]).demand(CARD) == QuotaUsage(6144, 0, 3)


def test_empty_specs_ask_nothing() -> None:
    for spec in (None, {}, {"devices": {}}, {"devices": {"requests": []}}):
        assert not parse_claim_spec(spec).tessera


@pytest.mark.parametrize(
    ("request_", "field", "words"),
    [
        (device_request(compute="101"), CAP + "compute",
         "at most 100"),
        (device_request(compute="500m"), CAP + "compute",
         "whole number"),
        (device_request(memory="lots"), CAP + "memory",
         "not a Kubernetes quantity"),
        ({"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.io",
                                     "capacity": {"requests": {"slots": "2"}}}},
         CAP + "slots", "exactly one slot"),
        ({"name": "gpu", "exactly": {"deviceClassName": "gpu.tessera.io",
                                     "capacity": {"requests": {"bandwidth": "1"}}}},
         CAP + "bandwidth", "publish no capacity"),
        (device_request(count=0), "spec.devices.requests[0].exactly.count", "at least 1"),
        (device_request(allocationMode="Some"), "spec.devices.requests[0].exactly.allocationMode",
         "not ExactCount or All"),
        ({"name": "gpu"}, "spec.devices.requests[0]", "neither exactly nor firstAvailable"),
        ({"name": "gpu", "firstAvailable": []}, "spec.devices.requests[0].firstAvailable",
         "non-empty list"),
    ],
)  # fmt: skip
def test_bad_specs_are_refused_with_the_field_and_the_reason(
    request_: dict, field: str, words: str
) -> None:
    with pytest.raises(RequestError) as caught:
        parse_claim_spec(claim_spec(request_))
    assert caught.value.field == field
    assert words in caught.value.message


def test_a_bad_request_of_another_class_is_not_tessera_s_to_judge() -> None:
    other = device_request("nic", "other.example.com", compute="101")
    assert not parse_claim_spec(claim_spec(other)).tessera
