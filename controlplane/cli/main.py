"""`kubectl tessera COMMAND`: the commands, their arguments, and what each prints.

Each command reads or writes through the REST API (docs/dashboard.md, docs/kubectl-plugin.md)
and prints a table, or with `-o json|yaml` the data it read. Errors are one line on stderr and
a non-zero exit status: 1 for a refusal or a failure, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import quote

from controlplane.cli import render
from controlplane.cli.client import (
    DEFAULT_NAMESPACE,
    DEFAULT_PORT,
    DEFAULT_SERVICE,
    SERVER_ENV,
    TOKEN_ENV,
    ApiError,
    Client,
    CliError,
    Settings,
    connect,
)

PROG = "kubectl tessera"
MODES = ("shared", "mig", "mps", "exclusive")
DEBUG_ENV = "TESSERA_DEBUG"

Command = Callable[[Client, argparse.Namespace], Any]


# --- reading ----------------------------------------------------------------------------------


def _card_state(card: dict[str, Any]) -> str:
    states = []
    factor = card.get("memory_oversubscription")
    if factor not in (None, "1"):
        # virtual device memory: its slices may add up to factor x the card (docs/virtual-memory.md)
        virtual = render.used_of(card.get("memory_allocated_mib"), card.get("memory_virtual_mib"))
        states.append(f"oversubscribed x{factor} ({virtual} MiB virtual)")
    if card.get("pending_mode"):
        states.append(f"draining->{card['pending_mode']}")
    if card.get("cordoned"):
        states.append("cordoned")
    if not card.get("healthy", True):
        reason = card.get("health_reason") or ""
        states.append(f"unhealthy({reason})" if reason else "unhealthy")
    if not card.get("present", True):
        states.append("absent")
    return ",".join(states) or "ok"


def _node_state(node: dict[str, Any]) -> str:
    states = ["ready" if node.get("ready") else "not-ready"]
    if node.get("cordoned"):
        states.append("cordoned")
    return ",".join(states)


def inspect_data(client: Client, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The nodes (one, or all) with each card's active slices under `slices`."""
    if args.node:
        nodes = [client.get(f"nodes/{_segment(args.node, 'node')}/")]
        slices = list(client.pages("slices/", node=args.node))
    else:
        nodes = list(client.pages("nodes/"))
        slices = list(client.pages("slices/"))
    by_card: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in slices:
        by_card[row["card"]].append(row)
    for node in nodes:
        for card in node.get("cards", []):
            card["slices"] = by_card.get(card["uuid"], [])
    return nodes


def holder(piece: dict[str, Any]) -> str:
    """Who holds a slice: `namespace/pod`, or `claim namespace/name` for a ResourceClaim's
    (DRA mode: kube-scheduler allocated it; its container is the claim's request)."""
    name = f"{piece['namespace']}/{piece['pod']}"
    return f"claim {name}" if piece.get("source") == "claim" else name


def inspect_table(nodes: list[dict[str, Any]]) -> str:
    headers = ["NODE", "CARD", "MODEL", "MODE", "MEMORY(MiB)", "COMPUTE(%)", "SLOTS", "STATE"]
    rows: list[list[Any]] = []
    memory = allocated = 0
    for node in nodes:
        cards = node.get("cards", [])
        rows.append(
            [
                node["name"],
                f"{len(cards)} card{'s' if len(cards) != 1 else ''}",
                "",
                "",
                render.used_of(node.get("memory_allocated_mib"), node.get("memory_mib")),
                "",
                "",
                _node_state(node),
            ]
        )
        for card in cards:
            memory += card.get("memory_mib") or 0
            allocated += card.get("memory_allocated_mib") or 0
            rows.append(
                [
                    "",
                    card["uuid"],
                    card.get("model", ""),
                    card.get("mode"),  # None until the API gives a mode: printed as "-"
                    render.used_of(card.get("memory_allocated_mib"), card.get("memory_mib")),
                    render.used_of(card.get("compute_allocated"), card.get("compute_units")),
                    render.used_of(card.get("slots_allocated"), card.get("slots")),
                    _card_state(card),
                ]
            )
            for piece in card.get("slices", []):
                init = " (init)" if piece.get("init") else ""
                rows.append(
                    [
                        "",
                        f"  {holder(piece)}/{piece['container']}{init}",
                        "",
                        "",
                        piece.get("memory_mib"),
                        piece.get("compute_percent"),
                        "",
                        piece.get("phase", ""),
                    ]
                )
    if not nodes:
        return "No GPU nodes are registered with Tessera."
    footer = (
        f"\nAllocated/total GPU memory: {allocated}/{memory} MiB "
        f"({render.percent(allocated, memory)})"
    )
    return render.table(headers, rows) + footer


