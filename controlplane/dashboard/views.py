"""Dashboard pages: thin views over the selectors (reads) and the services (writes).

Every page needs a signed-in identity with the viewer role; cordons, card modes and quota edits
need the operator role. Pages that change over time answer `?fragment=1` with only their live part,
which htmx polls every few seconds (see templates/dashboard/*).
"""

from __future__ import annotations

from typing import Any

from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.utils.http import url_has_allowed_host_and_scheme
from django.views.decorators.http import require_http_methods, require_POST

from controlplane.access import services as access_services
from controlplane.access.roles import Role, has_role
from controlplane.dashboard import grid as card_grid
from controlplane.dashboard import selectors, services
from controlplane.dashboard.access import forbidden, role_required
from controlplane.dashboard.charts import allocation_chart
from controlplane.dashboard.forms import (
    CardFactorForm,
    CardModeForm,
    CordonForm,
    GrantRoleForm,
    QuotaForm,
)
from controlplane.dashboard.looks import namespace_looks
from controlplane.extender import claim_pending
from controlplane.ledger import fit_hints
from controlplane.ledger.errors import ServiceError
from controlplane.ledger.models import Card, PodBinding
from controlplane.ledger.services import cordons, mode_rules, modes
from controlplane.ledger.services import nodes as node_services
from controlplane.ledger.services import quotas as quota_services
from controlplane.ledger.validation import whole_number
from controlplane.scheduling import format_factor

POLL_SECONDS = 5


def _fragment(request: HttpRequest) -> bool:
    return request.GET.get("fragment") == "1"


def _back(request: HttpRequest, default: str) -> HttpResponseRedirect:
    """Redirect to the form's `next` when it is a local URL, else to `default`."""
    target = request.POST.get("next", "")
    if not url_has_allowed_host_and_scheme(
        target, allowed_hosts={request.get_host()}, require_https=request.is_secure()
    ):
        target = default
    return HttpResponseRedirect(target or default)


@role_required(Role.VIEWER)
def overview(request: HttpRequest) -> HttpResponse:
    """`/`: cluster totals, fragmentation, allocation over time, what needs attention."""
    stats = selectors.cluster_overview()
    samples = selectors.allocation_samples()
    if services.sample_due(samples[-1] if samples else None):
        samples.append(services.record_allocation_sample(stats))
    chart = allocation_chart(samples)
    context: dict[str, Any] = {
        "stats": stats,
        "chart": chart,
        "poll": POLL_SECONDS,
        "attention_cards": selectors.attention_cards(),
        "pending": selectors.pending_pods(),
        "holds": selectors.room_holds(),
    }
    template = "dashboard/_overview_live.html" if _fragment(request) else "dashboard/overview.html"
    return render(request, template, context)


@role_required(Role.VIEWER)
def nodes(request: HttpRequest) -> HttpResponse:
    """`/nodes/`: every node (50 a page) with its cards drawn as bars split into slices."""
    q = request.GET.get("q", "").strip()[:253]
    state = request.GET.get("state", "all")
    if state not in selectors.NODE_FILTERS:
        state = "all"
    page = selectors.node_page(request.GET.get("page", 1), q=q, state=state)
    namespaces = sorted({s.namespace for n in page.object_list for c in n.cards for s in c.slices})
    context = {
        "page": page,
        "q": q,
        "state": state,
        "states": selectors.NODE_FILTERS,
        "namespaces": namespaces,
        "ns_looks": namespace_looks(namespaces),
        "poll": POLL_SECONDS,
    }
    template = "dashboard/_nodes_live.html" if _fragment(request) else "dashboard/nodes.html"
    return render(request, template, context)


