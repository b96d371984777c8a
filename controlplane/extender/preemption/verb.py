"""The extender's preempt verb: kube-scheduler's preemption, seen with GPU slices.

When kube-scheduler preempts (for CPU, memory, ports, ... which its own filters see), it asks the
extender about each candidate node with the victims it chose there. Those victims free none of
the GPU room that kube-scheduler cannot see, so the answer per node is:

- the pod fits Tessera's view of the node once those victims are gone: keep the node, same
  victims;
- it fits only if some of the node's lower-priority GPU pods go too: keep the node with those
  added (the fewest, by the core's `choose_victims`);
- it cannot fit however many lower-priority pods go: drop the node.

A pod that asks for no GPU is not Tessera's business: every node comes back as it came.

The other pieces of preemption are mapped in `controlplane.extender.preemption`.
"""

from __future__ import annotations

import logging

from controlplane.extender.wire import NodeVictims, PreemptionArgs
from controlplane.ledger import preemption, selectors
from controlplane.scheduling import parse_pod
from controlplane.scheduling.preempt import Victims, choose_victims

log = logging.getLogger(__name__)


def run_preempt(args: PreemptionArgs) -> dict[str, NodeVictims]:
    """The candidate nodes kept, each with its victims (RequestError for a bad pod request)."""
    request = parse_pod(args.pod, selectors.scheduling_config())
    if request is None or not args.victims:
        return dict(args.victims)
    kept: dict[str, NodeVictims] = {}
    known = preemption.nodes_with_pods(args.victims)
    for name, given in args.victims.items():
        if name not in known:
            continue  # no Tessera cards there: a GPU pod cannot run on it
        node, pods = known[name]
        gone = set(given.uids)
        leaving = [p for p in pods if p.uid in gone]
        staying = [p for p in pods if p.uid not in gone]
        exclusive = frozenset(
            uuid for p in staying for uuid, claim in p.claims.items() if claim.exclusive
        )
        after = node.without_claims([p.claims for p in leaving], exclusive)
        # kube-scheduler weighs PodDisruptionBudgets for its own victims (best effort, as the
        # count it sends says); the GPU victims added here are not in that count.
        chosen = choose_victims(after, request, staying, priority=request.pod_priority)
        if isinstance(chosen, Victims):
            extra = tuple(p.uid for p in chosen.pods)
            kept[name] = NodeVictims(given.uids + extra, given.pdb_violations)
        else:
            log.debug(
                "preempt: drop %s for %s/%s: %s",
                name, request.namespace, request.name, chosen.reason,
            )  # fmt: skip
    return kept
