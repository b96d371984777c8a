"""Operations REST API: quotas (CRUD), nodes, cards, slices and bindings (read), cordons,
card modes, cards' oversubscription factors.

Viewers read; operators write. Authentication is a bearer token or the dashboard's session
(with its CSRF check). Lists answer `{"count", "next", "previous", "results"}`, 50 rows a page
by default, `?page_size=` up to 500. Bad input answers 400 naming the field and changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.core.paginator import EmptyPage, Paginator
from django.db.models import QuerySet
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema
from rest_framework import serializers, status
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.generics import GenericAPIView
from rest_framework.pagination import PageNumberPagination
from rest_framework.permissions import SAFE_METHODS, BasePermission
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.access.roles import Role, has_role
from controlplane.api.names import check_path
from controlplane.api.schema import EXAMPLE, conflict
from controlplane.dashboard import selectors
from controlplane.dashboard.serializers import (
    BindingSerializer,
    CardDetailSerializer,
    CardFactorSerializer,
    CardModeSerializer,
    CardSerializer,
    CordonSerializer,
    NodeSerializer,
    QuotaLimitsSerializer,
    QuotaSerializer,
    SliceSerializer,
)
from controlplane.ledger.models import PodBinding
from controlplane.ledger.services import cordons, modes, nodes, quotas
from controlplane.ledger.validation import MAX_NUMBER_DIGITS, whole_number

MAX_PAGE_SIZE = 500
MAX_PAGE = 10**MAX_NUMBER_DIGITS - 1  # the largest page read as a number; longer is past the end


class ReadViewerWriteOperator(BasePermission):
    """Safe methods need viewer; anything else needs operator."""

    message = "Reading needs the viewer role; changing needs the operator role."

    def has_permission(self, request: Request, view: Any) -> bool:
        needed = Role.VIEWER if request.method in SAFE_METHODS else Role.OPERATOR
        return has_role(request.user, needed)


class OperatorOnly(BasePermission):
    message = "This needs the operator role or higher."

    def has_permission(self, request: Request, view: Any) -> bool:
        return has_role(request.user, Role.OPERATOR)


def _cut(raw: str, limit: int = 40) -> str:
    """`raw` cut short for an error message: a caller's junk is not echoed in full."""
    return raw if len(raw) <= limit else raw[:limit] + "..."


def _shown(raw: str) -> str:
    return repr(_cut(raw))


class Pagination(PageNumberPagination):
    """Page-number pagination that refuses a bad `page`/`page_size` instead of guessing."""

    page_size = selectors.PAGE_SIZE
    page_size_query_param = "page_size"
    max_page_size = MAX_PAGE_SIZE

    def get_page_size(self, request: Request) -> int:
        raw = request.query_params.get(self.page_size_query_param)
        if raw is None or raw == "":
            return self.page_size
        size = whole_number(raw)
        if size is None or not 1 <= size <= MAX_PAGE_SIZE:
            raise ValidationError(
                {"page_size": f"{_shown(raw)}: give a whole number from 1 to {MAX_PAGE_SIZE}."}
            )
        return size

    def paginate(self, queryset: QuerySet[Any] | list[Any], request: Request) -> Any:
        """The page's slice of `queryset` (or list), still lazy: the caller picks the columns."""
        size = self.get_page_size(request)
        raw = request.query_params.get(self.page_query_param, "1")
        number = whole_number(raw)
        if number is None and raw.isascii() and raw.isdigit():
            number = MAX_PAGE + 1  # more digits than any page count: past the end, as DRF says
        if number is None or number < 1:
            raise ValidationError(
                {"page": f"{_shown(raw)}: give a page number from 1, in digits 0-9."}
            )
        paginator = Paginator(queryset, size)
        try:
            self.page = paginator.page(number)
        except EmptyPage:
            raise NotFound(
                f"page {_cut(raw)} is past the last page ({paginator.num_pages})."
            ) from None
        self.request = request
        return self.page.object_list  # type: ignore[return-value]


def _bool(request: Request, name: str) -> bool | None:
    raw = request.query_params.get(name)
    if raw is None or raw == "":
        return None
    value = raw.lower()
    if value in ("true", "1", "yes"):
        return True
    if value in ("false", "0", "no"):
        return False
    raise ValidationError({name: f"{raw!r}: give true or false."})


