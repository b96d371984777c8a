"""The role check of the schema sweep, loaded by the schemathesis process (SCHEMATHESIS_HOOKS).

tests/api/test_schemathesis.py starts one schemathesis run per role and says in the environment
whose credentials the run sends: TESSERA_SWEEP_ROLE, TESSERA_SWEEP_AUTHORIZATION (the exact
header; empty for no credentials), TESSERA_SWEEP_NODE (the node identity's own node),
TESSERA_SWEEP_FOREIGN_PODS (UIDs of pods bound on other nodes, comma-separated) and
TESSERA_SWEEP_TALLY (where to write what the check saw, for the test to assert on).

Every answer is judged against tests/api/role_matrix.py by the credentials the request really
carried: a request schemathesis sent without them, or with others (its auth checks do), is judged
as one without credentials. At the end of the run every operation must have shown its boundary
at least once: refused where the role may not call it, let past the role check where it may (a
node identity on a path-scoped operation, both: its own node let past, another refused).
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path
from typing import Any

import schemathesis

from tests.api.role_matrix import (
    MATRIX,
    NONE,
    Answer,
    access_of,
    let_past,
    must_show,
    route_parameters,
    violation,
)

ROLE = os.environ["TESSERA_SWEEP_ROLE"]
AUTHORIZATION = os.environ.get("TESSERA_SWEEP_AUTHORIZATION", "")
OWN_NODE = os.environ.get("TESSERA_SWEEP_NODE", "")
FOREIGN_PODS = frozenset(filter(None, os.environ.get("TESSERA_SWEEP_FOREIGN_PODS", "").split(",")))
TALLY = Path(os.environ["TESSERA_SWEEP_TALLY"])
REFUSALS = {401, 403}


def _body(response: Any) -> object:
    try:
        return json.loads(response.content or b"null")
    except ValueError:
        return None


@schemathesis.check
class RoleBoundary:
    """The documented role matrix holds for every answer of the run."""

    def __init__(self) -> None:
        # Operations of the table, as labels, that answered the run's own role with the role
        # check passed / with a refusal. Sets: schemathesis may show this check the same answer
        # again while it shrinks or replays a case.
        self.passed: set[str] = set()
        self.refused: set[str] = set()
        self.judged: Counter[str] = Counter()

    def after_response(self, ctx: Any, response: Any, case: Any) -> None:
        request = response.request
        method = request.method  # checks may send another method than the case's
        parameters = route_parameters(case.path, request.url)
        ok = 200 <= response.status_code < 300
        if access_of((method, case.path)) is None or parameters is None:
            # A method the path does not document, or a path that never reached the route
            if ok:
                raise AssertionError(f"{method} {request.url} is no operation, yet answered 2xx")
            return
        sent = request.headers.get("Authorization", "")
        role = ROLE if AUTHORIZATION and sent == AUTHORIZATION else NONE
        answer = Answer(role, response.status_code, parameters, _body(response) if ok else None)
        operation = (method, case.path)
        self.judged[role] += 1
        if role == ROLE and operation in MATRIX:
            label = f"{method} {case.path}"
            if let_past(operation, answer, OWN_NODE):
                self.passed.add(label)
            if response.status_code in REFUSALS:
                self.refused.add(label)
        problem = violation(operation, answer, OWN_NODE, FOREIGN_PODS)
        if problem is not None:
            raise AssertionError(f"Role violation: {problem}")

    def after_run(self, ctx: Any) -> None:
        unshown = []
        for method, path in sorted(MATRIX):
            label = f"{method} {path}"
            passes, refuses = must_show(ROLE, (method, path))
            if passes and label not in self.passed:
                unshown.append(f"{label}: never let past the role check")
            if refuses and label not in self.refused:
                unshown.append(f"{label}: never refused")
        TALLY.write_text(
            json.dumps(
                {
                    "role": ROLE,
                    "judged": dict(self.judged),
                    "passed": sorted(self.passed),
                    "refused": sorted(self.refused),
                }
            )
        )
        if unshown:
            raise AssertionError("Role boundary not shown: " + "; ".join(unshown))
