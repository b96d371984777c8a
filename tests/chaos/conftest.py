"""The chaos run (e2e/chaos.py) as a test: selected only by `-m chaos`.

It brings up a cluster, a PostgreSQL and a Redis of its own and runs for minutes, so a plain
`pytest` (and `-m e2e`) leaves it out; `make test` runs it once, in a step of its own, and
`make chaos` runs it by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if HERE in Path(str(item.fspath)).parents]
    for item in ours:
        item.add_marker(pytest.mark.chaos)
    if "chaos" not in (config.option.markexpr or ""):
        config.hook.pytest_deselected(items=ours)
        items[:] = [item for item in items if item not in ours]
