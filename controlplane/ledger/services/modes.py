"""Card modes (docs/card-modes.md): an operator's change of a card's mode, the pending change a
card with slices drains for, and the mode a new card starts in.

A card with no active slice changes at once. A card with slices keeps its mode and records the
requested one as `pending_mode`: it is draining (it takes no new slices, `Card.schedulable`) and
the change applies when its last slice ends, from the release path (after the release commits)
and from the reconciler's periodic pass, should that be missed. Every write takes the card's
node row lock first, as bind does, so a bind in flight either sees the draining flag or
committed its slices before the change counts them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from django.db import transaction
from django.db.models import Exists, OuterRef

from controlplane.ledger.errors import ServiceError
from controlplane.ledger.models import Card, Slice
from controlplane.ledger.services.audit import record_event
from controlplane.ledger.services.mode_rules import MODES, SYSTEM, Mode, mig_geometry_known
from controlplane.ledger.services.nodes import lock_card

MAX_REASON = 500


@dataclass(frozen=True, slots=True)
class CardMode:
    """A card's mode after `set_card_mode`; `pending_mode` is the one it drains for (blank when
    none)."""

    uuid: str
    mode: str
    pending_mode: str


def _check_mode(mode: object) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ServiceError(
            f"mode: {mode!r} is not a card mode; give one of {', '.join(MODES)}", field="mode"
        )
    return mode


def _check_can_take(card: Card, mode: str) -> None:
    """Refuse a mode the card cannot run (checked only when the mode would change)."""
    if mode != Mode.MIG:
        return
    if not card.mig_capable:
        raise ServiceError(
            f"mode: card {card.uuid} ({card.model or 'unknown model'}) is not reported MIG-capable "
            "by its node plugin; only cards that support MIG can be put in mig mode",
            field="mode",
        )
    if not mig_geometry_known(card.model):
        raise ServiceError(
            f"mode: Tessera has no MIG geometry (profiles and placements) for model "
            f"{card.model!r}; this card cannot be put in mig mode",
            field="mode",
        )


def active_slices(card_id: int) -> int:
    return Slice.objects.filter(card_id=card_id, active=True).count()


@transaction.atomic(durable=True)
def set_card_mode(uuid: str, mode: str, actor: str, reason: str = "") -> CardMode:
    """An operator sets a card's mode: at once when nothing is on the card, else when its last
    slice ends (draining meanwhile). Asking for the mode the card is in cancels a pending change.

    Refused (nothing changed): an unknown mode, `mig` for a card that cannot do MIG; NotFound for
    an unknown card. Audited when something changes.
    """
    mode = _check_mode(mode)
    reason = reason[:MAX_REASON]
    card = lock_card(uuid)
    node = card.node.name
    if mode == card.mode:
        if card.pending_mode:
            pending, card.pending_mode = card.pending_mode, ""
            card.save(update_fields=["pending_mode"])
            record_event(
                actor, "card-mode-cancelled", "card", uuid, node=node, mode=card.mode,
                cancelled=pending, reason=reason,
            )  # fmt: skip
        return CardMode(card.uuid, card.mode, card.pending_mode)
    _check_can_take(card, mode)
    held = active_slices(card.pk)
    if held == 0:
        before = card.mode
        card.mode, card.pending_mode = mode, ""
        card.save(update_fields=["mode", "pending_mode"])
        record_event(
            actor, "card-mode", "card", uuid, node=node, reason=reason,
            **{"from": before, "to": mode},
        )  # fmt: skip
    elif card.pending_mode != mode:
        card.pending_mode = mode
        card.save(update_fields=["pending_mode"])
        record_event(
            actor, "card-mode-requested", "card", uuid, node=node, reason=reason, slices=held,
            **{"from": card.mode, "to": mode},
        )  # fmt: skip
    return CardMode(card.uuid, card.mode, card.pending_mode)


# --- the drain ends ------------------------------------------------------------------------------


def _drained() -> Iterable[int]:
    """Ids of cards waiting for a mode change that hold no active slice any more."""
    held = Slice.objects.filter(card=OuterRef("pk"), active=True)
    return (
        Card.objects.exclude(pending_mode="")
        .exclude(Exists(held))
        .order_by("id")
        .values_list("id", flat=True)
    )


def apply_pending_modes(card_ids: Sequence[int] | None = None, actor: str = SYSTEM) -> list[str]:
    """Apply the pending change of each drained card (all, or these): idempotent, one
    transaction per card under its node's lock, re-checked there. The UUIDs changed."""
    ids = list(_drained()) if card_ids is None else list(card_ids)
    return [uuid for card_id in ids if (uuid := _apply_pending(card_id, actor))]


@transaction.atomic(durable=True)
def _apply_pending(card_id: int, actor: str) -> str:
    uuid = Card.objects.filter(pk=card_id).values_list("uuid", flat=True).first()
    if uuid is None:
        return ""
    card = lock_card(uuid)
    if not card.pending_mode or active_slices(card.pk):
        return ""  # applied meanwhile, cancelled, or not drained after all
    before, card.mode, card.pending_mode = card.mode, card.pending_mode, ""
    card.save(update_fields=["mode", "pending_mode"])
    record_event(
        actor, "card-mode", "card", uuid, node=card.node.name,
        reason="its last slice ended", **{"from": before, "to": card.mode},
    )  # fmt: skip
    return uuid


def apply_after_release(binding_ids: Sequence[int]) -> None:
    """Called by the release path inside its transaction, after the bindings' slices ended: the
    draining cards they were on get their pending change once the release commits (a card's
    change locks its node, which a release does not hold: it must not wait inside one)."""
    cards = list(
        Card.objects.exclude(pending_mode="")
        .filter(slices__binding_id__in=list(binding_ids))
        .values_list("id", flat=True)
        .distinct()
    )
    if cards:
        # robust: the release has committed whatever happens here, and its caller must not read
        # a failed change as a failed release; Django logs the error, the reconciler's pass
        # applies the change.
        transaction.on_commit(lambda: apply_pending_modes(cards), robust=True)
