"""Builders for the dashboard tests: people with roles, pods holding slices, decisions."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.models import AbstractUser
from django.test import Client
from django.utils import timezone

from controlplane.access.roles import Role
from controlplane.access.services import grant_role
from controlplane.ledger.models import PodBinding, SchedulingDecision
from controlplane.ledger.services import bindings
from controlplane.scheduling import parse_pod
from tests.builders import make_node
from tests.pods import gpu_container, pod_json

PASSWORD = "correct-horse-battery-staple"

__all__ = ["PASSWORD", "decision", "gpu_container", "make_node", "person", "pod", "signed_in"]


def person(username: str, role: Role | None, password: str = PASSWORD) -> AbstractUser:
    """A user who can sign in with `password`, holding `role` (None: no Tessera role)."""
    if role is None:
        from django.contrib.auth import get_user_model

        user = get_user_model().objects.create(username=username)
    else:
        user = grant_role(username, role)
    user.set_password(password)
    user.save(update_fields=["password"])
    return user


def signed_in(role: Role | None, username: str | None = None) -> Client:
    """A Django test client with a session of a person holding `role`."""
    client = Client()
    client.force_login(person(username or f"{role.value if role else 'norole'}-user", role))
    return client


def pod(
    name: str,
    node: str,
    *containers: dict[str, Any],
    namespace: str = "default",
    phase: str = "bound",
    init_containers: list[dict[str, Any]] | None = None,
    uid: str | None = None,
) -> PodBinding:
    """Reserve room for a pod through the ledger's service, then confirm it when `phase` says."""
    body = pod_json(name, namespace, uid, containers=list(containers) or [gpu_container()])
    if init_containers:
        body["spec"]["initContainers"] = init_containers
    request = parse_pod(body)
    assert request is not None
    reservation = bindings.bind_pod(request, node)
    if phase in ("bound", "allocated"):
        bindings.confirm_binding(request.uid)
    if phase in ("released", "failed"):
        bindings.release_binding(request.uid, "test", failed=phase == "failed")
    return PodBinding.objects.get(pk=reservation.binding_id)


def decision(
    name: str,
    namespace: str = "default",
    outcome: str = "unschedulable",
    summary: str = "no node has 90000 MiB free on one card",
    **kw: Any,
) -> SchedulingDecision:
    """The extender's decision log row for a pod (written here as the extender would)."""
    return SchedulingDecision.objects.create(
        pod_uid=kw.pop("pod_uid", f"uid-{namespace}-{name}"),
        namespace=namespace,
        name=name,
        outcome=outcome,
        summary=summary,
        decided_at=kw.pop("decided_at", timezone.now()),
        **kw,
    )
