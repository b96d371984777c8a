"""2,000 GPU pods while every part of the cluster is killed or restarted (e2e/chaos.py).

TESSERA_CHAOS_PODS (default 2000) and TESSERA_CHAOS_SEED (default: a new one, printed) choose
the run; the same seed replays the same pods, deletions and faults.
"""

from __future__ import annotations

import os

import pytest

from e2e import chaos
from e2e.harness import HarnessError


def test_chaos_loses_nothing_doubles_nothing_and_over_allocates_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    pods = int(os.environ.get("TESSERA_CHAOS_PODS") or 2000)
    seed = int(os.environ["TESSERA_CHAOS_SEED"]) if os.environ.get("TESSERA_CHAOS_SEED") else None
    with capsys.disabled():  # the timeline and the figures, in every run's output
        try:
            report = chaos.run(pods, seed)
        except HarnessError as exc:
            pytest.fail(f"the chaos cluster did not come up: {exc}", pytrace=False)
        print(report.render(), flush=True)
    assert report.kills.keys() >= set(chaos.KILLS), report.kills
    assert report.restarts.keys() >= set(chaos.RESTARTS), report.restarts
    assert report.created > 0 and report.bound > 0, report.render()
    violations = report.violations()
    assert not violations, f"seed {report.seed}:\n" + "\n".join(violations)
