"""Tessera's scheduling core: pure functions over frozen dataclasses, standard library only.

Parse a pod's GPU ask (:func:`parse_pod`), test and score nodes (:func:`filter_nodes`,
:func:`prioritize`), choose cards (:func:`place_on_node`) and do quota arithmetic
(:func:`check_quota`). Semantics: docs/scheduling.md.
"""

from controlplane.scheduling.claims import (
    EXCLUSIVE_CORES,
    CardClaim,
    LedgerSlice,
    SliceClaim,
    card_claims,
    claims_per_card,
    pod_claims,
)
from controlplane.scheduling.config import (
    BINPACK,
    POLICIES,
    SPREAD,
    ResourceNames,
    SchedulingConfig,
)
from controlplane.scheduling.explain import explain
from controlplane.scheduling.fit import filter_nodes, fit_node, place_on_node
from controlplane.scheduling.memory import (
    FACTOR_ONE,
    FACTOR_PATTERN,
    FactorError,
    factor_refusal,
    format_factor,
    parse_factor,
    resident_mib,
    virtual_mib,
)
from controlplane.scheduling.quantity import parse_quantity
from controlplane.scheduling.quota import (
    QuotaLimits,
    QuotaUsage,
    check_quota,
    least_demand,
    usage_of,
)
from controlplane.scheduling.request import (
    MIG_RESOURCE_PREFIX,
    ContainerRequest,
    PodRequest,
    RequestError,
    parse_pod,
)
from controlplane.scheduling.result import Assignment, NodeFit, ReasonCode, Refusal
from controlplane.scheduling.score import prioritize, score_node
from controlplane.scheduling.state import CardState, NodeState, Snapshot

__all__ = [
    "BINPACK",
    "EXCLUSIVE_CORES",
    "FACTOR_ONE",
    "FACTOR_PATTERN",
    "MIG_RESOURCE_PREFIX",
    "POLICIES",
    "SPREAD",
    "Assignment",
    "CardClaim",
    "CardState",
    "ContainerRequest",
    "FactorError",
    "LedgerSlice",
    "NodeFit",
    "NodeState",
    "PodRequest",
    "QuotaLimits",
    "QuotaUsage",
    "ReasonCode",
    "Refusal",
    "RequestError",
    "ResourceNames",
    "SchedulingConfig",
    "SliceClaim",
    "Snapshot",
    "card_claims",
    "check_quota",
    "claims_per_card",
    "explain",
    "factor_refusal",
    "filter_nodes",
    "fit_node",
    "format_factor",
    "least_demand",
    "parse_factor",
    "parse_pod",
    "parse_quantity",
    "place_on_node",
    "pod_claims",
    "prioritize",
    "resident_mib",
    "score_node",
    "usage_of",
    "virtual_mib",
]
