"""The generated protobuf message modules, built on first import when absent or stale.

``dp`` is the kubelet device plugin API (package ``v1beta1``), ``pr`` the PodResources API
(package ``v1``), ``dra`` the kubelet's DRA plugin API (``k8s.io.kubelet.pkg.apis.dra.v1``),
``reg`` the plugin registration API (``pluginregistration``). See :mod:`nodeplugin.build`.
"""

from __future__ import annotations

from nodeplugin.build import ensure_generated

ensure_generated()

from nodeplugin._generated.deviceplugin.v1beta1 import api_pb2 as dp  # noqa: E402
from nodeplugin._generated.dra.v1 import api_pb2 as dra  # noqa: E402
from nodeplugin._generated.pluginregistration.v1 import api_pb2 as reg  # noqa: E402
from nodeplugin._generated.podresources.v1 import api_pb2 as pr  # noqa: E402

__all__ = ["dp", "dra", "pr", "reg"]
