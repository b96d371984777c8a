"""The mutating webhook's decision in DRA mode (`TESSERA_MODE=dra`): a HAMi-style pod made to
ask its GPUs through ResourceClaims (docs/dra.md, *HAMi pods in DRA mode*).

The same pods are Tessera's as in extender mode (no scheduler named, Tessera's, or an adopted
one) and the same pods are refused (`webhook.read_pod`: a preset node, a privileged GPU
container, an ask larger than any card). The rest is translated (`dra_translate.translate`);
each template the pod needs is made to exist in the pod's namespace with exactly the spec its
name stands for:

- absent: created by the webhook (its ServiceAccount may `get` and `create`
  resourceclaimtemplates, nothing more); a create that meets one made meanwhile (another
  replica, the next pod of a Deployment) reads it and checks it as below;
- present with the same spec: used (the API server keeps a template's spec immutable);
- present with another spec (planted by someone who can write templates in the namespace,
  or left by a different version): the pod is refused, naming the template, since its claim
  would not be what the pod asked for.

A dry-run admission creates nothing (the webhook is registered `sideEffects: NoneOnDryRun`):
it checks what exists and answers as the real request would.

Pods naming Tessera's scheduler get `default-scheduler`: in DRA mode kube-scheduler allocates
the claims and no tessera-scheduler runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from controlplane.extender.dra_translate import ClaimTemplate, same_spec, translate
from controlplane.extender.webhook import DEFAULT_SCHEDULER, Admission, deny, read_pod
from controlplane.kube.base import Kube, KubeError
from controlplane.ledger.selectors import InventoryLimits
from controlplane.scheduling import RequestError, SchedulingConfig

log = logging.getLogger(__name__)


class TemplateRefused(Exception):
    """A template the pod needs cannot be used; the message says which and why."""


def review_pod_dra(
    pod: Mapping[str, Any],
    namespace: str,
    config: SchedulingConfig,
    scheduler_name: str,
    inventory: Callable[[], InventoryLimits],
    adopted: tuple[str, ...],
    kube: Kube,
    card_sizes: Callable[[], tuple[int, ...]],
    dry_run: bool = False,
) -> Admission:
    """Allow untouched, allow with the claims' patch, or deny with the reason. ``card_sizes``
    gives the memory sizes of the cluster's shared cards (for memory percentages)."""
    reviewed = read_pod(pod, config, scheduler_name, inventory, adopted)
    if reviewed.verdict is not None or reviewed.request is None:
        return reviewed.verdict or Admission(True)
    try:
        translation = translate(pod, reviewed.request, config, card_sizes())
    except RequestError as exc:
        return deny(exc.field, exc.message)
    try:
        for template in translation.templates:
            ensure_template(kube, namespace, template, dry_run)
    except TemplateRefused as exc:
        return deny("", str(exc))
    patch = list(translation.patch)
    if pod["spec"].get("schedulerName") == scheduler_name:
        patch.append({"op": "replace", "path": "/spec/schedulerName", "value": DEFAULT_SCHEDULER})
    return Admission(True, patch=patch, warnings=translation.warnings)


def ensure_template(kube: Kube, namespace: str, template: ClaimTemplate, dry_run: bool) -> None:
    """Make ``template`` exist in ``namespace`` with its spec (see module docstring).

    Raises TemplateRefused for a template of that name with another spec, KubeError when the
    API server cannot be asked (the webhook then answers an error, and the API server applies
    the webhook's failurePolicy)."""
    found = kube.get_claim_template(namespace, template.name)
    if found is None and not dry_run:
        try:
            kube.create_claim_template(template.manifest(namespace))
            log.info("created ResourceClaimTemplate %s/%s", namespace, template.name)
            return
        except KubeError as exc:
            if exc.status in (400, 422):
                # The API server's validation (a selector too costly, say): the pod's owner can
                # act on that, so it is the refusal's message, not an internal error.
                raise TemplateRefused(
                    f"the ResourceClaimTemplate this pod needs was refused by the API server: "
                    f"{exc.message}"
                ) from exc
            if not exc.conflict:
                raise
            found = kube.get_claim_template(namespace, template.name)
            if found is None:  # created and deleted again in between: let the pod retry
                raise
    if found is None:
        return  # a dry run: the real request creates it
    if not same_spec(found.get("spec") or {}, template.spec):
        raise TemplateRefused(
            f"the ResourceClaimTemplate {namespace}/{template.name} exists with a spec other "
            "than the one Tessera writes under that name (the name is a digest of the spec), so "
            "a claim made from it would not be what this pod asks for. Delete that template "
            "(Tessera creates the right one at the next pod) or ask your GPUs with a claim of "
            "your own"
        )
