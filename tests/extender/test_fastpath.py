"""The production WSGI application (`controlplane.wsgi`) sends the extender's verbs around
Django's middleware: same answers as through Django, same guards, everything else untouched."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from controlplane.extender import fastpath
from controlplane.ledger.models import PodBinding
from tests.builders import make_node
from tests.extender.builders import bind_args, filter_args
from tests.extender.conftest import post
from tests.pods import gpu_pod

pytestmark = pytest.mark.django_db


def call(
    path: str,
    body: Any = b"",
    *,
    method: str = "POST",
    peer: str = "127.0.0.1",
    headers: dict[str, str] | None = None,
) -> tuple[str, dict[str, str], bytes]:
    """One request through controlplane.wsgi.application, as gunicorn would make it
    (`headers`: more of them, e.g. {"AUTHORIZATION": "Bearer ..."})."""
    from controlplane.wsgi import application

    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    environ = {
        "REQUEST_METHOD": method,
        "PATH_INFO": path,
        "SCRIPT_NAME": "",
        "QUERY_STRING": "",
        "CONTENT_TYPE": "application/json",
        "CONTENT_LENGTH": str(len(data)),
        "REMOTE_ADDR": peer,
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "8000",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "HTTP_HOST": "127.0.0.1:8000",
        "wsgi.input": io.BytesIO(data),
        "wsgi.url_scheme": "http",
        "wsgi.errors": io.StringIO(),
        "wsgi.multithread": True,
        "wsgi.multiprocess": False,
        "wsgi.run_once": False,
        "wsgi.version": (1, 0),
        **{f"HTTP_{k.upper().replace('-', '_')}": v for k, v in (headers or {}).items()},
    }
    answered: dict[str, Any] = {}

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        answered["status"], answered["headers"] = status, dict(headers)

    chunks = application(environ, start_response)
    content = b"".join(chunks)
    getattr(chunks, "close", lambda: None)()
    return answered["status"], answered["headers"], content


@pytest.fixture
def counted_views(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Count the fast path's dispatches and its connection clean-ups (Django's test client
    disconnects the same clean-up from its request signals for the same reason)."""
    seen = {"views": 0, "cleanups": 0}
    for route, view in list(fastpath.ROUTES.items()):

        def counting(request: Any, _view: Any = view) -> Any:
            seen["views"] += 1
            return _view(request)

        monkeypatch.setitem(fastpath.ROUTES, route, counting)

    def cleanup() -> None:  # counted, not run: it would close the test's transaction
        seen["cleanups"] += 1

    monkeypatch.setattr(fastpath, "close_old_connections", cleanup)
    return seen


def test_filter_answers_as_through_django_without_its_middleware(client, counted_views) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    make_node("n2", cards=1, memory_mib=500)
    args = filter_args(gpu_pod(mem=2000), ["n1", "n2", "ghost"])

    status, headers, content = call("/scheduler/filter", args)
    through_django = post(client, "/scheduler/filter", args)

    assert counted_views == {"views": 1, "cleanups": 1}
    assert status == "200 OK"
    assert json.loads(content) == through_django.json()
    assert json.loads(content)["NodeNames"] == ["n1"]
    assert headers["Content-Type"] == "application/json"
    assert headers["Content-Length"] == str(len(content))
    assert "X-Frame-Options" not in headers  # no middleware ran
    assert "X-Frame-Options" in through_django.headers  # (which the Django path has)


def test_prioritize_and_bind_go_the_fast_path(fake_kube, counted_views) -> None:
    make_node("n1", cards=1, memory_mib=10000)
    pod = fake_kube.add(gpu_pod("trainer", mem=2000))
    status, _, content = call("/scheduler/prioritize", filter_args(pod, ["n1"]))
    assert status == "200 OK" and json.loads(content) == [{"Host": "n1", "Score": 2}]

    status, _, content = call("/scheduler/bind", bind_args(pod, "n1"))
    assert status == "200 OK" and json.loads(content) == {"Error": ""}
    assert PodBinding.objects.get(pod_uid=pod["metadata"]["uid"]).phase == "bound"
    assert counted_views == {"views": 2, "cleanups": 2}


def test_the_views_guards_still_answer(counted_views, settings) -> None:
    status, _, content = call("/scheduler/filter", filter_args(gpu_pod(), []), peer="10.0.0.7")
    assert status == "403 Forbidden" and b"loopback" in content

    status, headers, _ = call("/scheduler/bind", method="GET")
    assert status == "405 Method Not Allowed" and headers["Allow"] == "POST"

    settings.TESSERA = {**settings.TESSERA, "EXTENDER_MAX_BODY": 100}
    status, _, content = call("/scheduler/filter", b"x" * 101)
    assert status == "400 Bad Request" and b"over the limit" in content

    settings.TESSERA = {**settings.TESSERA, "SERVE_EXTENDER": False}
    status, _, _ = call("/scheduler/filter", filter_args(gpu_pod(), []))
    assert status == "404 Not Found"
    assert counted_views["views"] == 4


def test_other_paths_go_through_django(counted_views) -> None:
    status, headers, _ = call("/scheduler/filter/", filter_args(gpu_pod(), []))
    assert counted_views["views"] == 0
    assert "X-Frame-Options" in headers  # Django's middleware answered (its 404 or redirect)
    assert not status.startswith("200")

    status, headers, _ = call("/api/v1/nodes/", method="GET")
    assert status.startswith("401") and "X-Frame-Options" in headers
    assert counted_views["views"] == 0


def test_a_bug_between_server_and_view_is_a_json_500(monkeypatch, counted_views) -> None:
    monkeypatch.setattr(fastpath, "WSGIRequest", lambda environ: 1 / 0)
    status, _, content = call("/scheduler/filter", filter_args(gpu_pod(), []))
    assert status == "500 Internal Server Error" and b"Error" in content
    assert counted_views["cleanups"] == 1
