"""Hand-written gRPC plumbing for the two kubelet APIs: method paths, server handlers, clients.

The generated ``*_pb2_grpc`` modules are untyped; these few lines give the servicer and the
clients real types and keep the wire paths in one place.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

import grpc
import grpc.aio

from nodeplugin.pb import dp, pr

DEVICE_PLUGIN_SERVICE = "v1beta1.DevicePlugin"
REGISTRATION_SERVICE = "v1beta1.Registration"
POD_RESOURCES_SERVICE = "v1.PodResourcesLister"
API_VERSION = "v1beta1"

Req = TypeVar("Req")
Resp = TypeVar("Resp")


def _ser(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


def _de(cls: Any) -> Callable[[bytes], Any]:
    parse: Callable[[bytes], Any] = cls.FromString
    return parse


class DevicePluginServicer(Protocol):
    """What a device plugin implements; the kubelet is the only caller."""

    async def GetDevicePluginOptions(
        self, request: dp.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> dp.DevicePluginOptions: ...

    def ListAndWatch(
        self, request: dp.Empty, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[dp.ListAndWatchResponse]: ...

    async def GetPreferredAllocation(
        self, request: dp.PreferredAllocationRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> dp.PreferredAllocationResponse: ...

    async def Allocate(
        self, request: dp.AllocateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> dp.AllocateResponse: ...

    async def PreStartContainer(
        self, request: dp.PreStartContainerRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> dp.PreStartContainerResponse: ...


def device_plugin_handler(servicer: DevicePluginServicer) -> grpc.GenericRpcHandler:
    unary = grpc.unary_unary_rpc_method_handler
    handlers = {
        "GetDevicePluginOptions": unary(servicer.GetDevicePluginOptions, _de(dp.Empty), _ser),
        "ListAndWatch": grpc.unary_stream_rpc_method_handler(
            servicer.ListAndWatch, _de(dp.Empty), _ser
        ),
        "GetPreferredAllocation": unary(
            servicer.GetPreferredAllocation, _de(dp.PreferredAllocationRequest), _ser
        ),
        "Allocate": unary(servicer.Allocate, _de(dp.AllocateRequest), _ser),
        "PreStartContainer": unary(
            servicer.PreStartContainer, _de(dp.PreStartContainerRequest), _ser
        ),
    }
    return grpc.method_handlers_generic_handler(DEVICE_PLUGIN_SERVICE, handlers)


def registration_handler(
    register: Callable[
        [dp.RegisterRequest, grpc.aio.ServicerContext[Any, Any]], Awaitable[dp.Empty]
    ],
) -> grpc.GenericRpcHandler:
    """The kubelet's side of registration (used by the test harness)."""
    handlers = {
        "Register": grpc.unary_unary_rpc_method_handler(register, _de(dp.RegisterRequest), _ser)
    }
    return grpc.method_handlers_generic_handler(REGISTRATION_SERVICE, handlers)


def pod_resources_handler(
    list_: Callable[
        [pr.ListPodResourcesRequest, grpc.aio.ServicerContext[Any, Any]],
        Awaitable[pr.ListPodResourcesResponse],
    ],
    get: Callable[
        [pr.GetPodResourcesRequest, grpc.aio.ServicerContext[Any, Any]],
        Awaitable[pr.GetPodResourcesResponse],
    ]
    | None = None,
) -> grpc.GenericRpcHandler:
    """The kubelet's PodResources service (used by the test harness)."""
    handlers = {
        "List": grpc.unary_unary_rpc_method_handler(list_, _de(pr.ListPodResourcesRequest), _ser),
    }
    if get is not None:
        handlers["Get"] = grpc.unary_unary_rpc_method_handler(
            get, _de(pr.GetPodResourcesRequest), _ser
        )
    return grpc.method_handlers_generic_handler(POD_RESOURCES_SERVICE, handlers)


def unix_target(path: str) -> str:
    return f"unix://{path}"


class DevicePluginClient:
    """What the kubelet calls on a plugin (the harness and the self-check use it)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        base = f"/{DEVICE_PLUGIN_SERVICE}/"
        self.GetDevicePluginOptions = channel.unary_unary(
            base + "GetDevicePluginOptions", _ser, _de(dp.DevicePluginOptions)
        )
        self.ListAndWatch = channel.unary_stream(
            base + "ListAndWatch", _ser, _de(dp.ListAndWatchResponse)
        )
        self.GetPreferredAllocation = channel.unary_unary(
            base + "GetPreferredAllocation", _ser, _de(dp.PreferredAllocationResponse)
        )
        self.Allocate = channel.unary_unary(base + "Allocate", _ser, _de(dp.AllocateResponse))
        self.PreStartContainer = channel.unary_unary(
            base + "PreStartContainer", _ser, _de(dp.PreStartContainerResponse)
        )


class RegistrationClient:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.Register = channel.unary_unary(
            f"/{REGISTRATION_SERVICE}/Register", _ser, _de(dp.Empty)
        )


class PodResourcesClient:
    def __init__(self, channel: grpc.aio.Channel) -> None:
        base = f"/{POD_RESOURCES_SERVICE}/"
        self.List = channel.unary_unary(base + "List", _ser, _de(pr.ListPodResourcesResponse))
        self.Get = channel.unary_unary(base + "Get", _ser, _de(pr.GetPodResourcesResponse))