def cmd_inspect(client: Client, args: argparse.Namespace) -> Any:
    nodes = inspect_data(client, args)
    return nodes, inspect_table(nodes)


def why_table(answer: dict[str, Any]) -> str:
    lines = [
        f"Pod:      {answer.get('namespace')}/{answer.get('name')}",
        f"Outcome:  {answer.get('outcome')}",
        f"Summary:  {answer.get('summary')}",
    ]
    if answer.get("decided_at"):
        lines.append(f"Decided:  {answer['decided_at']}")
    binding = answer.get("binding")
    if binding:
        lines.append(f"Binding:  {binding.get('phase')} on {binding.get('node') or '-'}")
    considered = answer.get("nodes_considered")
    if considered is not None:
        feasible = answer.get("feasible_nodes") or []
        lines.append(
            f"Nodes:    {considered} considered, {len(feasible)} feasible"
            + (f" ({', '.join(feasible)})" if feasible else "")
        )
    counts = answer.get("reason_counts") or {}
    if counts:
        ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        lines += ["", render.table(["REASON", "NODES"], ordered)]
    reasons = answer.get("node_reasons") or {}
    if reasons:
        lines += ["", render.table(["NODE", "WHY NOT"], sorted(reasons.items()))]
    lines += _claims_lines(answer)
    return "\n".join(lines)


def _claims_lines(answer: dict[str, Any]) -> list[str]:
    """DRA mode: the scheduler's reason, then per waiting claim's request the closest cards."""
    lines = []
    if answer.get("scheduler_reason"):
        lines += ["", f"Scheduler: {answer['scheduler_reason']}"]
    for claim in answer.get("claims") or []:
        state = "allocated" if claim.get("allocated") else "not allocated"
        lines += ["", f"Claim {claim.get('name')}: {claim.get('error') or state}"]
        if claim.get("quota"):
            lines.append(f"  Quota: {claim['quota']}")
        for request in claim.get("requests") or []:
            memory = request.get("memory_mib")
            lines.append(
                f"  Request {request.get('request')}: {request.get('count')} x "
                f"{'whole card' if memory is None else f'{memory} MiB'}, "
                f"{request.get('compute')}% compute; {request.get('fitting')} of "
                f"{request.get('candidates')} card(s) fit"
            )
            rows = [
                (c.get("node"), c.get("device"), f"{c.get('free_memory_mib')}/{c['memory_mib']}",
                 f"{c.get('free_compute')}%", f"{c.get('free_slots')}/{c.get('slots')}")
                for c in request.get("closest") or []
            ]  # fmt: skip
            if rows:
                lines.append(
                    render.table(["NODE", "CARD", "FREE MIB", "FREE COMPUTE", "FREE SLOTS"], rows)
                )
            lines.append(f"  To fit: {request.get('to_fit')}")
    return lines


def cmd_why(client: Client, args: argparse.Namespace) -> Any:
    namespace = _segment(args.namespace, "namespace")
    answer = client.get(f"pods/{namespace}/{_segment(args.pod, 'pod')}/why")
    return answer, why_table(answer)


