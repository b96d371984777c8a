from __future__ import annotations

import json
from typing import Any

import pytest

from nodeplugin import allocation as al

KEY = b"0123456789abcdef0123"


def rec(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "v": 1,
        "pod_uid": "uid-1",
        "namespace": "ns",
        "name": "p",
        "node": "n1",
        "containers": [
            {
                "name": "app",
                "index": 0,
                "init": False,
                "devices": [{"uuid": "GPU-a", "memory_mib": 100, "cores": 20}],
            }
        ],
    }
    base.update(over)
    return base


def raw(data: dict[str, Any]) -> str:
    return json.dumps(data, separators=(",", ":"), sort_keys=True)


def test_parses_a_record() -> None:
    a = al.parse(rec())
    assert a.container("app") == al.ContainerAllocation(
        "app", 0, False, (al.SliceDevice("GPU-a", 100, 20),)
    )
    assert a.container("nope") is None


def test_kubelet_order_puts_init_first() -> None:
    cs = [
        {
            "name": "b",
            "index": 1,
            "init": False,
            "devices": [{"uuid": "G", "memory_mib": 1, "cores": 0}],
        },
        {
            "name": "i1",
            "index": 1,
            "init": True,
            "devices": [{"uuid": "G", "memory_mib": 1, "cores": 0}],
        },
        {
            "name": "a",
            "index": 0,
            "init": False,
            "devices": [{"uuid": "G", "memory_mib": 1, "cores": 0}],
        },
        {
            "name": "i0",
            "index": 0,
            "init": True,
            "devices": [{"uuid": "G", "memory_mib": 1, "cores": 0}],
        },
    ]
    assert [c.name for c in al.parse(rec(containers=cs)).kubelet_order()] == ["i0", "i1", "a", "b"]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "must be a JSON object"),
        (rec(v=2), "version v=2"),
        (rec(v=True), "v must be an integer"),
        (rec(containers=[]), "containers is empty"),
        (rec(namespace=""), "namespace is empty"),
        (rec(pod_uid=3), "pod_uid must be a str"),
        (rec(containers=[{"name": "a", "index": 0, "init": False, "devices": []}]), "1..16 slices"),
        (
            rec(containers=[{"name": "a", "index": 0, "init": "no", "devices": []}]),
            "init must be a bool",
        ),
        (
            rec(
                containers=[
                    {
                        "name": "a",
                        "index": 0,
                        "init": False,
                        "devices": [{"uuid": "G", "memory_mib": -5, "cores": 0}],
                    }
                ]
            ),
            "memory_mib=-5",
        ),
        (
            rec(
                containers=[
                    {
                        "name": "a",
                        "index": 0,
                        "init": False,
                        "devices": [{"uuid": "G", "memory_mib": 5, "cores": 101}],
                    }
                ]
            ),
            "cores=101",
        ),
        (
            rec(
                containers=[
                    {
                        "name": "a",
                        "index": 0,
                        "init": False,
                        "devices": [
                            {"uuid": "G", "memory_mib": 5, "cores": 1},
                            {"uuid": "G", "memory_mib": 5, "cores": 1},
                        ],
                    }
                ]
            ),
            "repeats a card",
        ),
        (
            rec(
                containers=[
                    {
                        "name": "a",
                        "index": 0,
                        "init": False,
                        "devices": [{"memory_mib": 5, "cores": 1}],
                    }
                ]
            ),
            "containers[0].devices[0].uuid is missing",
        ),
    ],
)
def test_malformed_records_name_the_field(data: Any, message: str) -> None:
    with pytest.raises(al.AllocationError) as err:
        al.parse(data)
    assert message in str(err.value)


def with_priority(value: Any) -> dict[str, Any]:
    c = dict(rec()["containers"][0], priority=value)
    return rec(containers=[c])


@pytest.mark.parametrize("value", [0, 1])
def test_priority_is_read_when_the_pod_asked_for_it(value: int) -> None:
    app = al.parse(with_priority(value)).container("app")
    assert app is not None and app.priority == value


def test_no_priority_key_means_the_pod_did_not_ask() -> None:
    app = al.parse(rec()).container("app")
    assert app is not None and app.priority is None


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (2, "containers[0].priority=2 is not 0..1"),
        (-1, "containers[0].priority=-1 is not 0..1"),
        (True, "containers[0].priority must be an integer"),
        ("0", "containers[0].priority must be an integer"),
        (None, "containers[0].priority must be an integer"),
        (0.0, "containers[0].priority must be an integer"),
    ],
)
def test_malformed_priority_is_refused(value: Any, message: str) -> None:
    with pytest.raises(al.AllocationError) as err:
        al.parse(with_priority(value))
    assert message in str(err.value)