def _text(request: Request, name: str, limit: int = 253) -> str:
    raw = request.query_params.get(name, "").strip()
    if len(raw) > limit:
        raise ValidationError({name: f"at most {limit} characters."})
    return raw


def _bool_param(name: str, text: str) -> OpenApiParameter:
    return OpenApiParameter(name, OpenApiTypes.BOOL, description=text)


def _str_param(
    name: str, text: str, enum: list[str] | None = None, max_length: int = 253
) -> OpenApiParameter:
    schema = {"type": "string", "maxLength": max_length}
    return OpenApiParameter(name, schema, description=text, enum=enum)


PAGE_PARAMS = [
    OpenApiParameter(
        "page",
        {"type": "integer", "minimum": 1, "maximum": MAX_PAGE},
        description="Page number, from 1, in digits 0-9 (a page past the last is a 404).",
    ),
    OpenApiParameter(
        "page_size",
        {"type": "integer", "minimum": 1, "maximum": MAX_PAGE_SIZE, "default": selectors.PAGE_SIZE},
        description=f"Rows per page, 1 to {MAX_PAGE_SIZE}.",
    ),
]


# --- quotas --------------------------------------------------------------------------------------

LIMITS_EXAMPLE = {"gpumem_mib": 163840, "gpucores": 200, "gpus": 4}
CORDON_EXAMPLE = OpenApiExample(
    "reason", value={"reason": "ECC errors under investigation"}, request_only=True
)


def _quota_body(row: selectors.QuotaRow) -> dict[str, Any]:
    return {
        "namespace": row.namespace,
        "gpumem_mib": row.gpumem_mib,
        "gpucores": row.gpucores,
        "gpus": row.gpus,
        "usage": {
            "gpumem_mib": row.used_memory_mib,
            "gpucores": row.used_cores,
            "gpus": row.used_gpus,
        },
        "updated_at": row.updated_at,
        "updated_by": row.updated_by,
    }


def _quota_response(namespace: str, code: int = status.HTTP_200_OK) -> Response:
    rows = [r for r in selectors.quota_rows(namespace) if r.has_quota]
    if not rows:
        raise NotFound(f"namespace {namespace} has no quota.")
    return Response(QuotaSerializer(_quota_body(rows[0])).data, status=code)


def _check_url_namespace(namespace: str) -> None:
    check_path(namespace=("namespace", namespace))


class QuotaListView(GenericAPIView):
    """`/api/v1/quotas/`: list every namespace quota with its usage; create one (operator)."""

    permission_classes = [ReadViewerWriteOperator]
    serializer_class = QuotaSerializer
    pagination_class = Pagination

    @extend_schema(
        summary="List namespace quotas with usage",
        parameters=PAGE_PARAMS,
        responses=QuotaSerializer(many=True),
    )
    def get(self, request: Request) -> Response:
        paginator = Pagination()
        rows = [r for r in selectors.quota_rows() if r.has_quota]
        page = paginator.paginate(rows, request)  # one row per namespace with a quota
        body = QuotaSerializer([_quota_body(r) for r in page], many=True)
        return paginator.get_paginated_response(body.data)

    @extend_schema(
        summary="Create a namespace quota (operator)",
        examples=[
            OpenApiExample(
                "quota",
                value={"namespace": EXAMPLE["namespace"], **LIMITS_EXAMPLE},
                request_only=True,
            )
        ],
        responses={
            201: QuotaSerializer,
            409: conflict(
                "The namespace has a quota already; PUT /quotas/<namespace>/ replaces it."
            ),
        },
    )
    def post(self, request: Request) -> Response:
        serializer = QuotaSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        namespace = serializer.validated_data["namespace"]
        quotas.set_quota(
            namespace, serializer.limits(), request.user.get_username(), create_only=True
        )
        return _quota_response(namespace, status.HTTP_201_CREATED)