@role_required(Role.VIEWER)
def grid(request: HttpRequest) -> HttpResponse:
    """`/grid/`: every card on one screen, coloured by allocation; filters are GET parameters,
    so the page reads (and filters) without JavaScript."""
    get = request.GET

    def choice(key: str, allowed: tuple[str, ...], default: str) -> str:
        value = get.get(key, default)
        return value if value in allowed else default

    filters = card_grid.GridFilters(
        model=get.get("model", "").strip()[:128],
        namespace=get.get("namespace", "").strip()[:63],
        state=choice("state", card_grid.STATES, ""),
        colour=choice("colour", card_grid.COLOURS, "memory"),
        sort=choice("sort", card_grid.SORTS, "node"),
    )
    data, cells = card_grid.build(filters)
    context = {
        "grid": data,
        "filters": filters,
        "cells": cells,
        "states": card_grid.STATES,
        "ns_looks": namespace_looks(data.namespaces),
    }
    return render(request, "dashboard/grid.html", context)


@role_required(Role.VIEWER)
def node(request: HttpRequest, name: str) -> HttpResponse:
    """`/nodes/<name>/`: one node and its cards."""
    view = selectors.node_detail(name)
    if view is None:
        raise Http404(f"no node {name}")
    looks = namespace_looks(s.namespace for c in view.cards for s in c.slices)
    holds = selectors.room_holds(node=name)
    context = {"node": view, "ns_looks": looks, "poll": POLL_SECONDS, "holds": holds}
    template = "dashboard/_node_live.html" if _fragment(request) else "dashboard/node.html"
    return render(request, template, context)


def _cordon(request: HttpRequest, apply: Any, default: str) -> HttpResponse:
    if not has_role(request.user, Role.OPERATOR):
        return forbidden(request, Role.OPERATOR)
    form = CordonForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Choose cordon or uncordon.")
        return _back(request, default)
    cordoned = form.cleaned_data["action"] == "cordon"
    try:
        apply(cordoned, request.user.get_username(), form.cleaned_data["reason"])
    except ServiceError as exc:
        messages.error(request, exc.message)
    else:
        messages.success(request, f"{form.cleaned_data['action'].capitalize()}ed.")
    return _back(request, default)


@require_POST
@role_required(Role.VIEWER)
def node_cordon(request: HttpRequest, name: str) -> HttpResponse:
    """POST `/nodes/<name>/cordon/` (operator): cordon or uncordon a node."""
    return _cordon(
        request,
        lambda on, actor, reason: cordons.set_node_cordon(name, on, actor, reason),
        reverse("dashboard:node", args=[name]),
    )


@role_required(Role.VIEWER)
def card(request: HttpRequest, uuid: str) -> HttpResponse:
    """`/cards/<uuid>/`: a card's slices, pods and health history."""
    detail = selectors.card_detail(uuid)
    if detail is None:
        raise Http404(f"no card {uuid}")
    looks = namespace_looks(s.namespace for s in detail.card.slices)
    context = {"detail": detail, "card": detail.card, "ns_looks": looks, "poll": POLL_SECONDS}
    context["mode_choices"] = Card.Mode.choices
    template = "dashboard/_card_live.html" if _fragment(request) else "dashboard/card.html"
    return render(request, template, context)


@require_POST
@role_required(Role.VIEWER)
def card_mode(request: HttpRequest, uuid: str) -> HttpResponse:
    """POST `/cards/<uuid>/mode/` (operator): set the card's mode (docs/card-modes.md)."""
    if not has_role(request.user, Role.OPERATOR):
        return forbidden(request, Role.OPERATOR)
    back = reverse("dashboard:card", args=[uuid])
    form = CardModeForm(request.POST)
    if not form.is_valid():
        messages.error(request, f"Choose a mode: {', '.join(mode_rules.MODES)}.")
        return _back(request, back)
    mode = form.cleaned_data["mode"]
    try:
        card = modes.set_card_mode(
            uuid, mode, request.user.get_username(), form.cleaned_data["reason"]
        )
    except ServiceError as exc:
        messages.error(request, exc.message)
    else:
        if card.pending_mode:
            messages.success(request, f"Draining: the card becomes {mode} when its slices end.")
        else:
            messages.success(request, f"The card is in {card.mode} mode.")
    return _back(request, back)


