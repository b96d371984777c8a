"""Preemption for GPU slices, as the extender does it; the map of where every piece lives.

Here, in the extender:

- `verb`: kube-scheduler's preempt verb (`POST /scheduler/preempt`): the victims it chose for
  what it sees, with the lower-priority GPU pods that must go too, per candidate node;
- `preemptor`: Tessera's own preemption for a pod kube-scheduler left unschedulable for want of
  GPU room: choose, hold the room, evict, tell, free the room, on one background worker.

Below it, where the layers put them:

- `controlplane.scheduling.preempt`: the pure rule, `choose_victims` (which pods, fewest first);
- `controlplane.ledger.preemption`: the ledger as preemption reads it (each node with the pods
  holding slices there, the holds, the lowest priority holding slices);
- `controlplane.ledger.services.nominations`: the only writer of a hold (`Nomination` rows).

docs/preemption.md tells the whole story.
"""
