"""Hand-written gRPC plumbing for the kubelet's DRA plugin API (v1) and plugin registration
API (v1): service paths, server handlers, clients. As :mod:`nodeplugin.rpc` does for the
device plugin API, it keeps the wire names in one place and the servicers typed.

The service names are the pinned kubelet's (k8s.io/kubelet v0.37.2): the DRA service's full
name is its proto package plus ``DRAPlugin``; what a plugin lists in ``supported_versions``
is the shorter name the kubelet matches (``v1.DRAPlugin``, ``pkg/apis/dra/v1/types.go``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeAlias

import grpc
import grpc.aio

from nodeplugin.pb import dra, reg
from nodeplugin.rpc import _de, _ser

DRA_SERVICE = "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"
# What the pinned kubelet accepts in PluginInfo.supported_versions (servicesSupportedByKubelet
# in pkg/kubelet/cm/dra/plugin/dra_plugin.go lists v1.DRAPlugin and v1beta1.DRAPlugin).
DRA_SUPPORTED_VERSION = "v1.DRAPlugin"
REGISTRATION_SERVICE = "pluginregistration.Registration"
PLUGIN_TYPE = "DRAPlugin"  # pluginregistration/v1 constants.go

Context: TypeAlias = "grpc.aio.ServicerContext[Any, Any]"


class DraPluginServicer(Protocol):
    """What a DRA plugin implements; the kubelet is the only caller."""

    async def NodePrepareResources(
        self, request: dra.NodePrepareResourcesRequest, context: Context
    ) -> dra.NodePrepareResourcesResponse: ...

    async def NodeUnprepareResources(
        self, request: dra.NodeUnprepareResourcesRequest, context: Context
    ) -> dra.NodeUnprepareResourcesResponse: ...


class RegistrationServicer(Protocol):
    """The plugin's side of registration: the kubelet's plugin watcher calls both."""

    async def GetInfo(self, request: reg.InfoRequest, context: Context) -> reg.PluginInfo: ...

    async def NotifyRegistrationStatus(
        self, request: reg.RegistrationStatus, context: Context
    ) -> reg.RegistrationStatusResponse: ...


def dra_plugin_handler(servicer: DraPluginServicer) -> grpc.GenericRpcHandler:
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "NodePrepareResources": unary(
            servicer.NodePrepareResources, _de(dra.NodePrepareResourcesRequest), _ser
        ),
        "NodeUnprepareResources": unary(
            servicer.NodeUnprepareResources, _de(dra.NodeUnprepareResourcesRequest), _ser
        ),
    }
    return grpc.method_handlers_generic_handler(DRA_SERVICE, handlers)


def registration_handler(servicer: RegistrationServicer) -> grpc.GenericRpcHandler:
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "GetInfo": unary(servicer.GetInfo, _de(reg.InfoRequest), _ser),
        "NotifyRegistrationStatus": unary(
            servicer.NotifyRegistrationStatus, _de(reg.RegistrationStatus), _ser
        ),
    }
    return grpc.method_handlers_generic_handler(REGISTRATION_SERVICE, handlers)


class DraPluginClient:
    """What the kubelet calls on a DRA plugin (the harness and the self-check use it)."""

    NodePrepareResources: Callable[..., Awaitable[dra.NodePrepareResourcesResponse]]
    NodeUnprepareResources: Callable[..., Awaitable[dra.NodeUnprepareResourcesResponse]]

    def __init__(self, channel: grpc.aio.Channel) -> None:
        base = f"/{DRA_SERVICE}/"
        self.NodePrepareResources = channel.unary_unary(
            base + "NodePrepareResources", _ser, _de(dra.NodePrepareResourcesResponse)
        )
        self.NodeUnprepareResources = channel.unary_unary(
            base + "NodeUnprepareResources", _ser, _de(dra.NodeUnprepareResourcesResponse)
        )


class RegistrationClient:
    """The kubelet's plugin watcher's calls on a registration socket (used by the harness)."""

    GetInfo: Callable[..., Awaitable[reg.PluginInfo]]
    NotifyRegistrationStatus: Callable[..., Awaitable[reg.RegistrationStatusResponse]]

    def __init__(self, channel: grpc.aio.Channel) -> None:
        base = f"/{REGISTRATION_SERVICE}/"
        self.GetInfo = channel.unary_unary(base + "GetInfo", _ser, _de(reg.PluginInfo))
        self.NotifyRegistrationStatus = channel.unary_unary(
            base + "NotifyRegistrationStatus", _ser, _de(reg.RegistrationStatusResponse)
        )
