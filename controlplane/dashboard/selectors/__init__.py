"""Reads for the dashboard, the operations API and /metrics, in a fixed number of queries; one
module per audience, the names their callers use re-exported here.

- `overview`: the overview page and /metrics (cluster totals, pending pods, held room, samples);
- `cards`: a card's bar of slices, a MIG card's layout, one card's page;
- `nodes`: the node pages (nodes with their cards);
- `bindings`: the bindings page and one pod's page;
- `quotas`: namespace limits beside what each holds;
- `audit`: the audit page;
- `operations`: the operations API's lists of slices, cards and nodes;
- `access`: the admin's users and tokens.

Every selector issues the same number of queries however many nodes, cards and slices there
are (tests lock the counts): rows come from `values_list` and are folded in one pass in Python.
How full a card or a namespace is comes from the ledger's one usage arithmetic
(`controlplane.ledger.usage`, the scheduling core's rule), so the dashboard and the scheduler
never disagree; where a pod stands, from `controlplane.ledger.why`; a MIG card's geometry from
`controlplane.scheduling.mig`; a user's role from `controlplane.access.roles`.
"""

from controlplane.dashboard.selectors.access import access_tokens, access_users
from controlplane.dashboard.selectors.audit import audit_actions, audit_page
from controlplane.dashboard.selectors.bindings import (
    BINDING_SORTS,
    DEFAULT_BINDING_SORT,
    BindingFilters,
    binding_namespaces,
    binding_page,
    binding_queryset,
    binding_views,
    pod_detail,
)
from controlplane.dashboard.selectors.cards import card_detail, card_views
from controlplane.dashboard.selectors.common import PAGE_SIZE
from controlplane.dashboard.selectors.nodes import NODE_FILTERS, node_detail, node_page, node_views
from controlplane.dashboard.selectors.operations import (
    card_queryset,
    node_filter,
    slice_dicts,
    slice_queryset,
)
from controlplane.dashboard.selectors.overview import (
    Overview,
    allocation_samples,
    attention_cards,
    cluster_overview,
    common_request_size,
    pending_counts,
    pending_pods,
    room_holds,
    stranded_memory,
)
from controlplane.dashboard.selectors.quotas import QuotaRow, quota_rows

__all__ = [
    "BINDING_SORTS",
    "DEFAULT_BINDING_SORT",
    "NODE_FILTERS",
    "PAGE_SIZE",
    "BindingFilters",
    "Overview",
    "QuotaRow",
    "access_tokens",
    "access_users",
    "allocation_samples",
    "attention_cards",
    "audit_actions",
    "audit_page",
    "binding_namespaces",
    "binding_page",
    "binding_queryset",
    "binding_views",
    "card_detail",
    "card_queryset",
    "card_views",
    "cluster_overview",
    "common_request_size",
    "node_detail",
    "node_filter",
    "node_page",
    "node_views",
    "pending_counts",
    "pending_pods",
    "pod_detail",
    "quota_rows",
    "room_holds",
    "slice_dicts",
    "slice_queryset",
    "stranded_memory",
]
