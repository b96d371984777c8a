"""Card modes' rules that hold no lock and write nothing: which modes there are, whether a card's
model can run MIG, the mode a new card starts in, and a card's mode in words
(docs/card-modes.md). The services (`modes`, `nodes`) and the pages share them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from controlplane.ledger.models import Card
from controlplane.scheduling.mig import geometry_for

Mode = Card.Mode
MODES: tuple[str, ...] = tuple(Mode.values)
SYSTEM = "system"  # the actor of changes nobody asked for at that moment (drain, defaults)


def mig_geometry_known(model: str) -> bool:
    """Does the scheduling core know `model`'s MIG geometry (its profiles and placements)?

    The one place Tessera asks it: an operator's `mig` (`modes.set_card_mode`) and a `mig`
    default for a new card (`initial_mode`) are refused without it. The core's
    `controlplane.scheduling.mig.geometry_for` answers it (None: no geometry).
    """
    return geometry_for(model) is not None


def _mode_name(mode: str) -> str:
    return str(Mode(mode).label) if mode in MODES else mode


@dataclass(frozen=True, slots=True)
class InitialMode:
    mode: str
    note: str  # why, for the audit: the rule, or why the rule could not be followed


def initial_mode(
    model: str, mig_capable: bool, rules: Sequence[Mapping[str, str]]
) -> InitialMode | None:
    """The mode a new card starts in: the first rule whose `model` is in the card's model
    (case-insensitive); None when no rule matches (the card stays `shared`, nothing to audit).
    A `mig` rule for a card that cannot do MIG leaves it shared, and says so."""
    for position, rule in enumerate(rules):
        if rule["model"].lower() not in model.lower():
            continue
        which = f"TESSERA_CARD_MODE_DEFAULTS[{position}] (model {rule['model']!r})"
        mode = rule["mode"]
        if mode == Mode.MIG and not (mig_capable and mig_geometry_known(model)):
            why = "not reported MIG-capable" if not mig_capable else "no MIG geometry for model"
            return InitialMode(Mode.SHARED, f"{which} asks mig, but the card is {why}: shared")
        return InitialMode(mode, which)
    return None


def describe(mode: str, pending_mode: str, slices: int) -> str:
    """The card's mode in words, as the dashboard and the REST card say it."""
    if not pending_mode:
        return _mode_name(mode)
    becomes = f"draining: becomes {_mode_name(pending_mode)}"
    if slices > 1:
        return f"{becomes} when its {slices} slices end"
    if slices == 1:
        return f"{becomes} when its last slice ends"
    return f"{becomes} at the reconciler's next pass"
