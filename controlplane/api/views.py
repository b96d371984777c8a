"""REST adapters: authenticate, validate, call a service, translate the result."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, extend_schema
from rest_framework import status
from rest_framework.exceptions import PermissionDenied
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.access.permissions import IsNodeOrAdmin
from controlplane.access.roles import Role, has_role
from controlplane.api.names import check_path
from controlplane.api.schema import EXAMPLE, conflict
from controlplane.api.serializers import InventoryReportSerializer, InventoryResultSerializer
from controlplane.ledger.services import nodes

EXAMPLE_CARD = {
    "uuid": EXAMPLE["card"],
    "index": 0,
    "model": "NVIDIA A100-SXM4-80GB",
    "memory_mib": 81920,
    "numa_node": 0,
    "healthy": True,
    "health_reason": "",
}


class NodeInventoryView(APIView):
    """`PUT /api/v1/nodes/<name>/inventory`: a node plugin's report and heartbeat (DESIGN §7).

    A node identity may report only its own node (its username is the node name); an admin may
    report any. The first report creates the node (201); later ones answer 200.
    """

    permission_classes = [IsNodeOrAdmin]

    @extend_schema(
        summary="A node plugin's inventory report and heartbeat (node identity of that node, or "
        "admin)",
        request=InventoryReportSerializer,
        examples=[
            OpenApiExample(
                "one card",
                value={
                    "plugin_version": "0.1.0",
                    "cards": [EXAMPLE_CARD],
                },
                request_only=True,
            ),
            OpenApiExample(
                "a MIG card",
                value={
                    "plugin_version": "0.2.0",
                    "cards": [
                        {
                            **EXAMPLE_CARD,
                            "mig": {
                                "capable": True,
                                "enabled": True,
                                "instances": [
                                    {
                                        "profile": "3g.40gb",
                                        "start": 4,
                                        "size": 4,
                                        "uuid": "MIG-4d8c3a7e-5f1b-5c2d-9e6f-0a1b2c3d4e5f",
                                    }
                                ],
                            },
                        }
                    ],
                },
                request_only=True,
            ),
        ],
        responses={
            200: InventoryResultSerializer,
            201: InventoryResultSerializer,
            409: conflict("A reported card is registered to another node."),
        },
    )
    def put(self, request: Request, name: str) -> Response:
        check_path(name=("node", name))
        if has_role(request.user, Role.NODE) and request.user.get_username() != name:
            raise PermissionDenied(
                f"this token belongs to node {request.user.get_username()!r}; it may report only "
                "that node's inventory"
            )
        serializer = InventoryReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        result = nodes.apply_inventory(
            name, serializer.to_report(), actor=request.user.get_username()
        )
        body = {
            "node": result.node.name,
            "created": result.created,
            "cards": len(serializer.validated_data["cards"]),
            "cards_added": list(result.cards_added),
            "cards_missing": list(result.cards_missing),
            "last_heartbeat": result.node.last_heartbeat,
            "modes": dict(result.modes),
        }
        return Response(body, status=status.HTTP_201_CREATED if result.created else 200)
