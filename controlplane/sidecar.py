"""`python -m controlplane.sidecar`: the scheduler extender's sidecar, granian started through its
public server class (`granian.Granian`).

It takes granian's own option names, for the options the manifests and the e2e harness give the
sidecar (deploy/scheduler/deployment.yaml, the chart's scheduler template), so the same command
line also runs under the `granian` command (`e2e/cluster.py` does so for a checkout without this
module); any other option is refused. Every setting it does not take keeps granian's default,
which is also its command line's.

Why not the `granian` command: its command line caps `--http1-header-read-timeout` at 60,000 ms,
and granian closes a keep-alive connection that has been idle for that long, while
kube-scheduler's extender client keeps idle connections for 90 s (Go's
`http.DefaultTransport.IdleConnTimeout`, which `k8s.io/apimachinery/pkg/util/net.
SetTransportDefaults` applies to the extender's transport). A filter the scheduler sends on a
connection at the moment the sidecar closes it fails, and a POST is never retried by Go's client:
the pod's scheduling cycle fails. The server class takes any timeout (`HTTP1Settings`);
docs/extender.md, "Idle connections".
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from granian import Granian, __version__
from granian.constants import HTTPModes, Interfaces
from granian.http import HTTP1Settings


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m controlplane.sidecar",
        description="The scheduler extender's sidecar: granian, with granian's option names.",
    )
    p.add_argument("app", help="the WSGI application, module:attribute")
    p.add_argument("--interface", choices=[i.value for i in Interfaces], default="rsgi")
    p.add_argument("--http", choices=[m.value for m in HTTPModes], default="auto")
    p.add_argument("--ws", "--no-ws", dest="websockets", action=_Toggle, default=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=positive, default=8000)
    p.add_argument("--workers", type=positive, default=1)
    p.add_argument("--blocking-threads", type=positive, default=None)
    p.add_argument("--blocking-threads-idle-timeout", type=positive, default=30)
    p.add_argument("--workers-kill-timeout", type=positive, default=None)
    p.add_argument(
        "--http1-header-read-timeout",
        type=positive,
        default=HTTP1Settings.header_read_timeout,
        help="ms a keep-alive connection may stay idle (no upper bound, unlike granian's CLI)",
    )
    p.add_argument(
        "--access-log", "--no-access-log", dest="access_log", action=_Toggle, default=False
    )
    p.add_argument("--version", action="version", version=f"granian {__version__}")
    return p


class _Toggle(argparse.Action):
    """`--name` / `--no-name`, as granian's click flags."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: str | None = None) -> None:
        setattr(namespace, self.dest, not (option or "").startswith("--no-"))


def server(argv: Sequence[str] | None = None) -> Granian:
    """The sidecar's granian server for this command line, not started."""
    args = parser().parse_args(argv)
    return Granian(
        args.app,
        address=args.host,
        port=args.port,
        interface=Interfaces(args.interface),
        http=HTTPModes(args.http),
        websockets=args.websockets,
        workers=args.workers,
        blocking_threads=args.blocking_threads,
        blocking_threads_idle_timeout=args.blocking_threads_idle_timeout,
        workers_kill_timeout=args.workers_kill_timeout,
        http1_settings=HTTP1Settings(header_read_timeout=args.http1_header_read_timeout),
        log_access=args.access_log,
    )


def main(argv: Sequence[str] | None = None) -> None:
    server(argv).serve()


if __name__ == "__main__":
    main()
