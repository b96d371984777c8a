"""The cluster as the core sees it: nodes, cards and the room already taken on them.

A :class:`NodeState` precomputes, once at construction, flat tuples of the numbers the
filter looks at (free memory, free compute, free slots of each schedulable card). The
filter runs for every node of the cluster on every scheduling cycle, and reading a few
ints from a tuple is an order of magnitude cheaper than walking card objects.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from itertools import pairwise
from typing import Any

from controlplane.scheduling.claims import CardClaim
from controlplane.scheduling.memo import (
    MEMO_KEYS,
    RANK_KEYS,
    STALE_NAMES,
    PerNode,
    Ranking,
    Stale,
    V,
    keep,
)
from controlplane.scheduling.memory import FACTOR_ONE, virtual_mib
from controlplane.scheduling.mig import MigGeometry, geometry_for

#: Card modes (docs/card-modes.md): how a card is shared, and so which slices it takes.
SHARED = "shared"
MIG = "mig"
MPS = "mps"
EXCLUSIVE = "exclusive"
CARD_MODES: tuple[str, ...] = (SHARED, MIG, MPS, EXCLUSIVE)


@dataclass(frozen=True, slots=True)
class CardState:
    """One physical GPU and the room already claimed on it (summed from the ledger)."""

    uuid: str
    index: int
    model: str
    memory_mib: int
    compute_units: int  # 100 = the whole card
    slots: int  # most slices the card may hold at once
    numa_node: int | None
    healthy: bool
    health_reason: str
    cordoned: bool
    used_memory_mib: int = 0
    used_compute: int = 0
    used_slots: int = 0
    exclusive: bool = False  # holds a slice with 100% compute
    mode: str = SHARED  # one of CARD_MODES
    draining: bool = False  # a mode change waits for the card's slices to end: takes nothing
    mig_enabled: bool = False  # MIG is on in the GPU now (the node plugin says so)
    mig_used: int = 0  # memory slices MIG instances cover, bit i = slice i
    # Virtual device memory (docs/virtual-memory.md): the card's oversubscription factor in
    # hundredths (100 = off), and the sum of its slices' resident parts (None: equal to
    # used_memory_mib, nothing spills). Only shared cards oversubscribe.
    factor: int = FACTOR_ONE
    used_resident_mib: int | None = None

    @property
    def resident_used(self) -> int:
        """MiB the card's slices keep on the card."""
        return self.used_memory_mib if self.used_resident_mib is None else self.used_resident_mib

    @property
    def virtual_mib(self) -> int:
        """The most MiB the card's slices may add up to: f x its memory on a shared card, its
        memory on a card of another mode (only shared cards oversubscribe)."""
        return virtual_mib(self.memory_mib, self.factor if self.mode == SHARED else FACTOR_ONE)

    @property
    def schedulable(self) -> bool:
        """Healthy and not cordoned: the card may take new slices if it has room."""
        return self.healthy and not self.cordoned

    @property
    def busy(self) -> bool:
        """Holds at least one slice (an exclusive slice needs a card where this is False)."""
        return (
            self.used_slots > 0
            or self.used_memory_mib > 0
            or self.used_compute > 0
            or self.exclusive
        )

    @property
    def free_memory_mib(self) -> int:
        """Memory a slice that does not oversubscribe may still take: what is left of the
        card's memory and of its virtual memory, the smaller (with f = 1, memory not claimed
        by any slice)."""
        free = self.memory_mib - self.used_memory_mib
        if self.factor != FACTOR_ONE or self.used_resident_mib is not None:
            free = min(
                self.memory_mib - self.resident_used, self.virtual_mib - self.used_memory_mib
            )
        return free

    @property
    def free_compute(self) -> int:
        """Compute units not claimed by any slice."""
        return self.compute_units - self.used_compute

    @property
    def free_slots(self) -> int:
        """Slice slots still open."""
        return self.slots - self.used_slots


_NO_MODES: frozenset[str] = frozenset()
NO_NUMA = 1 << 30  # NodeView.numa of a card without a reported NUMA node
KEY_BITS = 6
KEY_SPAN = 1 << KEY_BITS
KEY_MASK = KEY_SPAN - 1


# model_l, uuid_l, labels, models_key (see NodeView._texts)
_Texts = tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...], str]


