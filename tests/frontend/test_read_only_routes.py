"""The routes that only read (health, metrics, the OpenAPI document) answer GET and HEAD; any
other method gets 405 with an Allow header, as Starlette answers, through a real server."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import RunningServer

READ_ONLY = (
    *("/v2/health/live", "/v2/health/ready", "/health", "/metrics", "/openapi.json"),
    *("/v2", "/dashboard"),
)


@pytest.mark.parametrize("path", READ_ONLY)
def test_other_methods_get_405_with_allow(server: RunningServer, path: str) -> None:
    with httpx.Client(base_url=server.url) as client:
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
            answer = client.request(method, path, content=b"{}")
            assert answer.status_code == 405, (method, answer.text)
            assert answer.headers["allow"] == "GET, HEAD"
            assert method in answer.json()["error"]
        assert client.get(path).status_code == 200
        head = client.head(path)
        assert head.status_code == 200 and head.content == b""


def test_the_root_redirects_on_get_and_refuses_other_methods(server: RunningServer) -> None:
    with httpx.Client(base_url=server.url) as client:
        assert client.get("/").status_code == 302
        assert client.get("/").headers["location"] == "/dashboard"
        answer = client.post("/", content=b"{}")
        assert answer.status_code == 405 and answer.headers["allow"] == "GET, HEAD"


def test_a_405_is_not_a_404_elsewhere(server: RunningServer) -> None:
    """A path that does not exist stays a 404 whatever the method."""
    answer = httpx.post(server.url + "/v2/health/nothing")
    assert answer.status_code == 404 and "allow" not in answer.headers
