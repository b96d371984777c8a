"""HTTP adapters of the extender (`/scheduler/*`) and the admission webhooks (`/webhook/*`).

Plain Django views, not DRF: these are machine protocols with their own JSON shapes, on the
scheduling hot path. They validate and translate; `verbs`, `preemption` and `webhook` decide.

`/scheduler/*` answers only when `TESSERA_SERVE_EXTENDER` is on (404 otherwise) and then only to
a loopback peer (403 otherwise): it is served by the control-plane sidecar inside the scheduler
pod, on 127.0.0.1 (docs/extender.md).
"""

from __future__ import annotations

import base64
import ipaddress
import json
import logging
import time
from collections.abc import Callable
from functools import wraps
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt

from controlplane.extender import claims_admission, verbs, wire
from controlplane.extender.dra_admission import review_pod_dra
from controlplane.extender.preemption import verb as preempt_verb
from controlplane.extender.webhook import Admission, review_pod
from controlplane.kube import adapter
from controlplane.kube.base import api_ms, reset_api_ms
from controlplane.ledger import selectors
from controlplane.metrics import BIND_APISERVER, BIND_OUTCOMES, EXTENDER_LATENCY
from controlplane.scheduling import RequestError

log = logging.getLogger(__name__)


APISERVER_HEADER = "X-Tessera-Apiserver-Ms"


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> HttpResponse:
    response = HttpResponse(wire.dump_json(body), status=status, content_type="application/json")
    for key, value in (headers or {}).items():
        response[key] = value
    return response


