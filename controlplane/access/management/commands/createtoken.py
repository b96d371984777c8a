"""`manage.py createtoken <username> --role {viewer,operator,admin,node}`: print a new API token."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.access.roles import Role
from controlplane.access.services import check_username, create_token
from controlplane.ledger.errors import ServiceError


class Command(BaseCommand):
    help = (
        "Create (or reuse) the identity USERNAME with the given role and print a new API token "
        "for it. For --role node, USERNAME must be the Kubernetes node name the plugin reports."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username")
        parser.add_argument("--role", required=True, choices=[r.value for r in Role])
        parser.add_argument("--label", default="", help="A note to recognise the token by.")

    def handle(self, *args: Any, **options: Any) -> None:
        username: str = options["username"]
        role = Role(options["role"])
        try:
            check_username(username, role)
        except ServiceError as exc:
            raise CommandError(exc.message) from None
        self.stdout.write(create_token(username, role, options["label"]))