class NodeView:
    """Flat, precomputed numbers of one node's schedulable cards (internal to the core).

    A plain slotted class rather than a dataclass: it is built once per node per snapshot
    and read in the filter's innermost loop, where attribute access on ``__slots__`` is the
    cheapest Python offers. Cards are ordered by (index, position) so that "ties go to the
    lower index" is simply "ties go to the earlier position".
    """

    __slots__ = (
        "_lanes",
        "_numa",
        "_ready",
        "_tcu",
        "_text",
        "avg_mem",
        "busy",
        "by_index",
        "cards",
        "d_fcu",
        "d_fmem",
        "d_fslots",
        "excl",
        "factors",
        "fcu",
        "fmem",
        "fslots",
        "keys_binpack",
        "keys_spread",
        "live_compute",
        "live_free",
        "live_slots",
        "max_fcu",
        "max_fmem",
        "mem_total",
        "mem_used",
        "mig_geo",
        "mig_used",
        "min_live_slots",
        "mode",
        "modes",
        "n",
        "ok",
        "oversub",
        "raw_fmem",
        "rfree",
        "spill_free",
        "tmem",
        "vfree",
    )

    def __init__(
        self,
        ready: bool,
        cordoned: bool,
        cards: tuple[CardState, ...],
        mode: str = SHARED,
        spill_free: int = 0,
    ) -> None:
        # One pass over the cards (this runs for every node of every snapshot), in index
        # order; selectors usually hand cards over sorted already. The view holds the cards
        # of one mode (its lane): a node's view is the shared lane, and `lane` builds the
        # others on first use, for the few nodes that have such cards.
        ordered = cards
        if any(a.index > b.index for a, b in pairwise(cards)):
            ordered = tuple(sorted(cards, key=lambda c: c.index))  # stable: ties keep order
        sched: list[CardState] = []
        by_index: list[tuple[CardState, int]] = []
        tmem: list[int] = []
        raw: list[int] = []
        fcu: list[int] = []
        fslots: list[int] = []
        busy: list[bool] = []
        excl: list[bool] = []
        fmem: list[int] = []
        used_mem = 0
        modes: set[str] | None = None
        mig = mode == MIG
        # Cards with a factor, or with slices that spill: their two budgets (rfree, vfree),
        # by position. None on the nodes without any, nearly all.
        budgets: list[int] | None = None
        for c in ordered:
            if not c.healthy or c.cordoned or c.draining or c.mode != mode:
                by_index.append((c, -1))
                if c.mode != SHARED:
                    if modes is None:
                        modes = set()
                    modes.add(c.mode)
                continue
            if mig and not c.mig_enabled:  # MIG set but not on in the GPU yet
                by_index.append((c, -1))
                continue
            by_index.append((c, len(sched)))
            sched.append(c)
            free = c.memory_mib - c.used_memory_mib
            if c.factor != FACTOR_ONE or c.used_resident_mib is not None:
                # A slice that does not oversubscribe needs room in both budgets: the card's
                # memory less the resident parts, f x the memory less the slices. Only
                # shared cards oversubscribe.
                factor = c.factor if mode == SHARED else FACTOR_ONE
                rfree = c.memory_mib - c.resident_used
                vfree = virtual_mib(c.memory_mib, factor) - c.used_memory_mib
                free = min(rfree, vfree)
                if budgets is None:
                    budgets = []
                    for before in raw:  # the cards before it: f = 1, nothing spills
                        budgets += (before, before, FACTOR_ONE)
                budgets += (rfree, vfree, factor)
            elif budgets is not None:
                budgets += (free, free, FACTOR_ONE)
            compute = c.compute_units - c.used_compute
            slots = c.slots - c.used_slots
            tmem.append(c.memory_mib)
            raw.append(free)
            fcu.append(compute)
            fslots.append(slots)
            busy.append(c.used_slots > 0 or c.used_memory_mib > 0 or c.used_compute > 0)
            excl.append(c.exclusive)
            # Free memory folded with the yes/no gates every slice passes: a card with no
            # free slot, an exclusive tenant, or no compute left (over-committed, or fully
            # booked: not even a 0% slice goes there, HAMi's rule) offers -1 MiB, which no
            # request (>= 0 MiB, >= 0% compute) fits in.
            spent = compute < 0 or (compute == 0 and c.compute_units > 0)
            fmem.append(-1 if (c.exclusive or slots <= 0 or spent) else free)
            used_mem += c.used_memory_mib
        n = len(sched)
        self.cards = tuple(sched)
        # Virtual device memory: per card the resident budget left, the virtual budget left
        # and the factor, and the node's host spill reserve left. `oversub` is True when some
        # card has a factor above 1: only then may an opted-in slice spill here.
        self.spill_free = spill_free
        self.rfree: tuple[int, ...]
        self.vfree: tuple[int, ...]
        self.factors: tuple[int, ...]
        if budgets is None:
            self.oversub = False
            self.rfree = self.vfree = self.factors = ()
        else:
            self.rfree = tuple(budgets[0::3])
            self.vfree = tuple(budgets[1::3])
            self.factors = tuple(budgets[2::3])
            self.oversub = any(f > FACTOR_ONE for f in self.factors)
        # Every card (schedulable or not) by index, with its position among the schedulable
        # ones or -1: what explanations walk.
        self.by_index = tuple(by_index)
        self.n = n
        self.ok = ready and not cordoned and n > 0
        self.tmem = tuple(tmem)
        self.raw_fmem = tuple(raw)
        self.fcu = tuple(fcu)
        self.fslots = tuple(fslots)
        self.busy = tuple(b or e for b, e in zip(busy, excl, strict=True))
        self.excl = tuple(excl)
        self.fmem = tuple(fmem)
        self.max_fmem = max(fmem, default=-1)
        # "Live" cards can take some slice now.
        live = [p for p in range(n) if fmem[p] >= 0]
        self.live_free = sum(fmem[p] for p in live)
        self.live_slots = sum(fslots[p] for p in live)
        self.live_compute = sum(fcu[p] for p in live)
        self.max_fcu = max((fcu[p] for p in live), default=-1)
        self.min_live_slots = min((fslots[p] for p in live), default=0)
        # Live cards by free memory, most first (ties: lower index), for scans that stop at
        # the first card too small.
        desc = sorted(live, key=lambda p: (-fmem[p], p))
        self.d_fmem = tuple(fmem[p] for p in desc)
        self.d_fcu = tuple(fcu[p] for p in desc)
        self.d_fslots = tuple(fslots[p] for p in desc)
        # Live cards packed into single ints, (free << KEY_BITS) | position, which sort like
        # (free, position): the greedy keeps them in a list sorted in C rather than
        # comparing tuples. Spread flips the position so that, scanned from the top, ties
        # still go to the lower index. Nodes with more cards than a key holds take the
        # general path.
        if n <= KEY_SPAN:
            self.keys_binpack: tuple[int, ...] | None = tuple(
                sorted((fmem[p] << KEY_BITS) | p for p in live)
            )
            self.keys_spread: tuple[int, ...] | None = tuple(
                sorted((fmem[p] << KEY_BITS) | (KEY_MASK - p) for p in live)
            )
        else:
            self.keys_binpack = self.keys_spread = None
        self.mem_total = sum(tmem)
        self.mem_used = used_mem
        self.avg_mem = self.mem_total // n if n else 0
        self._text: _Texts | None = None
        self._tcu: tuple[int, ...] | None = None
        self._numa: tuple[int, ...] | None = None
        self.mode = mode
        # The other modes some card of the node is in (empty on an all-shared node: the
        # filter then never looks further).
        self.modes: frozenset[str] = _NO_MODES if modes is None else frozenset(modes)
        self._ready = (ready, cordoned)
        self._lanes: dict[str, NodeView] | None = None
        if mig:
            self.mig_geo: tuple[MigGeometry | None, ...] = tuple(
                geometry_for(c.model) for c in self.cards
            )
            self.mig_used: tuple[int, ...] = tuple(c.mig_used for c in self.cards)

    def lane(self, mode: str) -> NodeView | None:
        """The view of this node's cards in ``mode`` (asked of the node's own view, the shared
        lane; built once), None when no card of the node is in that mode."""
        if mode == self.mode:
            return self
        if mode not in self.modes:
            return None
        lanes = self._lanes
        if lanes is None:
            lanes = self._lanes = {}
        view = lanes.get(mode)
        if view is None:
            ready, cordoned = self._ready
            cards = tuple(c for c, _ in self.by_index)
            view = lanes[mode] = NodeView(ready, cordoned, cards, mode)
        return view

    @property
    def tcu(self) -> tuple[int, ...]:
        """Compute units of the schedulable cards (made on first use, like the texts)."""
        tcu = self._tcu
        if tcu is None:
            tcu = self._tcu = tuple(c.compute_units for c in self.cards)
        return tcu

    @property
    def numa(self) -> tuple[int, ...]:
        """NUMA node of each schedulable card; a card whose node plugin reported none gets
        ``NO_NUMA``: one group of its own, after every known NUMA node."""
        numa = self._numa
        if numa is None:
            numa = self._numa = tuple(
                NO_NUMA if c.numa_node is None else c.numa_node for c in self.cards
            )
        return numa

    def _texts(self) -> _Texts:
        # Strings only explanations and card filters need, made on first use: most nodes of
        # most snapshots never need them.
        text = self._text
        if text is None:
            models = tuple(c.model.lower() for c in self.cards)
            text = (
                models,
                tuple(c.uuid.lower() for c in self.cards),
                tuple(f"card {c.uuid} ({c.model})" for c in self.cards),
                "\n".join(models),
            )
            self._text = text
        return text

    @property
    def models_key(self) -> str:
        """The lower-cased models in one string: a dict key whose hash Python caches."""
        return self._texts()[3]

    @property
    def model_l(self) -> tuple[str, ...]:
        """Lower-cased models of the schedulable cards."""
        return self._texts()[0]

    @property
    def uuid_l(self) -> tuple[str, ...]:
        """Lower-cased uuids of the schedulable cards."""
        return self._texts()[1]

    @property
    def labels(self) -> tuple[str, ...]:
        """ "card GPU-… (model)", the start of every per-card sentence."""
        return self._texts()[2]


