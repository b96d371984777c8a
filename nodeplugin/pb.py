"""The generated protobuf message modules, built on first import when absent or stale.

``dp`` is the kubelet device plugin API (package ``v1beta1``), ``pr`` the PodResources API
(package ``v1``). See :mod:`nodeplugin.build`.
"""

from __future__ import annotations

from nodeplugin.build import ensure_generated

ensure_generated()

from nodeplugin._generated.deviceplugin.v1beta1 import api_pb2 as dp  # noqa: E402
from nodeplugin._generated.podresources.v1 import api_pb2 as pr  # noqa: E402

__all__ = ["dp", "pr"]
