"""What the core answers: card assignments, or refusals that say why not."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controlplane.scheduling.claims import SliceClaim

if TYPE_CHECKING:
    from controlplane.scheduling.request import PodRequest
    from controlplane.scheduling.state import NodeState


class ReasonCode(enum.StrEnum):
    """Why a card, a node or a namespace cannot take a pod. Stable: stored in decision logs."""

    INSUFFICIENT_MEMORY = "InsufficientMemory"
    INSUFFICIENT_COMPUTE = "InsufficientCompute"
    NO_FREE_SLOT = "NoFreeSlot"
    EXCLUSIVE_CONFLICT = "ExclusiveConflict"
    TYPE_EXCLUDED = "TypeExcluded"
    UUID_EXCLUDED = "UuidExcluded"
    UNHEALTHY = "Unhealthy"
    CARD_CORDONED = "CardCordoned"
    NODE_CORDONED = "NodeCordoned"
    NODE_NOT_READY = "NodeNotReady"
    NO_CARDS = "NoCards"
    TOO_FEW_CARDS = "TooFewCards"
    QUOTA_EXCEEDED = "QuotaExceeded"
    UNKNOWN_NODE = "UnknownNode"
    MODE_MISMATCH = "ModeMismatch"
    CARD_DRAINING = "CardDraining"
    MIG_NOT_ENABLED = "MigNotEnabled"
    NO_MIG_PLACEMENT = "NoMigPlacement"


# Short labels for one-line summaries ("also: 3 insufficient memory").
_LABELS: dict[ReasonCode, str] = {
    ReasonCode.INSUFFICIENT_MEMORY: "insufficient memory",
    ReasonCode.INSUFFICIENT_COMPUTE: "insufficient compute",
    ReasonCode.NO_FREE_SLOT: "no free slot",
    ReasonCode.EXCLUSIVE_CONFLICT: "exclusive conflict",
    ReasonCode.TYPE_EXCLUDED: "type excluded",
    ReasonCode.UUID_EXCLUDED: "uuid excluded",
    ReasonCode.UNHEALTHY: "unhealthy",
    ReasonCode.CARD_CORDONED: "card cordoned",
    ReasonCode.NODE_CORDONED: "node cordoned",
    ReasonCode.NODE_NOT_READY: "node not ready",
    ReasonCode.NO_CARDS: "no cards",
    ReasonCode.TOO_FEW_CARDS: "too few cards",
    ReasonCode.QUOTA_EXCEEDED: "quota exceeded",
    ReasonCode.UNKNOWN_NODE: "unknown node",
    ReasonCode.MODE_MISMATCH: "mode mismatch",
    ReasonCode.CARD_DRAINING: "card draining",
    ReasonCode.MIG_NOT_ENABLED: "MIG not enabled",
    ReasonCode.NO_MIG_PLACEMENT: "no MIG placement",
}


@dataclass(frozen=True, slots=True)
class Refusal:
    """One reason a pod cannot go somewhere.

    ``permanent`` is True when freeing room on the node (other pods ending or being
    preempted) cannot help: the card is excluded, unhealthy or cordoned, or too small in
    total. It maps to the extender's ``FailedAndUnresolvableNodes``, which tells
    kube-scheduler not to preempt pods there in vain; the pod is still retried later.
    """

    code: ReasonCode
    message: str
    card_uuid: str | None
    permanent: bool


@dataclass(frozen=True, slots=True)
class Assignment:
    """One slice of one container placed on one card.

    ``sidecar`` and ``priority`` are the container's (see ContainerRequest), carried so the
    ledger row and the allocation record say them without the request at hand. ``mode`` is
    the card's (docs/card-modes.md); on a MIG card the slice is one GPU instance of
    ``mig_profile`` covering ``mig_size`` memory slices from ``mig_start``.
    ``resident_mib``: the part of the slice that stays on the card when the pod opted in to
    virtual device memory and the card's factor is above 1; None: all of it.
    """

    container_name: str
    container_index: int
    init: bool
    card_uuid: str
    memory_mib: int
    cores: int
    sidecar: bool = False
    priority: int | None = None
    mode: str = "shared"
    mig_profile: str = ""
    mig_start: int = 0
    mig_size: int = 0
    resident_mib: int | None = None

    def to_claim(self) -> SliceClaim:
        """The ledger row this assignment becomes."""
        return SliceClaim(
            card_uuid=self.card_uuid,
            container_index=self.container_index,
            init=self.init,
            memory_mib=self.memory_mib,
            cores=self.cores,
            sidecar=self.sidecar,
            mig_start=self.mig_start,
            mig_size=self.mig_size,
            resident_mib=self.resident_mib,
        )


@dataclass(frozen=True, slots=True, init=False, eq=False, repr=False)
class NodeFit:
    """Whether a pod fits a node and, if not, why.

    ``refusals`` is empty iff ``feasible``. The filter builds infeasible results with a
    deferred explanation, so the per-card sentences are only worked out for nodes whose
    reasons somebody reads; the outcome is the same as if they had been built eagerly.
    """

    node: str
    feasible: bool
    _refusals: tuple[Refusal, ...] | None
    # A deferred explanation is three references, not a closure: the filter makes one of
    # these per infeasible node per cycle, and fewer allocations mean fewer GC pauses.
    _explain: Callable[[NodeState, PodRequest], tuple[Refusal, ...]] | None
    _state: NodeState | None
    _request: PodRequest | None
    _summary: str | None  # summary(), once worked out

    def __init__(self, node: str, feasible: bool, refusals: Iterable[Refusal] = ()) -> None:
        found = tuple(refusals)
        if feasible and found:
            raise ValueError("a feasible NodeFit carries no refusals")
        if not feasible and not found:
            raise ValueError("an infeasible NodeFit needs at least one refusal")
        object.__setattr__(self, "node", node)
        object.__setattr__(self, "feasible", feasible)
        object.__setattr__(self, "_refusals", found)
        object.__setattr__(self, "_explain", None)
        object.__setattr__(self, "_state", None)
        object.__setattr__(self, "_request", None)
        object.__setattr__(self, "_summary", None)

    @classmethod
    def deferred(
        cls,
        explain: Callable[[NodeState, PodRequest], tuple[Refusal, ...]],
        state: NodeState,
        request: PodRequest,
    ) -> NodeFit:
        """An infeasible fit whose refusals ``explain(state, request)`` works out when read."""
        fit = object.__new__(cls)
        _set_node(fit, state.name)
        _set_feasible(fit, False)
        _set_refusals(fit, None)
        _set_explain(fit, explain)
        _set_state(fit, state)
        _set_request(fit, request)
        _set_summary(fit, None)
        return fit

    @property
    def refusals(self) -> tuple[Refusal, ...]:
        """Reasons, most useful first; empty iff feasible."""
        found = self._refusals
        if found is None:
            explain, state, request = self._explain, self._state, self._request
            assert explain is not None and state is not None and request is not None
            found = explain(state, request)
            if not found:
                raise AssertionError(f"no refusal explains why node {self.node} is infeasible")
            # Caching a pure function of immutable inputs: two racing threads write equal values.
            object.__setattr__(self, "_refusals", found)
        return found

    @property
    def permanent(self) -> bool:
        """True when the node is infeasible and every refusal is permanent."""
        return not self.feasible and all(r.permanent for r in self.refusals)

    def summary(self) -> str:
        """One line a person can act on: the main reason, then counts of the others."""
        if self.feasible:
            return "fits"
        found = self._summary
        if found is None:
            first, *rest = self.refusals
            if not rest:
                found = first.message
            else:
                counts = Counter(r.code for r in rest)
                others = ", ".join(f"{n} {_LABELS[code]}" for code, n in counts.most_common())
                found = f"{first.message} (also: {others})"
            # Caching a pure function of immutable inputs: two racing threads write equal values.
            _set_summary(self, found)
        return found

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, NodeFit):
            return NotImplemented
        return (self.node, self.feasible, self.refusals) == (
            other.node,
            other.feasible,
            other.refusals,
        )

    def __hash__(self) -> int:
        return hash((self.node, self.feasible, self.refusals))

    def __repr__(self) -> str:
        return f"NodeFit(node={self.node!r}, feasible={self.feasible}, refusals={self.refusals!r})"


# The slots' own setters: the filter makes a deferred fit per infeasible node (thousands a
# cycle on a large cluster), and these skip the lookup by name object.__setattr__ does, which
# took a third of the fit's cost.
_set_node, _set_feasible, _set_refusals, _set_explain, _set_state, _set_request, _set_summary = (
    NodeFit.__dict__[slot].__set__
    for slot in ("node", "feasible", "_refusals", "_explain", "_state", "_request", "_summary")
)
