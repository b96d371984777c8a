"""`manage.py createtoken <username> --role {viewer,operator,admin,node}`: print a new API token."""

from __future__ import annotations

from typing import Any

from django.contrib.auth.validators import UnicodeUsernameValidator
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser

from controlplane.access.roles import Role
from controlplane.access.services import create_token
from controlplane.ledger.validation import NODE_NAME_HELP, is_node_name


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
            UnicodeUsernameValidator()(username)
        except ValidationError:
            raise CommandError(
                f"username {username!r}: use at most 150 letters, digits and @.+-_"
            ) from None
        if len(username) > 150:
            raise CommandError(f"username {username!r}: at most 150 characters")
        if role is Role.NODE and not is_node_name(username):
            raise CommandError(f"username {username!r} for --role node: {NODE_NAME_HELP}")
        self.stdout.write(create_token(username, role, options["label"]))
