"""The extender's fake Kubernetes adapter and cache reset, for ledger tests that bind through
the extender's endpoints."""

from tests.extender.conftest import _fresh_snapshot_cache, fake_kube  # noqa: F401 - fixtures