class QuotaDetailView(GenericAPIView):
    """`/api/v1/quotas/<namespace>/`: read, replace (PUT creates too), change, delete."""

    permission_classes = [ReadViewerWriteOperator]
    serializer_class = QuotaLimitsSerializer

    @extend_schema(summary="A namespace quota with usage", responses=QuotaSerializer)
    def get(self, request: Request, namespace: str) -> Response:
        _check_url_namespace(namespace)
        return _quota_response(namespace)

    def _write(self, request: Request, namespace: str, partial: bool) -> Response:
        _check_url_namespace(namespace)
        serializer = QuotaLimitsSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        body_ns = serializer.validated_data.get("namespace")
        if body_ns is not None and body_ns != namespace:
            raise ValidationError(
                {"namespace": f"{body_ns!r} differs from the URL's {namespace!r}; omit it."}
            )
        base = None
        if partial:
            existing = [r for r in selectors.quota_rows(namespace) if r.has_quota]
            if not existing:
                raise NotFound(f"namespace {namespace} has no quota; PUT creates one.")
            row = existing[0]
            base = quotas.QuotaLimitsInput(row.gpumem_mib, row.gpucores, row.gpus)
        _, created = quotas.set_quota(
            namespace, serializer.limits(base), request.user.get_username()
        )
        return _quota_response(namespace, status.HTTP_201_CREATED if created else 200)

    @extend_schema(
        summary="Create or replace a namespace quota (operator); absent limits become unlimited",
        examples=[OpenApiExample("limits", value=LIMITS_EXAMPLE, request_only=True)],
        responses={200: QuotaSerializer, 201: QuotaSerializer},
    )
    def put(self, request: Request, namespace: str) -> Response:
        return self._write(request, namespace, partial=False)

    @extend_schema(
        summary="Change some limits of a namespace quota (operator)",
        examples=[OpenApiExample("one limit", value={"gpus": 8}, request_only=True)],
        responses=QuotaSerializer,
    )
    def patch(self, request: Request, namespace: str) -> Response:
        return self._write(request, namespace, partial=True)

    @extend_schema(
        summary="Remove a namespace quota: unlimited again (operator)", responses={204: None}
    )
    def delete(self, request: Request, namespace: str) -> Response:
        _check_url_namespace(namespace)
        quotas.delete_quota(namespace, request.user.get_username())
        return Response(status=status.HTTP_204_NO_CONTENT)


# --- nodes and cards -----------------------------------------------------------------------------


class NodeListView(GenericAPIView):
    """`/api/v1/nodes/`: nodes with their cards and allocation."""

    serializer_class = NodeSerializer
    pagination_class = Pagination

    @extend_schema(
        summary="List nodes with cards and allocation",
        parameters=[
            _str_param("name", "Node name contains this."),
            _bool_param("ready", "Only nodes whose plugin reports (true) or is silent (false)."),
            _bool_param("cordoned", "Only cordoned (true) or uncordoned (false) nodes."),
            _bool_param("healthy", "true: every card healthy and present; false: some card not."),
            *PAGE_PARAMS,
        ],
        responses=NodeSerializer(many=True),
    )
    def get(self, request: Request) -> Response:
        qs = selectors.node_filter(
            name=_text(request, "name"),
            ready=_bool(request, "ready"),
            cordoned=_bool(request, "cordoned"),
            healthy=_bool(request, "healthy"),
        )
        paginator = Pagination()
        nodes = selectors.node_views(paginator.paginate(qs, request))
        return paginator.get_paginated_response(NodeSerializer(nodes, many=True).data)


class NodeDetailView(GenericAPIView):
    """`/api/v1/nodes/<name>/`: one node with its cards and their slices."""

    serializer_class = NodeSerializer

    @extend_schema(summary="One node with cards", responses=NodeSerializer)
    def get(self, request: Request, name: str) -> Response:
        check_path(name=("node", name))
        node = selectors.node_detail(name)
        if node is None:
            raise NotFound(f"node {name!r} is not registered with Tessera.")
        return Response(NodeSerializer(node).data)


class CardListView(GenericAPIView):
    """`/api/v1/cards/`: cards with allocation."""

    serializer_class = CardSerializer
    pagination_class = Pagination

    @extend_schema(
        summary="List cards with allocation",
        parameters=[
            _str_param("node", "Exact node name."),
            _bool_param("healthy", "Health reported by the node plugin."),
            _bool_param("cordoned", "Operator cordon flag."),
            _bool_param("present", "In the node's latest inventory report."),
            _str_param("model", "Model contains this (case-insensitive).", max_length=128),
            *PAGE_PARAMS,
        ],
        responses=CardSerializer(many=True),
    )
    def get(self, request: Request) -> Response:
        qs = selectors.card_queryset(
            node=_text(request, "node"),
            healthy=_bool(request, "healthy"),
            cordoned=_bool(request, "cordoned"),
            present=_bool(request, "present"),
            model=_text(request, "model", 128),
        )
        paginator = Pagination()
        cards = selectors.card_views(paginator.paginate(qs, request))
        return paginator.get_paginated_response(CardSerializer(cards, many=True).data)