def test_not_json() -> None:
    with pytest.raises(al.AllocationError, match="not JSON"):
        al.parse_bytes(b"{nope")
    with pytest.raises(al.AllocationError, match="larger than"):
        al.parse_bytes(b" " * (al.MAX_RECORD_BYTES + 1))


def test_signature_round_trip_and_forgeries() -> None:
    value = raw(rec())
    sig = al.sign(value, KEY)
    assert sig.startswith("v1:") and "=" not in sig
    assert al.from_annotations(
        {al.ANNOTATION: value, al.SIGNATURE_ANNOTATION: sig}, KEY
    ) == al.parse(rec())
    tampered = value.replace('"memory_mib":100', '"memory_mib":99999')
    for ann in (
        {al.ANNOTATION: tampered, al.SIGNATURE_ANNOTATION: sig},
        {al.ANNOTATION: value},
        {al.ANNOTATION: value, al.SIGNATURE_ANNOTATION: al.sign(value, b"x" * 20)},
        {al.ANNOTATION: value, al.SIGNATURE_ANNOTATION: sig[3:]},
    ):
        with pytest.raises(al.AllocationError, match="not signed"):
            al.from_annotations(ann, KEY)
    assert not al.verify(value, sig, b"")
    assert al.from_annotations({}, KEY) is None
    with pytest.raises(al.AllocationError, match="missing"):
        al.from_annotations({al.SIGNATURE_ANNOTATION: sig}, KEY)


def test_identity_checks() -> None:
    a = al.parse(rec())
    al.check_identity(a, "ns", "p", "n1")
    with pytest.raises(al.AllocationError, match="is for pod ns/p"):
        al.check_identity(a, "ns", "other", "n1")
    with pytest.raises(al.AllocationError, match="on node 'n1'"):
        al.check_identity(a, "ns", "p", "n2")


def test_records_the_control_plane_signs_verify_here() -> None:
    """Cross-check with the extender's own code (controlplane/extender/allocation.py)."""
    from controlplane.ledger import allocation

    key = b"a-32-byte-test-key-for-tessera!!"
    record = allocation.allocation_record(
        "uid-9",
        "team-a",
        "trainer",
        "n1",
        [
            allocation.ContainerAllocation(
                "app",
                0,
                False,
                (allocation.Device("GPU-b", 1, 2000, 30), allocation.Device("GPU-a", 0, 1000, 0)),
            ),
            allocation.ContainerAllocation(
                "setup", 0, True, (allocation.Device("GPU-a", 0, 500, 0),)
            ),
        ],
    )
    value = allocation.encode(record)
    parsed = al.from_annotations(
        {al.ANNOTATION: value, al.SIGNATURE_ANNOTATION: allocation.sign(value, key)}, key
    )
    assert parsed is not None
    assert al.sign(value, key) == allocation.sign(value, key)
    assert [c.name for c in parsed.kubelet_order()] == ["setup", "app"]
    app = parsed.container("app")
    assert app is not None
    assert [d.uuid for d in app.devices] == ["GPU-a", "GPU-b"]  # by card index
    al.check_identity(parsed, "team-a", "trainer", "n1")


def test_a_sidecar_is_an_init_container_the_record_marks() -> None:
    side = dict(rec()["containers"][0], name="proxy", init=True, sidecar=True)
    parsed = al.parse(rec(containers=[side, rec()["containers"][0]]))
    proxy, app = parsed.container("proxy"), parsed.container("app")
    assert proxy is not None and proxy.sidecar and proxy.init
    assert app is not None and not app.sidecar


