"""The ledger's services: the only code that writes ledger rows, one module per domain.

- `bindings`: `bind_pod` (lock -> recompute -> write -> commit), releases, the confirmations the
  reconciler and the node plugins make, adopting a signed allocation the ledger lacks;
- `confirmations`: reserved -> bound after the API server accepted the Binding, batched off
  bind's path, retried until written;
- `nodes`: a node plugin's inventory report (its heartbeat), stale and deleted nodes, card slots;
- `cordons`: operators' cordons of nodes and cards;
- `quotas`: namespace quotas;
- `decisions`: the scheduling decision log (diagnostics behind "why is my pod pending?");
- `audit`: audit events, written in the transaction of the change they record.

Lock order everywhere: namespace quota, then node, then its cards, so two writers never
deadlock on each other. Every change of a node, card or binding row moves its `updated_at`
(`controlplane.ledger.models.Stamped`): the extender's snapshot cache finds changes by it.
`tests/ledger/test_ownership.py` drives every service and checks both facts: only these modules
write ledger rows, and the cache sees what each one changed.
"""
