"""REST adapters under /api/v1/: why-pending, and allocations for node plugins.

See docs/allocation.md for the allocation endpoints' contract.
"""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiResponse, extend_schema
from rest_framework import serializers
from rest_framework.exceptions import NotFound, PermissionDenied, ValidationError
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.access.permissions import IsNodeOrAdmin, IsNodeOrViewer
from controlplane.access.roles import Role, has_role
from controlplane.api.fields import StrictSerializer
from controlplane.api.names import CardUUIDField, check_path
from controlplane.api.schema import EXAMPLE, conflict
from controlplane.extender import claim_pending
from controlplane.ledger import fit_hints, selectors, why
from controlplane.ledger.services import bindings


def _check_pod_name(namespace: str, name: str) -> None:
    check_path(namespace=("namespace", namespace), name=("pod", name))


class WhyBindingSerializer(serializers.Serializer):
    phase = serializers.CharField()
    node = serializers.CharField(allow_null=True)
    pod_uid = serializers.CharField()


class WhySerializer(serializers.Serializer):
    """Where a pod stands (documentation of the answer; never read)."""

    namespace = serializers.CharField()
    name = serializers.CharField()
    pod_uid = serializers.CharField(allow_null=True)
    outcome = serializers.CharField()
    summary = serializers.CharField(help_text="Where the pod stands, in words.")
    decided_at = serializers.DateTimeField(allow_null=True)
    nodes_considered = serializers.IntegerField(allow_null=True)
    feasible_nodes = serializers.ListField(child=serializers.CharField())
    reason_counts = serializers.DictField(child=serializers.IntegerField())
    node_reasons = serializers.DictField(child=serializers.CharField())
    binding = WhyBindingSerializer(allow_null=True)
    fit = serializers.DictField(
        allow_null=True,
        help_text="For a pod waiting for room: the largest free room and where, the oldest "
        "bindings on the best card to wait for, and the namespace quota "
        "(controlplane/ledger/fit_hints.py); null otherwise.",
    )
    scheduler_reason = serializers.CharField(
        required=False,
        allow_null=True,
        help_text="DRA mode, a pod waiting on ResourceClaims: kube-scheduler's reason (its "
        "PodScheduled condition).",
    )
    claims = serializers.ListField(
        child=serializers.DictField(),
        required=False,
        help_text="DRA mode: per claim the pod names, allocated or not, and if not, per request "
        "the cards that come closest, what would make it fit and the quota in the way "
        "(controlplane/ledger/claim_why.py).",
    )


class WhyView(APIView):
    """`GET /api/v1/pods/<namespace>/<name>/why`: where the pod stands, in words
    (`controlplane.ledger.why`, the same answer as the dashboard's pod page)."""

    @extend_schema(summary="Where a pod stands: why it is pending, or where it is bound",
                   responses=WhySerializer)  # fmt: skip
    def get(self, request: Request, namespace: str, name: str) -> Response:
        _check_pod_name(namespace, name)
        status = why.pod_status(namespace, name)
        if status is None:
            claims, problem = claim_pending.pod_claims_status_or_none(namespace, name)
            if claims is not None:
                return Response(
                    {
                        "namespace": namespace,
                        "name": name,
                        "pod_uid": claims.pod_uid,
                        "outcome": claims.outcome,
                        "summary": claims.text,
                        "decided_at": None,
                        "nodes_considered": None,
                        "feasible_nodes": [],
                        "reason_counts": {},
                        "node_reasons": {},
                        "binding": None,
                        "fit": None,
                        **claims.as_dict(),
                    }
                )
            unasked = (
                f" Whether it waits on a ResourceClaim could not be read: {problem}."
                if problem
                else ""
            )
            raise NotFound(
                f"Tessera has no scheduling decision for pod {namespace}/{name}. Either the "
                "scheduler has not tried it yet, or it asks for no GPU resource, or it is not "
                f"scheduled by tessera-scheduler (check spec.schedulerName).{unasked}"
            )
        decision, binding = status.decision, status.binding
        fit = fit_hints.hints_for(namespace, status.outcome, decision)
        return Response(
            {
                "namespace": status.namespace,
                "name": status.name,
                "pod_uid": status.pod_uid,
                "outcome": status.outcome,
                "summary": status.summary,
                "decided_at": status.decided_at,
                "nodes_considered": decision.nodes_considered if decision is not None else None,
                "feasible_nodes": decision.feasible_nodes if decision is not None else [],
                "reason_counts": decision.reason_counts if decision is not None else {},
                "node_reasons": decision.node_reasons if decision is not None else {},
                "binding": None
                if binding is None
                else {"phase": binding.phase, "node": binding.node, "pod_uid": binding.pod_uid},
                "fit": None if fit is None else fit.as_dict(),
            }
        )


def _own_node(request: Request) -> str | None:
    """The node a node identity speaks for (its username); None for people."""
    return request.user.get_username() if has_role(request.user, Role.NODE) else None


class AllocationView(APIView):
    """`GET /api/v1/allocations/<namespace>/<name>`: the pod's current allocation record."""

    permission_classes = [IsNodeOrViewer]

    @extend_schema(
        summary="A pod's current allocation record (node identity of its node, or viewer)",
        responses=OpenApiResponse(
            OpenApiTypes.OBJECT, description="The version-1 allocation record (docs/allocation.md)."
        ),
    )
    def get(self, request: Request, namespace: str, name: str) -> Response:
        _check_pod_name(namespace, name)
        held = selectors.active_allocation_of_pod(namespace, name)
        if held is None:
            raise NotFound(f"pod {namespace}/{name} has no active GPU binding")
        node = _own_node(request)
        if node is not None and held.node != node:
            raise PermissionDenied(
                f"this token belongs to node {node!r}; pod {namespace}/{name} is not bound there"
            )
        return Response(held.record)


class AllocatedSerializer(StrictSerializer):
    devices = serializers.ListField(
        child=CardUUIDField(),
        min_length=1,
        max_length=64,
        help_text="UUIDs of the cards the container got.",
    )


class AllocatedResultSerializer(serializers.Serializer):
    """The answer to an allocated report (documentation of the answer; never read)."""

    pod_uid = serializers.CharField()
    phase = serializers.CharField()
    container = serializers.CharField()
    devices = serializers.ListField(child=serializers.CharField())


class AllocatedView(APIView):
    """`POST /api/v1/allocations/<pod_uid>/containers/<container>/allocated`."""

    permission_classes = [IsNodeOrAdmin]

    @extend_schema(
        summary="A node plugin reports the cards it gave a container (node identity, or admin)",
        request=AllocatedSerializer,
        examples=[
            OpenApiExample("one card", value={"devices": [EXAMPLE["card"]]}, request_only=True)
        ],
        responses={
            200: AllocatedResultSerializer,
            409: conflict(
                "The binding is no longer active, or the devices differ from the ledger's."
            ),
        },
    )
    def post(self, request: Request, pod_uid: str, container: str) -> Response:
        if len(pod_uid) > 64:
            raise ValidationError({"pod_uid": "at most 64 characters"})
        check_path(container=("container", container))
        serializer = AllocatedSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        binding = bindings.mark_allocated(
            pod_uid,
            container,
            serializer.validated_data["devices"],
            actor=request.user.get_username(),
            node=_own_node(request),
        )
        return Response(
            {
                "pod_uid": binding.pod_uid,
                "phase": binding.phase,
                "container": container,
                "devices": sorted(serializer.validated_data["devices"]),
            }
        )