class CardDetailView(GenericAPIView):
    """`/api/v1/cards/<uuid>/`: one card with its active slices."""

    serializer_class = CardDetailSerializer

    @extend_schema(summary="One card with its active slices", responses=CardDetailSerializer)
    def get(self, request: Request, uuid: str) -> Response:
        check_path(uuid=("card", uuid))
        detail = selectors.card_detail(uuid)
        if detail is None:
            raise NotFound(f"card {uuid!r} is not registered with Tessera.")
        return Response(CardDetailSerializer(detail.card).data)


class _CordonView(GenericAPIView):
    permission_classes = [OperatorOnly]
    serializer_class = CordonSerializer
    cordon: bool = True

    def _reason(self, request: Request) -> str:
        # No body reads as {} (DRF's empty data); a body is the object or a 400, never coalesced:
        # `null`, `[]`, `0.0` and `false` are not "no reason" but a caller's mistake.
        serializer = CordonSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        return str(serializer.validated_data.get("reason", ""))


class NodeCordonView(_CordonView):
    """POST `/api/v1/nodes/<name>/cordon` or `/uncordon` (operator): place nothing new there."""

    @extend_schema(
        summary="Cordon or uncordon a node (operator)",
        examples=[CORDON_EXAMPLE],
        responses=NodeSerializer,
    )
    def post(self, request: Request, name: str) -> Response:
        check_path(name=("node", name))
        reason = self._reason(request)
        cordons.set_node_cordon(name, self.cordon, request.user.get_username(), reason)
        node = selectors.node_detail(name)
        return Response(NodeSerializer(node).data)


class CardCordonView(_CordonView):
    """POST `/api/v1/cards/<uuid>/cordon` or `/uncordon` (operator)."""

    @extend_schema(
        summary="Cordon or uncordon a card (operator)",
        examples=[CORDON_EXAMPLE],
        responses=CardSerializer,
    )
    def post(self, request: Request, uuid: str) -> Response:
        check_path(uuid=("card", uuid))
        reason = self._reason(request)
        cordons.set_card_cordon(uuid, self.cordon, request.user.get_username(), reason)
        detail = selectors.card_detail(uuid)
        assert detail is not None  # the service raised NotFound otherwise
        return Response(CardSerializer(detail.card).data)


def change_card(
    request: Request,
    uuid: str,
    serializer_class: type[serializers.Serializer],  # type: ignore[type-arg]
    change: Callable[[str, Any, str, str], object],
    field: str,
) -> Response:
    """An operator's change to one card: the path and body checked, `change(uuid, value, by,
    reason)` applied (its refusals answer as the service raises them), the card answered."""
    check_path(uuid=("card", uuid))
    serializer = serializer_class(data=request.data)
    serializer.is_valid(raise_exception=True)
    data = serializer.validated_data
    change(uuid, data[field], request.user.get_username(), data["reason"])
    detail = selectors.card_detail(uuid)
    assert detail is not None  # the service raised NotFound otherwise
    return Response(CardSerializer(detail.card).data)


class CardModeView(GenericAPIView):
    """POST `/api/v1/cards/<uuid>/mode` (operator): change how the card is shared
    (docs/card-modes.md). An idle card changes at once; a card with slices drains first."""

    permission_classes = [OperatorOnly]
    serializer_class = CardModeSerializer

    @extend_schema(
        summary="Set a card's mode: shared, mig, mps or exclusive (operator)",
        description="A card with no active slice changes at once. A card with slices keeps its "
        "mode, records the new one as `pending_mode` and is `draining` (it takes no new slices) "
        "until its last slice ends. Asking for the card's current mode cancels a pending change. "
        "`mig` needs a card its node plugin reports MIG-capable.",
        examples=[
            OpenApiExample(
                "to MPS",
                value={"mode": "mps", "reason": "for the inference team"},
                request_only=True,
            )
        ],
        responses=CardSerializer,
    )
    def post(self, request: Request, uuid: str) -> Response:
        return change_card(request, uuid, CardModeSerializer, modes.set_card_mode, "mode")


