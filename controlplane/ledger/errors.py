"""The refusals the ledger's services raise: each carries a message a caller can act on."""

from __future__ import annotations

from collections.abc import Sequence

from controlplane.scheduling import Refusal


class ServiceError(Exception):
    """A refusal a caller can act on. `field` names the input at fault, when there is one."""

    status = 400

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field


class NotFound(ServiceError):
    status = 404


class Conflict(ServiceError):
    status = 409


class AlreadyPlaced(Conflict):
    """The pod already holds an active binding on another node."""


class AllocationRefused(Conflict):
    """The room is gone (or never was): carries the core's refusals."""

    def __init__(self, message: str, refusals: Sequence[Refusal]) -> None:
        super().__init__(message)
        self.refusals = tuple(refusals)
