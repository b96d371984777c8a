"""Plain builder functions for the Django-side tests."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from django.db import connections
from rest_framework.test import APIClient

from controlplane.access.roles import Role
from controlplane.access.services import create_token
from controlplane.ledger.services.nodes import CardReport, InventoryReport, apply_inventory


def card_report(uuid: str, index: int = 0, memory_mib: int = 81920, **kw: Any) -> CardReport:
    return CardReport(
        uuid=uuid,
        index=index,
        model=kw.get("model", "NVIDIA A100-SXM4-80GB"),
        memory_mib=memory_mib,
        numa_node=kw.get("numa_node", 0),
        healthy=kw.get("healthy", True),
        health_reason=kw.get("health_reason", ""),
    )


def make_node(name: str, cards: int = 2, memory_mib: int = 81920, **kw: Any):
    report = InventoryReport(
        plugin_version="test",
        cards=tuple(card_report(f"GPU-{name}-{i}", i, memory_mib, **kw) for i in range(cards)),
    )
    return apply_inventory(name, report, actor="test").node


def card_json(uuid: str = "GPU-aaaa-0", index: int = 0, **kw: Any) -> dict[str, Any]:
    card = {
        "uuid": uuid,
        "index": index,
        "model": "NVIDIA A100-SXM4-80GB",
        "memory_mib": 81920,
        "numa_node": 0,
        "healthy": True,
        "health_reason": "",
    }
    card.update(kw)
    return card


def token_client(username: str, role: Role) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {create_token(username, role)}")
    return client


def using_postgres() -> bool:
    return os.environ.get("DATABASE_URL", "").startswith(("postgres://", "postgresql://"))


def run_at_once(jobs: list[Callable[[], str]]) -> Counter[str]:
    """Start every job on its own thread (and so its own database connection) at the same
    instant; count the outcome each returns."""
    outcomes: Counter[str] = Counter()
    lock = threading.Lock()
    start = threading.Barrier(len(jobs))

    def worker(job: Callable[[], str]) -> None:
        try:
            start.wait()
            result = job()
            with lock:
                outcomes[result] += 1
        finally:
            connections.close_all()

    threads = [threading.Thread(target=worker, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return outcomes