@require_POST
@role_required(Role.VIEWER)
def card_factor(request: HttpRequest, uuid: str) -> HttpResponse:
    """POST `/cards/<uuid>/memory-oversubscription/` (operator): the card's own oversubscription
    factor, or blank for its node's default (docs/virtual-memory.md)."""
    if not has_role(request.user, Role.OPERATOR):
        return forbidden(request, Role.OPERATOR)
    back = reverse("dashboard:card", args=[uuid])
    form = CardFactorForm(request.POST)
    if not form.is_valid():
        messages.error(request, 'Give a factor from 1 to 16, such as "1.5", or leave it blank.')
        return _back(request, back)
    factor = form.cleaned_data["factor"] or None
    try:
        done = node_services.set_card_factor(
            uuid, factor, request.user.get_username(), form.cleaned_data["reason"]
        )
    except ServiceError as exc:
        messages.error(request, exc.message)
    else:
        whose = "its own" if done.own is not None else "its node's default"
        messages.success(
            request, f"Memory oversubscription x{format_factor(done.applied)} ({whose})."
        )
    return _back(request, back)


@require_POST
@role_required(Role.VIEWER)
def card_cordon(request: HttpRequest, uuid: str) -> HttpResponse:
    """POST `/cards/<uuid>/cordon/` (operator): cordon or uncordon a card."""
    return _cordon(
        request,
        lambda on, actor, reason: cordons.set_card_cordon(uuid, on, actor, reason),
        reverse("dashboard:card", args=[uuid]),
    )


@role_required(Role.VIEWER)
def bindings(request: HttpRequest) -> HttpResponse:
    """`/bindings/`: pod <-> card bindings, searchable, filterable, sortable, 50 a page."""
    get = request.GET
    phase = get.get("phase", "")
    sort = get.get("sort", selectors.DEFAULT_BINDING_SORT)
    if sort.lstrip("-") not in selectors.BINDING_SORTS:
        sort = selectors.DEFAULT_BINDING_SORT
    filters = selectors.BindingFilters(
        q=get.get("q", "").strip()[:253],
        namespace=get.get("namespace", "").strip()[:63],
        node=get.get("node", "").strip()[:253],
        card=get.get("card", "").strip()[:64],
        phase=phase if phase in PodBinding.Phase.values else "",
        sort=sort,
    )
    context = {
        "page": selectors.binding_page(filters, get.get("page", 1)),
        "filters": filters,
        "namespaces": selectors.binding_namespaces(),
        "phases": PodBinding.Phase.values,
        "sorts": [
            ("pod", "Pod"),
            ("namespace", "Namespace"),
            ("node", "Node"),
            ("phase", "Phase"),
            ("created", "Created"),
        ],
    }
    return render(request, "dashboard/bindings.html", context)


@role_required(Role.VIEWER)
def pod(request: HttpRequest, namespace: str, name: str) -> HttpResponse:
    """`/pods/<namespace>/<name>/`: allocation per container, decision log, why pending."""
    detail = selectors.pod_detail(namespace, name)
    fit = claims = None
    if detail.status is not None:
        fit = fit_hints.hints_for(namespace, detail.status.outcome, detail.status.decision)
    else:  # no record in the ledger: the pod may wait on ResourceClaims (DRA mode)
        claims, _ = claim_pending.pod_claims_status_or_none(namespace, name)
    unknown = detail.binding is None and detail.decision is None and claims is None
    context = {"pod": detail, "fit": fit, "claims": claims}
    return render(request, "dashboard/pod.html", context, status=404 if unknown else 200)


