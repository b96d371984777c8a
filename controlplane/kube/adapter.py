"""The getters: the Kubernetes adapter and the reconciler's cluster source for this process.

`settings.TESSERA["KUBE_MODE"]` picks a real API server (kubeconfig or in-cluster) or the
embedded stand-in. Tests replace `get_kube` (monkeypatch), not HTTP.
"""

from __future__ import annotations

import threading

from django.conf import settings

from controlplane.kube.base import Kube
from controlplane.kube.embedded import EmbeddedClusterSource, EmbeddedKube
from controlplane.kube.real import RealClusterSource, RealKube
from controlplane.kube.sources import ClusterSource

_lock = threading.Lock()
_instances: dict[str, Kube] = {}


def get_kube() -> Kube:
    """The adapter for `settings.TESSERA["KUBE_MODE"]`, one per process (tests replace this)."""
    mode = settings.TESSERA["KUBE_MODE"]
    found = _instances.get(mode)
    if found is None:
        with _lock:
            found = _instances.get(mode)
            if found is None:
                found = (
                    EmbeddedKube()
                    if mode == "embedded"
                    else RealKube(mode, settings.TESSERA.get("KUBECONFIG", ""))
                )
                _instances[mode] = found
    return found


def cluster_source() -> ClusterSource:
    """The reconciler's ClusterSource for the configured cluster (or the stand-in)."""
    kube = get_kube()
    if isinstance(kube, EmbeddedKube):
        return EmbeddedClusterSource(kube)
    if isinstance(kube, RealKube):
        return RealClusterSource(kube)
    raise TypeError(f"no cluster source for {type(kube).__name__}")
