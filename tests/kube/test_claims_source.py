"""The real adapter's ResourceClaims and ResourceSlices (DRA mode), against a local HTTP server
answering as kube-apiserver does: pages followed, the driver's slices asked by field selector,
a refusal (403, 404) told apart from a temporary error."""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes import client as k8s

from controlplane.kube.real import RealClusterSource, RealKube
from controlplane.kube.sources import ClaimsUnreadable, PublishedDevice, TemporaryError
from nodeplugin.cards import Card
from nodeplugin.dra_slices import DRIVER, build_slices
from tests.kube.test_adapter import FakeApiServer

PATH = "/apis/resource.k8s.io/v1/"


def claim(name: str) -> dict[str, Any]:
    result = {"request": "gpu", "driver": DRIVER, "pool": "n1", "device": "gpu-0",
              "consumedCapacity": {"memory": "4Gi", "compute": "30"}}  # fmt: skip
    return {
        "metadata": {"name": name, "namespace": "team", "uid": f"u-{name}"},
        "status": {"allocation": {"devices": {"results": [result]}}},
    }


class DraApiServer(FakeApiServer):
    """kube-apiserver's resource.k8s.io/v1 lists (and its refusals, by `status`)."""

    status = 200
    seen: list[dict[str, list[str]]] = []

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        self.seen.append({"path": [url.path], **query})
        if self.status != 200:
            self.send_json(self.status, {"kind": "Status", "code": self.status, "message": "no"})
        elif url.path == PATH + "resourceclaims":
            # two pages: the second asked with the first's continue token
            if query.get("continue") == ["page-2"]:
                page = {"metadata": {"resourceVersion": "42"}, "items": [claim("b")]}
            else:
                page = {"metadata": {"continue": "page-2"}, "items": [claim("a")]}
            self.send_json(200, page)
        elif url.path == PATH + "resourceslices":
            cards = [Card("GPU-n1-0", 0, "NVIDIA A100-SXM4-80GB", 81920, 0)]
            items = build_slices("n1", cards, modes={}, health={}, slots=10, generation=1)
            self.send_json(200, {"metadata": {"resourceVersion": "43"}, "items": items})
        else:
            self.send_json(404, {"kind": "Status", "code": 404, "message": "not found"})


@pytest.fixture
def source() -> Iterator[RealClusterSource]:
    DraApiServer.status, DraApiServer.seen = 200, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), DraApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    config = k8s.Configuration()
    config.host = f"http://127.0.0.1:{server.server_address[1]}"
    yield RealClusterSource(RealKube.with_api(k8s.CoreV1Api(k8s.ApiClient(config))))
    server.shutdown()


def test_claims_are_listed_page_by_page_with_the_lists_version(source: RealClusterSource):
    claims, rv = source.list_claims(page_size=1)
    assert [(c.name, c.uid, c.allocated) for c in claims] == [
        ("a", "u-a", True),
        ("b", "u-b", True),
    ]
    assert rv == "42" and source.last_claims_resource_version() == "42"
    assert claims[0].results[0].consumed == {"memory": "4Gi", "compute": "30"}
    assert [q.get("limit") for q in DraApiServer.seen] == [["1"], ["1"]]


def test_only_tesseras_slices_are_asked_for_and_mapped_to_cards(source: RealClusterSource):
    assert source.published_devices() == {
        ("n1", "gpu-0"): PublishedDevice("GPU-n1-0", 81920, shared=True)
    }
    assert DraApiServer.seen[0]["fieldSelector"] == [f"spec.driver={DRIVER}"]


@pytest.mark.parametrize("status", [403, 404])
def test_a_refusal_is_claims_unreadable_not_a_temporary_error(
    source: RealClusterSource, status: int
):
    DraApiServer.status = status
    with pytest.raises(ClaimsUnreadable, match=f"list resourceclaims.*{status}"):
        source.list_claims()
    with pytest.raises(ClaimsUnreadable, match="list resourceslices"):
        source.published_devices()


def test_a_server_error_stays_temporary(source: RealClusterSource):
    DraApiServer.status = 503
    with pytest.raises(TemporaryError, match="503"):
        source.list_claims()