class CardFactorView(GenericAPIView):
    """POST `/api/v1/cards/<uuid>/memory-oversubscription` (operator): the card's own
    oversubscription factor (docs/virtual-memory.md), or null to follow its node's again."""

    permission_classes = [OperatorOnly]
    serializer_class = CardFactorSerializer

    @extend_schema(
        summary="Set a card's memory oversubscription factor, 1 to 16 (operator)",
        description="Slices of pods that opt in (annotation tessera.io/memory-oversubscription: "
        '"true") may then add up to factor x the card\'s memory, each keeping memory / factor '
        "on the card. A factor whose virtual budget would no longer hold the card's slices is "
        "refused (409) and changes nothing. `null` clears the card's own factor: the node's "
        "reported default applies.",
        examples=[
            OpenApiExample(
                "to 1.5", value={"factor": "1.5", "reason": "notebooks"}, request_only=True
            )
        ],
        responses={
            200: CardSerializer,
            409: conflict("The factor would no longer hold what the card holds."),
        },
    )
    def post(self, request: Request, uuid: str) -> Response:
        return change_card(request, uuid, CardFactorSerializer, nodes.set_card_factor, "factor")


# --- slices and bindings -------------------------------------------------------------------------


class SliceListView(GenericAPIView):
    """`/api/v1/slices/`: slices (active ones by default) with their pod and card."""

    serializer_class = SliceSerializer
    pagination_class = Pagination

    @extend_schema(
        summary="List slices",
        parameters=[
            _str_param("node", "Exact node name."),
            _str_param("card", "Card UUID.", max_length=64),
            _str_param("namespace", "Pod namespace.", max_length=63),
            _str_param("pod", "Pod name."),
            _bool_param("active", "true (default): held now; false: released; any: both."),
            *PAGE_PARAMS,
        ],
        responses=SliceSerializer(many=True),
    )
    def get(self, request: Request) -> Response:
        active: bool | None = True
        if request.query_params.get("active", "").lower() == "any":
            active = None
        elif request.query_params.get("active"):
            active = _bool(request, "active")
        qs = selectors.slice_queryset(
            node=_text(request, "node"),
            card=_text(request, "card", 64),
            namespace=_text(request, "namespace", 63),
            pod=_text(request, "pod"),
            active=active,
        )
        paginator = Pagination()
        rows = selectors.slice_dicts(paginator.paginate(qs, request))
        return paginator.get_paginated_response(SliceSerializer(rows, many=True).data)


class BindingListView(GenericAPIView):
    """`/api/v1/bindings/`: pod <-> card bindings with their slices."""

    serializer_class = BindingSerializer
    pagination_class = Pagination

    @extend_schema(
        summary="List pod bindings",
        parameters=[
            _str_param("namespace", "Pod namespace.", max_length=63),
            _str_param("name", "Pod name contains this."),
            _str_param("node", "Exact node name."),
            _str_param("card", "Card UUID the pod holds or held.", max_length=64),
            _str_param("phase", "Binding phase.", list(PodBinding.Phase.values), max_length=16),
            _str_param(
                "sort",
                "Order; '-' for descending (default -created).",
                [s for k in selectors.BINDING_SORTS for s in (k, f"-{k}")],
                max_length=16,
            ),
            *PAGE_PARAMS,
        ],
        responses=BindingSerializer(many=True),
    )
    def get(self, request: Request) -> Response:
        phase = _text(request, "phase", 16)
        if phase and phase not in PodBinding.Phase.values:
            raise ValidationError(
                {"phase": f"{phase!r}: give one of {', '.join(PodBinding.Phase.values)}."}
            )
        sort = _text(request, "sort", 16) or selectors.DEFAULT_BINDING_SORT
        if sort.lstrip("-") not in selectors.BINDING_SORTS:
            raise ValidationError(
                {"sort": f"{sort!r}: give one of {', '.join(selectors.BINDING_SORTS)}."}
            )
        filters = selectors.BindingFilters(
            q=_text(request, "name"),
            namespace=_text(request, "namespace", 63),
            node=_text(request, "node"),
            card=_text(request, "card", 64),
            phase=phase,
            sort=sort,
        )
        paginator = Pagination()
        page_qs = paginator.paginate(selectors.binding_queryset(filters), request)
        rows = selectors.binding_views(page_qs)
        return paginator.get_paginated_response(BindingSerializer(rows, many=True).data)