def top_table(slices: list[dict[str, Any]]) -> str:
    if not slices:
        return "No pods hold a GPU slice."
    headers = ["NAMESPACE", "POD", "CONTAINER", "NODE", "CARD", "MEMORY(MiB)", "COMPUTE(%)"]
    # Virtual device memory (docs/virtual-memory.md): where some slice may spill or some
    # container reports a spill, two more columns, next to the slice: resident/resident part
    # and spilled. A cluster that does not use it reads as before.
    spilling = any(s.get("resident_mib") is not None or s.get("memory_spilled_mib") for s in slices)
    if spilling:
        headers += ["RESIDENT(MiB)", "SPILLED(MiB)"]
    rows = []
    for s in slices:
        row = [
            s["namespace"],
            s["pod"] + (" (claim)" if s.get("source") == "claim" else ""),
            s["container"] + (" (init)" if s.get("init") else ""),
            s["node"],
            s["card"],
            # used/slice: what the container uses, as its node plugin last reported it ("-"
            # while no fresh report names it), against what its slice was given.
            render.used_of(s.get("memory_used_mib"), s.get("memory_mib")),
            render.used_of(s.get("compute_used_percent"), s.get("compute_percent")),
        ]
        if spilling:
            part = s.get("resident_mib")
            row += [
                render.used_of(
                    s.get("memory_resident_mib"), s["memory_mib"] if part is None else part
                ),
                "-" if s.get("memory_spilled_mib") is None else str(s["memory_spilled_mib"]),
            ]
        rows.append(row)
    return render.table(headers, rows)


def cmd_top(client: Client, args: argparse.Namespace) -> Any:
    namespace = None if args.all_namespaces else args.namespace
    slices = list(client.pages("slices/", namespace=namespace, pod=args.pod))
    return slices, top_table(slices)


def quota_table(quotas: list[dict[str, Any]]) -> str:
    if not quotas:
        return "No namespace has a Tessera quota."
    headers = ["NAMESPACE", "GPUMEM(MiB)", "GPUCORES(%)", "GPUS", "UPDATED-BY", "UPDATED"]
    rows = []
    for q in quotas:
        usage = q.get("usage") or {}
        rows.append(
            [
                q["namespace"],
                f"{usage.get('gpumem_mib', '-')}/{render.limit(q.get('gpumem_mib'))}",
                f"{usage.get('gpucores', '-')}/{render.limit(q.get('gpucores'))}",
                f"{usage.get('gpus', '-')}/{render.limit(q.get('gpus'))}",
                q.get("updated_by") or "",
                q.get("updated_at") or "",
            ]
        )
    return render.table(headers, rows)


def cmd_quota_get(client: Client, args: argparse.Namespace) -> Any:
    if args.namespace_arg:
        quotas = [client.get(f"quotas/{_segment(args.namespace_arg, 'namespace')}/")]
    else:
        quotas = list(client.pages("quotas/"))
    return quotas, quota_table(quotas)


# --- writing ----------------------------------------------------------------------------------


def cmd_quota_set(client: Client, args: argparse.Namespace) -> Any:
    body = {
        name: getattr(args, name)
        for name in ("gpumem_mib", "gpucores", "gpus")
        if getattr(args, name) is not _NOT_GIVEN
    }
    path = f"quotas/{_segment(args.namespace_arg, 'namespace')}/"
    try:
        # Only the limits given change; the others keep their values.
        quota = client.call("PATCH", path, body)
    except ApiError as exc:
        if exc.status != 404:
            raise
        # No quota yet: a new one, the limits not given unlimited.
        quota = client.call("PUT", path, body)
    return quota, quota_table([quota])


def _target(raw: str) -> tuple[str, str]:
    """`node/NAME`, `card/UUID`, or a bare card UUID."""
    kind, sep, name = raw.partition("/")
    if not sep:
        return "card", raw
    if kind in ("node", "nodes") and name:
        return "node", name
    if kind in ("card", "cards") and name:
        return "card", name
    raise CliError(f"{raw!r}: give a card UUID, card/UUID or node/NAME", code=2)


def _cordon(client: Client, args: argparse.Namespace, cordon: bool) -> Any:
    kind, name = _target(args.target)
    body = {"reason": args.reason} if args.reason else {}
    verb = "cordon" if cordon else "uncordon"
    collection = "nodes" if kind == "node" else "cards"
    answer = client.call("POST", f"{collection}/{_segment(name, kind)}/{verb}", body)
    return answer, f"{kind}/{name} {verb}ed"


def cmd_cordon(client: Client, args: argparse.Namespace) -> Any:
    return _cordon(client, args, cordon=True)


