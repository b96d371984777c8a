"""A snapshot's memos: values worked out per node for one key, and nodes ranked by a number.

:class:`~controlplane.scheduling.state.Snapshot` keeps them (``per_node``, ``ranked``) for
itself and for the snapshots ``replacing`` derives, which hand them on as :class:`Stale`
(the memo and the names swapped since) and bring them up to date on first use. Each one is
paid for by a figure of bench/bench_core.py (docs/scheduling.md, section 9).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    from controlplane.scheduling.state import NodeState

V = TypeVar("V")

MEMO_KEYS = 8  # Snapshot.per_node: pod shapes remembered per snapshot
RANK_KEYS = 24  # Snapshot.ranked: rankings kept per snapshot
STALE_NAMES = 64  # Snapshot.replacing: swapped names a memo may fall behind by, at least


K = TypeVar("K", bound="PerNode[Any] | Ranking")
T = TypeVar("T")


def keep(kept: dict[Hashable, Any], key: Hashable, value: T, most: int) -> T:
    """Add ``value`` under ``key``, dropping the oldest keys so that ``most`` remain."""
    for oldest in list(kept)[: max(0, len(kept) - most + 1)]:
        kept.pop(oldest, None)
    kept[key] = value
    return value


@dataclass(frozen=True, slots=True)
class Stale(Generic[K]):
    """A memo or ranking as an earlier snapshot kept it, and the names swapped since (in
    order, maybe repeated): what `Snapshot.replacing` hands on instead of a copy."""

    kept: K
    swapped: tuple[str, ...]

    def then(self, swapped: tuple[str, ...]) -> Stale[K]:
        """The same, with more names swapped."""
        return Stale(self.kept, self.swapped + swapped)

    def current(self, nodes: Mapping[str, NodeState]) -> K:
        """A copy brought up to date for ``nodes`` (a newer snapshot's nodes by name)."""
        return self.kept.updated(nodes, self.swapped)  # type: ignore[return-value]


class Ranking:
    """`Snapshot.ranked`'s nodes: ``(number, name)`` pairs in ascending order, for ``nodes``
    (a snapshot's nodes by name)."""

    __slots__ = ("function", "nodes", "pairs")

    def __init__(
        self,
        function: Callable[[NodeState], int | None],
        nodes: Mapping[str, NodeState],
        pairs: list[tuple[int, str]],
    ) -> None:
        self.function, self.nodes, self.pairs = function, nodes, pairs

    @classmethod
    def build(
        cls, function: Callable[[NodeState], int | None], nodes: Mapping[str, NodeState]
    ) -> Ranking:
        pairs = []
        for node in nodes.values():
            value = function(node)
            if value is not None:
                pairs.append((value, node.name))
        pairs.sort()
        return cls(function, nodes, pairs)

    def at_least(self, value: int) -> set[str]:
        """The names of the nodes whose number is ``value`` or more."""
        pairs = self.pairs
        # (value,) sorts before every (value, name): the first pair at value or above.
        return {name for _, name in pairs[bisect_left(pairs, (value,)) :]}

    def updated(self, nodes: Mapping[str, NodeState], swapped: Iterable[str]) -> Ranking:
        """A copy for ``nodes``, which differ from this ranking's in the ``swapped`` names
        only (a node replaced, added or gone)."""
        pairs = self.pairs.copy()
        function, old = self.function, self.nodes
        for name in dict.fromkeys(swapped):
            before = old.get(name)
            if before is not None and (value := function(before)) is not None:
                at = bisect_left(pairs, (value, name))
                if at < len(pairs) and pairs[at] == (value, name):
                    del pairs[at]
            node = nodes.get(name)
            if node is not None and (value := function(node)) is not None:
                insort(pairs, (value, name))
        return Ranking(function, nodes, pairs)


class PerNode(dict[str, V]):
    """`Snapshot.per_node`'s values: a dict that works out a missing node's value on lookup."""

    __slots__ = ("default", "function", "nodes")

    def __init__(
        self, function: Callable[[NodeState], V], nodes: Mapping[str, NodeState], default: Any
    ) -> None:
        super().__init__()
        self.function, self.nodes, self.default = function, nodes, default

    def __missing__(self, name: str) -> V:
        node = self.nodes.get(name)
        if node is None:
            return self.default  # type: ignore[no-any-return]
        value = self[name] = self.function(node)
        return value

    def updated(self, nodes: Mapping[str, NodeState], swapped: Iterable[str]) -> PerNode[V]:
        """A copy for a derived snapshot's nodes, less the ``swapped`` names (worked out again
        when next asked)."""
        copy = PerNode(self.function, nodes, self.default)
        copy.update(self)
        for name in swapped:
            copy.pop(name, None)
        return copy
