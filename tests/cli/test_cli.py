"""`kubectl tessera` without a cluster: tables, arguments, finding the server, error lines.

The HTTP answers come from a small stdlib server on loopback that answers what the control plane
answers (docs/dashboard.md); tests/e2e/test_kubectl_plugin.py runs the real thing through kubectl.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from controlplane.cli import client as cli_client
from controlplane.cli import render
from controlplane.cli.main import build_parser, inspect_table, main, quota_table, top_table
from tests.nodeplugin.harness.jsonhttp import JsonHandler

TOKEN = "tsr_good"
CARD = {
    "uuid": "GPU-n1-0",
    "node": "n1",
    "index": 0,
    "model": "NVIDIA A100-SXM4-80GB",
    "memory_mib": 81920,
    "compute_units": 100,
    "slots": 10,
    "healthy": True,
    "health_reason": "",
    "cordoned": False,
    "present": True,
    "memory_allocated_mib": 10000,
    "compute_allocated": 30,
    "slots_allocated": 1,
    "exclusive": False,
}
SLICE = {
    "namespace": "team-a",
    "pod": "trainer",
    "pod_uid": "u1",
    "phase": "bound",
    "container": "app",
    "container_index": 0,
    "init": False,
    "node": "n1",
    "card": "GPU-n1-0",
    "memory_mib": 10000,
    "compute_percent": 30,
    "active": True,
}
NODE = {
    "name": "n1",
    "ready": True,
    "cordoned": False,
    "last_heartbeat": None,
    "plugin_version": "1",
    "memory_mib": 81920,
    "memory_allocated_mib": 10000,
    "cards": [CARD],
}


def _page(rows: list[Any]) -> dict[str, Any]:
    return {"count": len(rows), "next": None, "previous": None, "results": rows}


class FakeTessera(JsonHandler):
    """What the control plane answers to the requests these tests make."""

    protocol_version = "HTTP/1.0"  # a connection per request: the CLI opens one per call
    seen: list[tuple[str, str, dict[str, str], Any]] = []

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self.seen.append((method, self.path, dict(self.headers), body))
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self.send_json(401, {"error": "Invalid, revoked or expired token."})
        path = self.path.split("?")[0]
        if method == "GET" and path == "/api/v1/nodes/":
            return self.send_json(200, _page([NODE]))
        if method == "GET" and path == "/api/v1/slices/":
            return self.send_json(200, _page([SLICE]))
        if path == "/api/v1/pods/team-a/ghost/why":
            return self.send_json(404, {"error": "Tessera has no scheduling decision for pod."})
        if method == "PATCH" and path == "/api/v1/quotas/team-b/":
            return self.send_json(403, {"error": "Reading needs the viewer role; changing needs "
                                                "the operator role."})  # fmt: skip
        if method == "PATCH" and path == "/api/v1/quotas/team-a/":
            return self.send_json(404, {"error": "namespace team-a has no quota; PUT creates one."})
        if method == "PUT" and path == "/api/v1/quotas/team-a/":
            quota = {"namespace": "team-a", "gpumem_mib": None, "gpucores": None, "gpus": None}
            quota.update(body)
            quota["usage"] = {"gpumem_mib": 0, "gpucores": 0, "gpus": 0}
            return self.send_json(201, quota)
        return self.send_json(404, {"error": f"Not found: no API route for {path}."})

    def do_GET(self) -> None:
        self._handle("GET")

    def do_PATCH(self) -> None:
        self._handle("PATCH")

    def do_PUT(self) -> None:
        self._handle("PUT")

    def do_POST(self) -> None:
        self._handle("POST")


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    for name in (cli_client.SERVER_ENV, cli_client.TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeTessera)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    FakeTessera.seen = []
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# --- tables -----------------------------------------------------------------------------------


def test_a_table_aligns_its_columns_and_prints_unknown_figures_as_a_dash() -> None:
    text = render.table(["A", "LONGER"], [["x", None], ["wider-cell", 7]])
    lines = text.splitlines()
    assert lines == ["A           LONGER", "x           -", "wider-cell  7"]
    assert render.used_of(None, 100) == "-/100"
    assert render.limit(None) == "unlimited" and render.limit(0) == "0"


def test_inspect_puts_each_pod_under_its_card_with_its_slice() -> None:
    node = json.loads(json.dumps(NODE))
    node["cards"][0]["slices"] = [SLICE]
    lines = inspect_table([node]).splitlines()
    header, node_row, card_row, pod_row = lines[:4]
    assert header.split() == [
        "NODE", "CARD", "MODEL", "MODE", "MEMORY(MiB)", "COMPUTE(%)", "SLOTS", "STATE"
    ]  # fmt: skip
    assert node_row.split() == ["n1", "1", "card", "10000/81920", "ready"]
    # No mode in the answer: a dash, not a guess.
    assert card_row.split()[:3] == ["GPU-n1-0", "NVIDIA", "A100-SXM4-80GB"]
    assert card_row.split()[3:] == ["-", "10000/81920", "30/100", "1/10", "ok"]
    assert pod_row.split() == ["team-a/trainer/app", "10000", "30", "bound"]
    # Columns line up: the pod's memory sits under the card's.
    assert pod_row.index("10000") == card_row.index("10000/81920")
    assert lines[-1] == "Allocated/total GPU memory: 10000/81920 MiB (12%)"


def test_a_resource_claims_slice_is_named_as_a_claim_in_inspect_and_top() -> None:
    claim = {**SLICE, "pod": "train-gpu-x7k2p", "container": "gpu", "source": "claim"}
    node = json.loads(json.dumps(NODE))
    node["cards"][0]["slices"] = [claim, {**SLICE, "source": "pod"}]
    rows = inspect_table([node]).splitlines()[3:5]
    assert rows[0].split() == ["claim", "team-a/train-gpu-x7k2p/gpu", "10000", "30", "bound"]
    assert rows[1].split() == ["team-a/trainer/app", "10000", "30", "bound"]
    top = top_table([claim]).splitlines()[1].split()
    assert top[:4] == ["team-a", "train-gpu-x7k2p", "(claim)", "gpu"]


def test_inspect_shows_a_mode_and_a_pending_change_where_the_api_gives_them() -> None:
    node = json.loads(json.dumps(NODE))
    node["cards"][0].update(mode="shared", pending_mode="mig", cordoned=True, healthy=False,
                            health_reason="XID 79")  # fmt: skip
    card_row = inspect_table([node]).splitlines()[2]
    assert " shared " in card_row
    assert card_row.endswith("  draining->mig,cordoned,unhealthy(XID 79)")


def test_top_says_dash_for_usage_the_control_plane_does_not_know() -> None:
    lines = top_table([SLICE]).splitlines()
    assert lines[1].split() == ["team-a", "trainer", "app", "n1", "GPU-n1-0", "-/10000", "-/30"]
    assert top_table([]) == "No pods hold a GPU slice."


def test_quota_table_shows_usage_over_limit_and_unlimited() -> None:
    quota = {
        "namespace": "ns",
        "gpumem_mib": 20000,
        "gpucores": None,
        "gpus": 2,
        "usage": {"gpumem_mib": 5000, "gpucores": 10, "gpus": 1},
        "updated_by": "op",
    }
    row = quota_table([quota]).splitlines()[1].split()
    assert row[:5] == ["ns", "5000/20000", "10/unlimited", "1/2", "op"]


# --- arguments --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "required: COMMAND"),
        (["frobnicate"], "invalid choice"),
        (["why"], "required: POD"),
        (["quota", "set", "ns", "--gpus", "-1"], "give a whole number from 0, or 'unlimited'"),
        (["quota", "set", "ns"], "give at least one of --gpumem, --gpucores, --gpus"),
        (["mode", "GPU-1", "turbo"], "invalid choice: 'turbo'"),
        (["inspect", "-o", "xml"], "invalid choice: 'xml'"),
    ],
)
def test_bad_arguments_exit_2_with_a_usage_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_options_go_before_or_after_the_command() -> None:
    parser = build_parser()
    before = parser.parse_args(["--server", "http://a", "-o", "json", "inspect"])
    after = parser.parse_args(["inspect", "--server", "http://a", "-o", "json"])
    assert (before.server, before.output) == (after.server, after.output) == ("http://a", "json")
    unlimited = parser.parse_args(["quota", "set", "ns", "--gpus", "unlimited", "--gpumem", "5"])
    assert (unlimited.gpus, unlimited.gpumem_mib) == (None, 5)


def test_the_proxy_path_names_the_service_and_its_port() -> None:
    assert (
        cli_client.proxy_path("tessera-system", "tessera", "http")
        == "/api/v1/namespaces/tessera-system/services/tessera:http/proxy"
    )
    assert cli_client.split_secret("ns/name") == ("ns", "name")
    with pytest.raises(cli_client.CliError, match="NAMESPACE/NAME"):
        cli_client.split_secret("just-a-name")


# --- against a server -------------------------------------------------------------------------


def test_inspect_json_is_the_nodes_with_their_cards_slices(
    server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "inspect", "--server", server, "--token", TOKEN, "-o", "json")
    assert code == 0, err
    [node] = json.loads(out)
    assert node["cards"][0]["slices"] == [SLICE]
    _, path, headers, _ = FakeTessera.seen[0]
    assert headers["Authorization"] == f"Bearer {TOKEN}"
    assert path == "/api/v1/nodes/?page=1&page_size=500"


def test_the_environment_gives_server_and_token(
    server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(cli_client.SERVER_ENV, server)
    monkeypatch.setenv(cli_client.TOKEN_ENV, TOKEN)
    code, out, _ = run(capsys, "top", "-A", "-o", "yaml")
    assert code == 0 and "pod: trainer" in out


def test_quota_set_changes_the_given_limits_and_creates_a_quota_where_none_is(
    server: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(
        capsys, "quota", "set", "team-a", "--gpumem", "20000", "--gpus", "2",
        "--server", server, "--token", TOKEN,
    )  # fmt: skip
    assert code == 0, err
    sent = [(m, p, b) for m, p, _, b in FakeTessera.seen]
    body = {"gpumem_mib": 20000, "gpus": 2}
    assert sent == [
        ("PATCH", "/api/v1/quotas/team-a/", body),
        ("PUT", "/api/v1/quotas/team-a/", body),
    ]
    assert out.splitlines()[1].split()[:4] == ["team-a", "0/20000", "0/unlimited", "0/2"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["inspect", "--token", "tsr_bad"], "token refused (401): Invalid, revoked or expired"),
        (["why", "ghost", "-n", "team-a", "--token", TOKEN], "not found (404): Tessera has no"),
        (
            ["quota", "set", "team-b", "--gpus", "1", "--token", TOKEN],
            "forbidden (403): Reading needs the viewer role; changing needs the operator role. "
            "This command needs the operator role.",
        ),
        (["cordon", "node/", "--token", TOKEN], "give a card UUID, card/UUID or node/NAME"),
        (["inspect"], "no token: give --token, set TESSERA_TOKEN, or --token-secret"),
    ],
)
def test_refusals_are_one_line_and_exit_non_zero(
    server: str, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, *argv, "--server", server)
    assert code != 0 and out == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_an_unreachable_server_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    with ThreadingHTTPServer(("127.0.0.1", 0), FakeTessera) as closed:
        url = f"http://127.0.0.1:{closed.server_address[1]}"
    code, _, err = run(capsys, "inspect", "--server", url, "--token", TOKEN)
    assert code == 1 and err.startswith(f"error: cannot reach Tessera at {url}: ")


def test_the_plugin_imports_no_django() -> None:
    # It runs on an operator's laptop: Django is not there (and must not be needed).
    code = (
        "import sys, controlplane.cli.main\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('django', 'rest_framework', 'celery') or m.startswith('controlplane.ledger'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_mode_prints_the_new_mode_or_the_drain_in_the_servers_words(
    server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    answers = {
        "GPU-idle": {**CARD, "mode": "mig", "pending_mode": "", "mode_status": "MIG"},
        "GPU-busy": {
            **CARD,
            "mode": "shared",
            "pending_mode": "mig",
            "mode_status": "draining: becomes MIG when its 2 slices end",
        },
    }

    def post(self: FakeTessera) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length))
        self.seen.append(("POST", self.path, dict(self.headers), body))
        uuid = self.path.split("/")[4]
        if uuid not in answers:
            return self.send_json(404, {"error": f"Not found: no API route for {self.path}."})
        return self.send_json(200, answers[uuid])

    monkeypatch.setattr(FakeTessera, "do_POST", post)
    flags = ["--server", server, "--token", TOKEN]
    code, out, _ = run(capsys, "mode", "GPU-idle", "mig", "--reason", "inference", *flags)
    assert (code, out) == (0, "card/GPU-idle mode mig\n")
    assert FakeTessera.seen[-1][3] == {"mode": "mig", "reason": "inference"}
    assert FakeTessera.seen[-1][1] == "/api/v1/cards/GPU-idle/mode"
    code, out, _ = run(capsys, "mode", "GPU-busy", "mig", *flags)
    assert out == "card/GPU-busy draining: becomes MIG when its 2 slices end\n"
    code, out, err = run(capsys, "mode", "GPU-old", "mig", *flags)
    assert code == 1 and err.startswith("error: not found (404): Not found: no API route")


# --- virtual device memory (docs/virtual-memory.md) ---------------------------------------------


def test_top_shows_resident_and_spilled_next_to_a_slice_that_may_spill() -> None:
    spilling = {
        **SLICE, "pod": "big", "memory_mib": 6000, "resident_mib": 3000,
        "memory_used_mib": 5000, "memory_resident_mib": 3000, "memory_spilled_mib": 2000,
    }  # fmt: skip
    lines = top_table([SLICE, spilling]).splitlines()
    assert lines[0].split()[-2:] == ["RESIDENT(MiB)", "SPILLED(MiB)"]
    assert lines[1].split()[-2:] == ["-/10000", "-"]  # resident in full, no sample
    assert lines[2].split()[-4:] == ["5000/6000", "-/30", "3000/3000", "2000"]
    # A cluster that does not use it keeps its columns.
    assert "RESIDENT" not in top_table([SLICE])


def test_inspect_shows_a_card_s_factor_and_virtual_use() -> None:
    card = {**CARD, "memory_oversubscription": "2", "memory_virtual_mib": 163840}
    node = {**NODE, "cards": [card]}
    assert "oversubscribed x2 (10000/163840 MiB virtual)" in inspect_table([node])
    assert "oversubscribed" not in inspect_table([{**NODE, "cards": [CARD]}])


def test_oversubscribe_posts_the_factor_and_default_clears_it(
    server: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    def post(self: FakeTessera) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length))
        self.seen.append(("POST", self.path, dict(self.headers), body))
        if body["factor"] == "0.5":
            return self.send_json(400, {"error": "factor: must be from 1 to 16"})
        own = body["factor"]
        applied = own or "1"
        answer = {**CARD, "memory_oversubscription": applied, "memory_oversubscription_own": own}
        return self.send_json(200, answer)

    monkeypatch.setattr(FakeTessera, "do_POST", post)
    flags = ["--server", server, "--token", TOKEN]
    code, out, _ = run(capsys, "oversubscribe", "GPU-n1-0", "1.5", "--reason", "nb", *flags)
    assert (code, out) == (0, "card/GPU-n1-0 memory oversubscription x1.5\n")
    assert FakeTessera.seen[-1][1] == "/api/v1/cards/GPU-n1-0/memory-oversubscription"
    assert FakeTessera.seen[-1][3] == {"factor": "1.5", "reason": "nb"}
    code, out, _ = run(capsys, "oversubscribe", "GPU-n1-0", "default", *flags)
    assert out == "card/GPU-n1-0 memory oversubscription x1 (the node's default)\n"
    assert FakeTessera.seen[-1][3] == {"factor": None, "reason": ""}
    code, out, err = run(capsys, "oversubscribe", "GPU-n1-0", "0.5", *flags)
    assert code == 1 and "from 1 to 16" in err