@dataclass(frozen=True, slots=True)
class NodeState:
    """One node and its cards."""

    name: str
    ready: bool
    cordoned: bool
    cards: tuple[CardState, ...]
    # Host memory the node sets aside for what opted-in slices spill, and what its slices may
    # spill (sum of memory - resident part); docs/virtual-memory.md.
    spill_reserve_mib: int = 0
    used_spill_mib: int = 0
    view: NodeView = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.cards, tuple):
            object.__setattr__(self, "cards", tuple(self.cards))
        object.__setattr__(
            self,
            "view",
            NodeView(
                self.ready,
                self.cordoned,
                self.cards,
                SHARED,
                self.spill_reserve_mib - self.used_spill_mib,
            ),
        )

    def _with_cards(self, cards: tuple[CardState, ...], spill_delta: int) -> NodeState:
        return NodeState(
            self.name,
            self.ready,
            self.cordoned,
            cards,
            self.spill_reserve_mib,
            self.used_spill_mib + spill_delta,
        )

    def with_claims(self, claims: Mapping[str, CardClaim]) -> NodeState:
        """This node with one more pod's claims (card UUID -> claim) added to its cards: what
        the ledger will say once that pod's reservation is read back (the scheduler's
        "assumed pod"). Claims on cards the node does not have are ignored."""
        cards = tuple(
            card
            if (claim := claims.get(card.uuid)) is None
            else replace(
                card,
                used_memory_mib=card.used_memory_mib + claim.memory_mib,
                used_compute=card.used_compute + claim.cores,
                used_slots=card.used_slots + claim.slots,
                exclusive=card.exclusive or claim.exclusive,
                mig_used=card.mig_used | claim.mig_mask,
                used_resident_mib=_resident_sum(card, claim.resident, claim.memory_mib),
            )
            for card in self.cards
        )
        mine = {c.uuid for c in self.cards}
        spill = sum(c.spill_mib for uuid, c in claims.items() if uuid in mine)
        return self._with_cards(cards, spill)

    def without_claims(
        self, claims: Iterable[Mapping[str, CardClaim]], exclusive_left: frozenset[str]
    ) -> NodeState:
        """This node with pods' claims (each card UUID -> claim) taken off its cards: what it
        would offer once those pods are gone. ``exclusive_left`` names the cards on which a pod
        that stays still holds a 100%-compute slice (a claim cannot say whether it was the only
        one)."""
        gone: dict[str, list[int]] = {}
        for pod in claims:
            for uuid, claim in pod.items():
                total = gone.setdefault(uuid, [0, 0, 0, 0, 0, 0])
                total[0] += claim.memory_mib
                total[1] += claim.cores
                total[2] += claim.slots
                total[3] |= claim.mig_mask  # MIG instances never overlap: their bits go alone
                total[4] += claim.resident
                total[5] += claim.spill_mib
        cards = tuple(
            card
            if (t := gone.get(card.uuid)) is None
            else replace(
                card,
                used_memory_mib=card.used_memory_mib - t[0],
                used_compute=card.used_compute - t[1],
                used_slots=card.used_slots - t[2],
                exclusive=card.uuid in exclusive_left,
                mig_used=card.mig_used & ~t[3],
                used_resident_mib=_resident_sum(card, -t[4], -t[0]),
            )
            for card in self.cards
        )
        mine = {c.uuid for c in self.cards}
        spill = sum(t[5] for uuid, t in gone.items() if uuid in mine)
        return self._with_cards(cards, -spill)


