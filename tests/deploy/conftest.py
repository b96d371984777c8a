"""Fixtures of the Helm chart tests (helpers in chart.py): the pinned helm binary and, for the
tests marked e2e, a real kube-apiserver on loopback to install into."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from e2e.cluster import ApiServerOnly, Options
from e2e.harness import HarnessError, build_binaries, run_folder
from tests.deploy.chart import helm_path


@pytest.fixture(scope="session")
def helm() -> Path:
    try:
        return helm_path()
    except RuntimeError as exc:
        message = str(exc)
    pytest.fail(message, pytrace=False)


@pytest.fixture(scope="module")
def apiserver() -> Iterator[Any]:
    """etcd + kube-apiserver of the e2e harness on loopback (no scheduler, kwok or control plane:
    installing the chart needs only the API server). Its own run folder, so it never meets the
    e2e suite's session cluster."""
    try:
        binaries = build_binaries(("kube-apiserver",))
    except HarnessError as exc:
        pytest.fail(str(exc), pytrace=False)
    run = ApiServerOnly(Options(run_dir=run_folder("run-deploy"), binaries=binaries))
    try:
        run.up()
    except HarnessError as exc:
        pytest.fail(f"the API server did not come up: {exc}", pytrace=False)
    try:
        yield run
    finally:
        run.down(quiet=True)