@pytest.mark.parametrize(
    ("container", "message"),
    [
        ({"init": False, "sidecar": True}, "only an init container can be a sidecar"),
        ({"init": True, "sidecar": "yes"}, "containers[0].sidecar must be a bool"),
        ({"init": True, "sidecar": 1}, "containers[0].sidecar must be a bool"),
    ],
)
def test_malformed_sidecar_flags_are_refused(container: dict[str, Any], message: str) -> None:
    with pytest.raises(al.AllocationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        al.parse(rec(containers=[dict(rec()["containers"][0], **container)]))


def dev(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"uuid": "GPU-a", "memory_mib": 40192, "cores": 42}
    d.update(over)
    return {k: v for k, v in d.items() if v is not None}


def with_device(d: dict[str, Any]) -> dict[str, Any]:
    return rec(containers=[{"name": "app", "index": 0, "init": False, "devices": [d]}])


MIG_3G = {"profile": "3g.40gb", "start": 4, "size": 4}


@pytest.mark.parametrize(
    ("device", "want"),
    [
        (dev(), al.SliceDevice("GPU-a", 40192, 42)),
        (
            dev(mode="mig", mig=MIG_3G),
            al.SliceDevice("GPU-a", 40192, 42, "mig", al.MigPlacement("3g.40gb", 4, 4)),
        ),
        (dev(mode="mps"), al.SliceDevice("GPU-a", 40192, 42, "mps")),
        (dev(mode="exclusive"), al.SliceDevice("GPU-a", 40192, 42, "exclusive")),
        (
            dev(mode="mig", mig={"profile": "1g.10gb+me", "start": 6, "size": 1}),
            al.SliceDevice("GPU-a", 40192, 42, "mig", al.MigPlacement("1g.10gb+me", 6, 1)),
        ),
    ],
)
def test_device_modes_are_read(device: dict[str, Any], want: al.SliceDevice) -> None:
    (got,) = al.parse(with_device(device)).containers[0].devices
    assert got == want


@pytest.mark.parametrize(
    ("device", "message"),
    [
        (dev(mode="vgpu"), "devices[0].mode='vgpu' is not one of shared, mig, mps, exclusive"),
        (dev(mode=3), "devices[0].mode must be a str"),
        (dev(mode="mig"), "devices[0].mig is missing"),
        (dev(mode="mig", mig="3g.40gb"), "devices[0].mig must be a dict"),
        (dev(mode="mig", mig={"start": 4, "size": 4}), "devices[0].mig.profile is missing"),
        (dev(mode="mig", mig={**MIG_3G, "start": "4"}), "devices[0].mig.start must be an integer"),
        (dev(mode="mig", mig={**MIG_3G, "size": True}), "devices[0].mig.size must be an integer"),
        (dev(mode="mig", mig={**MIG_3G, "size": 0}), "devices[0].mig.size=0 does not fit"),
        (dev(mode="mig", mig={**MIG_3G, "start": -1}), "devices[0].mig.start=-1 is not"),
        (dev(mode="mig", mig={**MIG_3G, "size": 64}), "devices[0].mig.size=64 does not fit"),
        (
            dev(mode="mig", mig={**MIG_3G, "profile": "../../x"}),
            "devices[0].mig.profile='../../x' is not a MIG profile name",
        ),
        (dev(mode="mig", mig={**MIG_3G, "gi": 1}), "devices[0].mig.gi is not a MIG placement"),
        (dev(mig=MIG_3G), "devices[0].mig is set on a device of mode 'shared'"),
        (dev(mode="mps", mig=MIG_3G), "devices[0].mig is set on a device of mode 'mps'"),
        (dev(mode="exclusive", mig=MIG_3G), "mig is set on a device of mode 'exclusive'"),
    ],
)
def test_bad_mode_and_mig_fields_are_refused_naming_the_field(
    device: dict[str, Any], message: str
) -> None:
    with pytest.raises(al.AllocationError) as err:
        al.parse(with_device(device))
    assert message in str(err.value)
    assert "containers[0]." in str(err.value)


@pytest.mark.parametrize(
    ("resident", "oversubscribed"), [(1, True), (20096, True), (40191, True), (40192, False)]
)
def test_a_resident_part_is_read(resident: int, oversubscribed: bool) -> None:
    (got,) = al.parse(with_device(dev(resident_mib=resident))).containers[0].devices
    assert got == al.SliceDevice("GPU-a", 40192, 42, resident_mib=resident)
    assert got.oversubscribed is oversubscribed


def test_no_resident_part_means_the_slice_is_held_in_full() -> None:
    (got,) = al.parse(with_device(dev())).containers[0].devices
    assert got.resident_mib is None and not got.oversubscribed


@pytest.mark.parametrize(
    ("resident", "message"),
    [
        (0, "devices[0].resident_mib=0 is not 1..memory_mib (40192)"),
        (-5, "devices[0].resident_mib=-5 is not 1..memory_mib (40192)"),
        (40193, "devices[0].resident_mib=40193 is not 1..memory_mib (40192)"),
        ("20096", "devices[0].resident_mib must be an integer"),
        (20096.0, "devices[0].resident_mib must be an integer"),
        (True, "devices[0].resident_mib must be an integer"),
        ([20096], "devices[0].resident_mib must be an integer"),
    ],
)
def test_a_bad_resident_part_is_refused_naming_the_field(resident: Any, message: str) -> None:
    with pytest.raises(al.AllocationError) as err:
        al.parse(with_device(dev(resident_mib=resident)))
    assert message in str(err.value)
    assert "containers[0]." in str(err.value)
