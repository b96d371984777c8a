"""The reconciler's grants in DRA mode: what mirroring ResourceClaims needs (docs/dra.md, "One
ledger for claims"), and nothing in extender mode."""

from __future__ import annotations

from tests.deploy.chart import render
from tests.deploy.test_helm import WORKER_RULES, effective_grants

CLAIM_RULES = {
    ("resource.k8s.io", "resourceclaims", "list,watch"),
    ("resource.k8s.io", "resourceslices", "list"),
}


def test_the_worker_reads_claims_and_slices_in_dra_mode_only() -> None:
    assert effective_grants(render(sets=("mode=dra",)))["worker"] == {*WORKER_RULES, *CLAIM_RULES}
    assert effective_grants(render())["worker"] == set(WORKER_RULES)