def _is_loopback(address: str | None) -> bool:
    try:
        return ipaddress.ip_address((address or "").split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _read_body(request: HttpRequest) -> bytes:
    """The body, at most EXTENDER_MAX_BODY bytes (WireError past it, whatever the headers say)."""
    limit = int(settings.TESSERA["EXTENDER_MAX_BODY"])
    body = request.read(limit + 1)
    if len(body) > limit:
        raise wire.WireError("body", f"is over the limit of {limit} bytes")
    return body


def _refuse_method(request: HttpRequest) -> HttpResponse | None:
    if request.method != "POST":
        response = _json({"Error": f"{request.method} is not allowed here; POST JSON"}, 405)
        response["Allow"] = "POST"
        return response
    return None


View = Callable[[HttpRequest], HttpResponse]


def extender_view(verb: str) -> Callable[[View], View]:
    """Guard (sidecar + loopback + POST), time and shield one extender verb."""

    def decorate(view: View) -> View:
        # the verb's histogram child, looked up once (labels() per request showed in profiles)
        latency = EXTENDER_LATENCY.labels(verb=verb)

        @csrf_exempt
        @wraps(view)
        def wrapper(request: HttpRequest) -> HttpResponse:
            if not settings.TESSERA.get("SERVE_EXTENDER"):
                return _json({"Error": "the scheduler extender is not served by this replica"}, 404)
            if not _is_loopback(request.META.get("REMOTE_ADDR")):
                return _json(
                    {"Error": "the scheduler extender answers only the scheduler (loopback)"}, 403
                )
            refused = _refuse_method(request)
            if refused is not None:
                return refused
            start = time.perf_counter()
            try:
                return view(request)
            except Exception:  # the scheduler gets an Error, never a traceback
                log.exception("extender %s failed", verb)
                message = f"internal error in {verb}; the control plane log has it"
                return _json({"Error": message}, 500)
            finally:
                latency.observe(time.perf_counter() - start)

        return wrapper

    return decorate


def _args(request: HttpRequest) -> tuple[Any, HttpResponse | None]:
    """Decoded JSON, or the 400 answer for a body that is not JSON."""
    try:
        return wire.load_json(_read_body(request)), None
    except wire.WireError as exc:
        return None, _json({"Error": str(exc)}, 400)


@extender_view("filter")
def filter_view(request: HttpRequest) -> HttpResponse:
    raw, bad = _args(request)
    if bad is not None:
        return bad
    try:
        args = wire.parse_extender_args(raw)
    except wire.WireError as exc:
        return _json(wire.filter_result(None, None, error=str(exc)))
    answer = verbs.run_filter(args)
    return _json(wire.filter_result(args, answer.feasible, answer.failed, answer.unresolvable))


@extender_view("prioritize")
def prioritize_view(request: HttpRequest) -> HttpResponse:
    raw, bad = _args(request)
    if bad is not None:
        return bad
    try:
        args = wire.parse_extender_args(raw)
        body = wire.host_priority_list(verbs.run_prioritize(args))
        return HttpResponse(body, content_type="application/json")
    except (wire.WireError, RequestError) as exc:
        # A HostPriorityList has no Error field; the scheduler ignores prioritize errors.
        return _json({"Error": str(exc)}, 400)


@extender_view("preempt")
def preempt_view(request: HttpRequest) -> HttpResponse:
    raw, bad = _args(request)
    if bad is not None:
        return bad
    try:
        args = wire.parse_preemption_args(raw)
        return _json(wire.preemption_result(preempt_verb.run_preempt(args)))
    except (wire.WireError, RequestError) as exc:
        # ExtenderPreemptionResult has no Error field: a non-200 answer is the error.
        return _json({"Error": str(exc)}, 400)


@extender_view("bind")
def bind_view(request: HttpRequest) -> HttpResponse:
    raw, bad = _args(request)
    if bad is not None:
        return bad
    reset_api_ms()
    outcome = "invalid"
    try:
        args = wire.parse_binding_args(raw)
        outcome = verbs.run_bind(args).outcome
        error = ""
    except wire.WireError as exc:
        error = str(exc)
    except verbs.BindFailed as exc:
        outcome, error = exc.outcome, exc.message
    BIND_OUTCOMES.labels(outcome=outcome).inc()
    BIND_APISERVER.observe(api_ms() / 1000.0)
    return _json({"Error": error}, headers={APISERVER_HEADER: f"{api_ms():.3f}"})


# --- admission webhook ---------------------------------------------------------------------------


def _review_response(api_version: str, uid: str, response: dict[str, Any]) -> HttpResponse:
    return _json(
        {
            "apiVersion": api_version,
            "kind": "AdmissionReview",
            "response": {"uid": uid, **response},
        }
    )


def _namespace_of(admission: dict[str, Any], pod: dict[str, Any]) -> str:
    """The pod's namespace: the review's (a pod's own metadata may leave it out at creation)."""
    given = admission.get("namespace")
    if isinstance(given, str) and given:
        return given
    meta = pod.get("metadata")
    named = meta.get("namespace") if isinstance(meta, dict) else None
    return named if isinstance(named, str) and named else "default"


def _admission(request: HttpRequest) -> tuple[str, str, dict[str, Any]] | HttpResponse:
    """An AdmissionReview's (apiVersion, uid, request), or the answer to a call that is none."""
    refused = _refuse_method(request)
    if refused is not None:
        return refused
    try:
        review = wire.load_json(_read_body(request))
    except wire.WireError as exc:
        return _json({"error": str(exc)}, 400)
    admission = review.get("request") if isinstance(review, dict) else None
    if not isinstance(admission, dict):
        admission = {}
    uid = admission.get("uid")
    if not isinstance(uid, str) or not uid:
        return _json(
            {"error": "request.uid: missing; send an AdmissionReview (admission.k8s.io/v1)"}, 400
        )
    api_version = review.get("apiVersion") or "admission.k8s.io/v1"
    if not isinstance(api_version, str) or not api_version.startswith("admission.k8s.io/"):
        api_version = "admission.k8s.io/v1"
    return api_version, uid, admission


def _created(admission: dict[str, Any], kind: str) -> dict[str, Any] | None:
    """The object of a CREATE of `kind` (not of a subresource), else None."""
    named = admission.get("kind") if isinstance(admission.get("kind"), dict) else {}
    obj = admission.get("object")
    if (
        admission.get("operation") != "CREATE"
        or named.get("kind") != kind
        or admission.get("subResource")
        or not isinstance(obj, dict)
    ):
        return None
    return obj


def _verdict(api_version: str, uid: str, decision: Admission) -> HttpResponse:
    if not decision.allowed:
        return _review_response(
            api_version,
            uid,
            {
                "allowed": False,
                "status": {"code": 403, "reason": "Forbidden", "message": decision.message},
            },
        )
    body: dict[str, Any] = {"allowed": True}
    if decision.warnings:
        body["warnings"] = list(decision.warnings)
    if decision.patch:
        body["patchType"] = "JSONPatch"
        body["patch"] = base64.b64encode(json.dumps(decision.patch).encode()).decode("ascii")
    return _review_response(api_version, uid, body)


def _internal_error(uid: str) -> HttpResponse:
    # a webhook bug must not read as a verdict; failurePolicy decides
    log.exception("admission review %s failed", uid)
    return _json({"error": "internal error; the control plane log has it"}, 500)


@csrf_exempt
def mutate_view(request: HttpRequest) -> HttpResponse:
    """`POST /webhook/mutate`: AdmissionReview v1 in, AdmissionReview v1 out (same `uid`)."""
    parsed = _admission(request)
    if isinstance(parsed, HttpResponse):
        return parsed
    api_version, uid, admission = parsed
    pod = _created(admission, "Pod")
    if pod is None:
        return _review_response(api_version, uid, {"allowed": True})
    try:
        if settings.TESSERA["MODE"] == "dra":
            # kube-scheduler allocates claims: the pod's HAMi resources become claims.
            decision = review_pod_dra(
                pod,
                _namespace_of(admission, pod),
                selectors.scheduling_config(),
                settings.TESSERA["SCHEDULER_NAME"],
                selectors.inventory_limits,
                settings.TESSERA["ADOPTED_SCHEDULERS"],
                adapter.get_kube(),
                selectors.shared_card_sizes,
                dry_run=admission.get("dryRun") is True,
            )
        else:
            decision = review_pod(
                pod,
                selectors.scheduling_config(),
                settings.TESSERA["SCHEDULER_NAME"],
                selectors.inventory_limits,
                settings.TESSERA["ADOPTED_SCHEDULERS"],
            )
    except Exception:
        return _internal_error(uid)
    return _verdict(api_version, uid, decision)


@csrf_exempt
def validate_claims_view(request: HttpRequest) -> HttpResponse:
    """`POST /webhook/validate-claims` (DRA mode): Tessera's namespace quotas on the
    ResourceClaims created, and on the claims a created pod's templates will make
    (`claims_admission`). An API server that cannot be read answers 500, so the configuration's
    `failurePolicy: Fail` refuses the create rather than letting a claim past the quota."""
    parsed = _admission(request)
    if isinstance(parsed, HttpResponse):
        return parsed
    api_version, uid, admission = parsed
    claim, pod = _created(admission, "ResourceClaim"), _created(admission, "Pod")
    namespace = admission.get("namespace")
    if (claim is None and pod is None) or not isinstance(namespace, str) or not namespace:
        return _review_response(api_version, uid, {"allowed": True})
    try:
        kube = adapter.get_kube()
        if claim is not None:
            decision = claims_admission.review_claim(claim, namespace, kube)
        else:
            assert pod is not None
            decision = claims_admission.review_pod_claims(pod, namespace, kube)
    except Exception:
        return _internal_error(uid)
    return _verdict(api_version, uid, decision)