def cmd_uncordon(client: Client, args: argparse.Namespace) -> Any:
    return _cordon(client, args, cordon=False)


def cmd_mode(client: Client, args: argparse.Namespace) -> Any:
    body = {"mode": args.mode, "reason": args.reason or ""}
    card = client.call("POST", f"cards/{_segment(args.card, 'card')}/mode", body)
    card = card or {}
    if card.get("pending_mode"):
        # The server's own words for a drain ("draining: becomes MIG when its 2 slices end").
        status = card.get("mode_status") or f"draining: becomes {card['pending_mode']}"
        return card, f"card/{args.card} {status}"
    return card, f"card/{args.card} mode {card.get('mode', args.mode)}"


def cmd_oversubscribe(client: Client, args: argparse.Namespace) -> Any:
    factor = None if args.factor == "default" else args.factor
    body = {"factor": factor, "reason": args.reason or ""}
    card = client.call("POST", f"cards/{_segment(args.card, 'card')}/memory-oversubscription", body)
    card = card or {}
    applied = card.get("memory_oversubscription", factor or "the node's")
    own = "" if card.get("memory_oversubscription_own") else " (the node's default)"
    return card, f"card/{args.card} memory oversubscription x{applied}{own}"


# --- arguments --------------------------------------------------------------------------------


class _NotGiven:
    def __repr__(self) -> str:
        return "not given"


_NOT_GIVEN = _NotGiven()


def _limit(raw: str) -> int | None:
    """A quota limit: a whole number from 0, or `unlimited`."""
    if raw.lower() in ("unlimited", "none"):
        return None
    if not raw.isascii() or not raw.isdigit():
        raise argparse.ArgumentTypeError(f"{raw!r}: give a whole number from 0, or 'unlimited'")
    return int(raw)


def _segment(value: str, what: str) -> str:
    """A name that goes into a URL path as one segment: no '/' to reach another route."""
    if not value or "/" in value or value in (".", ".."):
        raise CliError(f"{what} {value!r}: not a valid name", code=2)
    return quote(value, safe="")


def _common(suppress: bool) -> argparse.ArgumentParser:
    """The connection and output options, accepted before or after the command."""
    parser = argparse.ArgumentParser(add_help=False)

    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    group = parser.add_argument_group("finding Tessera")
    group.add_argument(
        "--server",
        default=default(None),
        help=f"the control plane's URL (else ${SERVER_ENV}, else the kubeconfig's cluster "
        "through the API server's service proxy)",
    )
    group.add_argument("--token", default=default(None), help=f"an API token (else ${TOKEN_ENV})")
    group.add_argument(
        "--token-secret",
        default=default(None),
        metavar="NS/NAME",
        help="read the token from this Secret's key 'token' with the kubeconfig's credentials",
    )
    group.add_argument("--kubeconfig", default=default(None), help="kubeconfig file")
    group.add_argument("--context", default=default(None), help="kubeconfig context")
    group.add_argument(
        "--tessera-namespace",
        default=default(DEFAULT_NAMESPACE),
        help=f"namespace of Tessera's Service (default {DEFAULT_NAMESPACE})",
    )
    group.add_argument(
        "--tessera-service",
        default=default(DEFAULT_SERVICE),
        help=f"Tessera's Service (default {DEFAULT_SERVICE}, the Helm release's name)",
    )
    group.add_argument(
        "--tessera-port",
        default=default(DEFAULT_PORT),
        help=f"the Service's HTTP port, name or number (default {DEFAULT_PORT})",
    )
    group.add_argument(
        "--insecure-skip-tls-verify",
        action="store_true",
        default=default(False),
        help="with --server https://...: do not check the server's certificate",
    )
    parser.add_argument(
        "-o",
        "--output",
        choices=("table", "json", "yaml"),
        default=default("table"),
        help="output format (default table)",
    )
    return parser