@require_http_methods(["GET", "POST"])
@role_required(Role.VIEWER)
def quotas(request: HttpRequest) -> HttpResponse:
    """`/quotas/`: usage against limits per namespace; operators set and remove quotas."""
    form = QuotaForm()
    status = 200
    if request.method == "POST":
        if not has_role(request.user, Role.OPERATOR):
            return forbidden(request, Role.OPERATOR)
        actor = request.user.get_username()
        if request.POST.get("action") == "delete":
            try:
                quota_services.delete_quota(request.POST.get("namespace", ""), actor)
            except ServiceError as exc:
                messages.error(request, exc.message)
            else:
                messages.success(request, f"Quota of {request.POST['namespace']} removed.")
            return HttpResponseRedirect(reverse("dashboard:quotas"))
        form = QuotaForm(request.POST)
        if form.is_valid():
            try:
                quota, created = quota_services.set_quota(
                    form.cleaned_data["namespace"], form.limits(), actor
                )
            except ServiceError as exc:
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
            else:
                verb = "created" if created else "updated"
                messages.success(request, f"Quota of {quota.namespace} {verb}.")
                return HttpResponseRedirect(reverse("dashboard:quotas"))
        status = 400
    context = {"rows": selectors.quota_rows(), "form": form}
    return render(request, "dashboard/quotas.html", context, status=status)


@role_required(Role.VIEWER)
def audit(request: HttpRequest) -> HttpResponse:
    """`/audit/`: every recorded change, newest first, filterable by action, target and actor."""
    action = request.GET.get("action", "").strip()[:64]
    target = request.GET.get("target", "").strip()[:253]
    actor = request.GET.get("actor", "").strip()[:150]
    context = {
        "page": selectors.audit_page(action, target, actor, request.GET.get("page", 1)),
        "action": action,
        "target": target,
        "actor": actor,
        "actions": selectors.audit_actions(),
    }
    return render(request, "dashboard/audit.html", context)


@role_required(Role.VIEWER)
def api_docs(request: HttpRequest) -> HttpResponse:
    """`/api/docs/`: the OpenAPI schema's paths and operations as a plain page (no CDN)."""
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    operations = []
    for path, item in sorted(schema.get("paths", {}).items()):
        for method, op in item.items():
            if method not in {"get", "post", "put", "patch", "delete"}:
                continue
            operations.append(
                {
                    "path": path,
                    "method": method.upper(),
                    "summary": op.get("summary") or op.get("operationId", ""),
                    "description": op.get("description", ""),
                    "parameters": [
                        f"{p.get('name')} ({p.get('in')})" for p in op.get("parameters", [])
                    ],
                }
            )
    return render(
        request, "dashboard/api_docs.html", {"operations": operations, "info": schema["info"]}
    )


@require_http_methods(["GET", "POST"])
@role_required(Role.ADMIN)
def access(request: HttpRequest) -> HttpResponse:
    """`/access/` (admin): users and their roles, API tokens; grant roles, issue and revoke tokens.

    A new token is shown once, in the answer to the POST that made it (never stored or redirected
    through the session), and the page is marked not to be cached.
    """
    form = GrantRoleForm()
    new_token = None
    status = 200
    if request.method == "POST":
        actor = request.user.get_username()
        if request.POST.get("action") == "revoke":
            token_id = whole_number(request.POST.get("token", ""))
            try:
                access_services.revoke_token(-1 if token_id is None else token_id, actor)
            except ServiceError as exc:
                messages.error(request, exc.message)
            else:
                messages.success(request, "Token revoked.")
            return HttpResponseRedirect(reverse("dashboard:access"))
        form = GrantRoleForm(request.POST)
        if form.is_valid():
            data = form.cleaned_data
            role = Role(data["role"])
            try:
                if data["issue_token"]:
                    new_token = services.issue_token(
                        data["username"], role, data["token_label"], actor
                    )
                else:
                    services.grant_user_role(data["username"], role, actor)
            except ServiceError as exc:
                form.add_error(exc.field if exc.field in form.fields else None, exc.message)
                status = 400
            else:
                messages.success(request, f"{data['username']} now holds the {role} role.")
                form = GrantRoleForm()
        else:
            status = 400
    context = {
        "form": form,
        "new_token": new_token,
        "users": selectors.access_users(),
        "tokens": selectors.access_tokens(),
    }
    response = render(request, "dashboard/access.html", context, status=status)
    response["Cache-Control"] = "no-store"
    return response
