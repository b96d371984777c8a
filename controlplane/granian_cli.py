"""`python -m controlplane.granian_cli`: granian's own command line, for the extender sidecar.

The same options, defaults and environment variables as the `granian` command, with one
difference: `--http1-header-read-timeout` takes values above granian's ceiling of 60,000 ms.

Why: granian closes a keep-alive connection that has been idle for the header-read timeout (30 s
by default, at most 60 s on its command line), while kube-scheduler's extender client keeps idle
connections for 90 s (Go's `http.DefaultTransport.IdleConnTimeout`, which
`k8s.io/apimachinery/pkg/util/net.SetTransportDefaults` applies to the extender's transport). A
filter the scheduler sends on a connection at the moment the sidecar closes it fails, and a
POST is never retried by Go's client: the pod's scheduling cycle fails. The sidecar has to keep
idle connections longer than the client does; granian's server does so when asked (the limit is
its command line's, not its HTTP layer's), so this module lifts the limit and nothing else.
docs/extender.md, "Idle connections".
"""

from __future__ import annotations

import copy

import click
from granian.cli import cli

OPTION = "http1_header_read_timeout"


def command() -> click.Command:
    """A copy of granian's click command, its header-read timeout without an upper bound."""
    for i, param in enumerate(cli.params):
        if param.name == OPTION:
            lifted = copy.copy(param)
            lifted.type = click.IntRange(1)
            ours = copy.copy(cli)
            ours.params = [*cli.params[:i], lifted, *cli.params[i + 1 :]]
            return ours
    raise SystemExit(
        f"granian {_version()} has no --http1-header-read-timeout option: the extender sidecar "
        "needs it to keep idle connections longer than kube-scheduler (docs/extender.md)"
    )


def _version() -> str:
    from importlib.metadata import version

    return version("granian")


def main() -> None:
    command()(auto_envvar_prefix="GRANIAN")


if __name__ == "__main__":
    main()