def build_parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog=PROG,
        description="Tessera's GPU slices, quotas and cordons from kubectl.",
        parents=[_common(suppress=False)],
    )
    sub = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    common = [_common(suppress=True)]

    def add(name: str, func: Command, role: str, help_text: str) -> argparse.ArgumentParser:
        parser = sub.add_parser(name, parents=common, help=help_text, description=help_text)
        parser.set_defaults(func=func, role=role)
        return parser

    p = add("inspect", cmd_inspect, "viewer", "nodes and cards: allocation and the pods on them")
    p.add_argument("node", nargs="?", metavar="NODE", help="only this node")

    p = add("why", cmd_why, "viewer", "why a pod is pending, or where it is bound")
    p.add_argument("pod", metavar="POD")
    p.add_argument("-n", "--namespace", default="default", help="the pod's namespace")

    p = add("top", cmd_top, "viewer", "per container: memory and compute, used against its slice")
    p.add_argument("pod", nargs="?", metavar="POD", help="only this pod")
    p.add_argument("-n", "--namespace", default="default", help="namespace (default default)")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="every namespace")

    for verb, func, what in (
        ("cordon", cmd_cordon, "place no new slices on"),
        ("uncordon", cmd_uncordon, "place slices again on"),
    ):
        p = add(verb, func, "operator", f"{what} a card or a node")
        p.add_argument("target", metavar="CARD-UUID|card/UUID|node/NAME")
        p.add_argument("--reason", default="", help="for the audit log")

    p = add("quota", cmd_quota_get, "viewer", "namespace quotas")
    quota = p.add_subparsers(dest="quota_command", metavar="get|set", required=True)
    q = quota.add_parser("get", parents=common, help="a namespace's quota, or every quota")
    q.set_defaults(func=cmd_quota_get, role="viewer")
    q.add_argument("namespace_arg", nargs="?", metavar="NAMESPACE")
    q = quota.add_parser(
        "set",
        parents=common,
        help="set some limits of a namespace's quota (a number, or 'unlimited')",
    )
    q.set_defaults(func=cmd_quota_set, role="operator")
    q.add_argument("namespace_arg", metavar="NAMESPACE")
    q.add_argument("--gpumem", dest="gpumem_mib", type=_limit, default=_NOT_GIVEN, metavar="MiB")
    q.add_argument("--gpucores", type=_limit, default=_NOT_GIVEN, metavar="N", help="percent")
    q.add_argument("--gpus", type=_limit, default=_NOT_GIVEN, metavar="N", help="slices")

    p = add("mode", cmd_mode, "operator", "change a card's mode (drains first if it holds slices)")
    p.add_argument("card", metavar="CARD-UUID")
    p.add_argument("mode", choices=MODES)
    p.add_argument("--reason", default="", help="for the audit log")

    p = add(
        "oversubscribe",
        cmd_oversubscribe,
        "operator",
        "set a card's memory oversubscription factor (1 to 16; 'default': its node's)",
    )
    p.add_argument("card", metavar="CARD-UUID")
    p.add_argument("factor", metavar="FACTOR", help='e.g. 1.5; "1" turns it off')
    p.add_argument("--reason", default="", help="for the audit log")
    return top


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings(
        server=args.server,
        token=args.token,
        token_secret=args.token_secret,
        kubeconfig=args.kubeconfig,
        context=args.context,
        namespace=args.tessera_namespace,
        service=args.tessera_service,
        port=args.tessera_port,
        insecure=args.insecure_skip_tls_verify,
    )


def run(argv: Sequence[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.func is cmd_quota_set and all(
        getattr(args, n) is _NOT_GIVEN for n in ("gpumem_mib", "gpucores", "gpus")
    ):
        parser.error("quota set: give at least one of --gpumem, --gpucores, --gpus")
    client = connect(settings_of(args))
    client.role = args.role
    data, text = args.func(client, args)
    print(text if args.output == "table" else render.dump(data, args.output))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else argv)
    except CliError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0  # `| head`: the reader has all it wanted
    except Exception as exc:
        # Never a traceback to an operator; the debug switch shows one to whoever fixes it.
        if os.environ.get(DEBUG_ENV):
            raise
        print(f"error: unexpected {type(exc).__name__}: {exc} (set {DEBUG_ENV}=1 for details)",
              file=sys.stderr)  # fmt: skip
        return 1


if __name__ == "__main__":
    sys.exit(main())
