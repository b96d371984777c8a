"""A real-node component that fails stops the harness with a message naming it, and leaves no
process of the run behind (as the harness's own components do, tests/e2e/test_harness.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from e2e import images
from e2e.cluster import ApiServerOnly, Options
from e2e.harness import HarnessError, build_binaries, run_folder
from e2e.node import LOCK_FILE, RealNodeCluster
from e2e.processes import processes_of_run


class NodeOnApiServer(RealNodeCluster, ApiServerOnly):
    """The real node on the harness's etcd and kube-apiserver alone (all the kubelet needs):
    the failures below happen in the node's components, so the rest need not start."""


@pytest.fixture(scope="module")
def binaries() -> dict[str, Path]:
    try:
        return build_binaries()
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.mark.parametrize("component", ["registry", "containerd", "kubelet"])
def test_a_component_that_dies_at_start_is_named(
    binaries: dict[str, Path], component: str, tmp_path: Path
) -> None:
    dying = tmp_path / component
    dying.write_text("#!/bin/sh\necho 'stand-in failing on purpose' >&2\nexit 3\n")
    dying.chmod(0o755)
    harness = NodeOnApiServer(
        Options(run_dir=run_folder("run-realnode-fail"), binaries={**binaries, component: dying})
    )
    with pytest.raises(HarnessError) as failure:
        harness.up()
    message = str(failure.value)
    assert message.startswith(f"{component} exited with code 3 before it was ready"), message
    assert "stand-in failing on purpose" in message  # the end of its log
    assert processes_of_run(harness.state["run_id"]) == []
    # The node's lock is free again: the next real node can start.
    assert LOCK_FILE.read_text() == ""


def test_an_image_that_cannot_be_built_is_named() -> None:
    with pytest.raises(images.ImageError) as failure:
        images.build(("no-such-image",))
    assert str(failure.value).startswith("image build: images/build.sh no-such-image failed")