def _resident_sum(card: CardState, resident: int, memory: int) -> int | None:
    """The card's resident sum after adding ``resident`` (of ``memory``); None while it stays
    equal to the memory sum (nothing spills)."""
    if card.used_resident_mib is None and resident == memory:
        return None
    return card.resident_used + resident


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Every node the control plane knows, with a name index built once (O(cards))."""

    nodes: tuple[NodeState, ...]
    by_name: Mapping[str, NodeState] = field(init=False, repr=False, compare=False)
    # per_node's values by key, and ranked's rankings by key; either may be Stale
    _memo: dict[Hashable, PerNode[Any] | Stale[PerNode[Any]]] = field(
        init=False, repr=False, compare=False
    )
    _ranks: dict[Hashable, Ranking | Stale[Ranking]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_memo", {})
        object.__setattr__(self, "_ranks", {})
        if not isinstance(self.nodes, tuple):
            object.__setattr__(self, "nodes", tuple(self.nodes))
        index: dict[str, NodeState] = {}
        for node in self.nodes:
            if node.name in index:
                raise ValueError(f"node {node.name!r} appears twice in the snapshot")
            index[node.name] = node
        # A plain dict (typed read-only): the filter does one lookup per node per cycle.
        object.__setattr__(self, "by_name", index)

    @classmethod
    def build(cls, nodes: Iterable[NodeState]) -> Snapshot:
        """A snapshot of ``nodes`` (any iterable)."""
        return cls(tuple(nodes))

    def replacing(self, changes: Mapping[str, NodeState | None]) -> Snapshot:
        """This snapshot with the named nodes replaced (in place: the order stays), added (at
        the end) or removed (None). The index is copied, not rebuilt: a cache swaps in one
        node after every bind, and re-indexing a thousand nodes each time cost more than the
        bind's own arithmetic.

        Memos and rankings go along as they were, with the names swapped (`Stale`), and are
        brought up to date the first time the new snapshot uses them: between two binds most
        are not used, and copying each of them after every bind cost 2 ms at 5,000 nodes. One
        whose swapped names pile up past a quarter of the nodes is dropped instead."""
        index = dict(self.by_name)
        for name, node in changes.items():
            if node is None:
                index.pop(name, None)
            elif node.name != name:
                raise ValueError(f"node {node.name!r} given as {name!r}")
            else:
                index[name] = node
        snapshot = object.__new__(Snapshot)
        object.__setattr__(snapshot, "nodes", tuple(index.values()))
        object.__setattr__(snapshot, "by_name", index)
        swapped = tuple(changes)
        most = max(STALE_NAMES, len(index) // 4)
        for label in ("_memo", "_ranks"):
            carried: dict[Hashable, Any] = {}
            for key, kept in list(getattr(self, label).items()):  # list(): one step under the GIL
                stale = kept.then(swapped) if isinstance(kept, Stale) else Stale(kept, swapped)
                if len(stale.swapped) <= most:
                    carried[key] = stale
            object.__setattr__(snapshot, label, carried)
        return snapshot

    def per_node(
        self, key: Hashable, function: Callable[[NodeState], V], default: V | None = None
    ) -> PerNode[V]:
        """`function(node)` by node name, worked out the first time a name is asked for
        (`default` for a name the snapshot does not know) and kept for this snapshot and `key`,
        and for the snapshots `replacing` derives, except for the nodes it swaps. Prioritize's
        score and the filter's reasons for one pod shape are the same for every pod of that
        shape until a node changes; kube-scheduler asks about hundreds of nodes per pod, and a
        cache swaps in one node per bind.

        `key` must name everything `function` depends on besides the node. The `MEMO_KEYS`
        keys added last are kept, the oldest dropped first.
        """
        found = self.remembered(key)
        if found is None:
            found = keep(self._memo, key, PerNode(function, self.by_name, default), MEMO_KEYS)
        return found

    def remembered(self, key: Hashable) -> PerNode[Any] | None:
        """`per_node`'s values for ``key`` when some caller asked for them already."""
        found = self._memo.get(key)
        if isinstance(found, Stale):
            found = self._memo[key] = found.current(self.by_name)
        return found

    def ranked(self, key: Hashable, function: Callable[[NodeState], int | None]) -> Ranking:
        """The nodes ordered by `function(node)` (nodes it gives None are left out), built the
        first time `key` is asked for and kept for this snapshot and those `replacing` derives,
        which move only the nodes they swap. A filter that can say "the node fits iff its number
        is at least the pod's" then finds every feasible node with one binary search, instead
        of testing each of thousands of nodes for each new pod shape.

        `key` must name everything `function` depends on besides the node, and `function` must
        give a node the same number every time it is asked. The `RANK_KEYS` keys added last are
        kept, the oldest dropped first.
        """
        ranks = self._ranks
        found = ranks.get(key)
        if isinstance(found, Stale):
            found = ranks[key] = found.current(self.by_name)
        elif found is None:
            found = keep(ranks, key, Ranking.build(function, self.by_name), RANK_KEYS)
        return found
