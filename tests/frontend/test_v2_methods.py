"""A known v2 route asked with a method it does not take gets 405 with an Allow header, as
the /v1 routes and the read-only routes answer (`test_read_only_routes.py`); a path that is
no route stays a 404, through a real server."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import RunningServer

MODEL = "/v2/models/digits_onnx"

# (method, path, the Allow header)
WRONG_METHODS = [
    ("GET", f"{MODEL}/infer", "POST"),
    ("PUT", f"{MODEL}/versions/1/infer", "POST"),
    ("GET", "/v2/models/no_such_model/infer", "POST"),
    ("GET", f"{MODEL}/generate_stream", "POST"),
    ("POST", MODEL, "GET, HEAD"),
    ("DELETE", f"{MODEL}/versions/1", "GET, HEAD"),
    ("POST", f"{MODEL}/ready", "GET, HEAD"),
    ("POST", f"{MODEL}/config", "GET, HEAD"),
    ("PATCH", f"{MODEL}/versions/1/stats", "GET, HEAD"),
    ("POST", "/v2/models/stats", "GET, HEAD"),
    ("GET", "/v2/repository/index", "POST"),
    ("GET", "/v2/repository/models/digits_onnx/load", "POST"),
    ("DELETE", "/v2/repository/models/digits_onnx/unload", "POST"),
]


@pytest.mark.parametrize(("method", "path", "allow"), WRONG_METHODS)
def test_a_known_route_asked_with_another_method_gets_405(
    server: RunningServer, method: str, path: str, allow: str
) -> None:
    answer = httpx.request(method, server.url + path, content=b"{}")
    assert answer.status_code == 405, answer.text
    assert answer.headers["allow"] == allow
    error = answer.json()["error"]
    assert method in error and allow in error


def test_the_routes_take_their_own_methods_and_other_paths_stay_404(
    server: RunningServer,
) -> None:
    with httpx.Client(base_url=server.url) as client:
        for path in (MODEL, f"{MODEL}/ready", f"{MODEL}/config", "/v2/models/stats"):
            assert client.get(path).status_code == 200, path
            head = client.head(path)
            assert head.status_code == 200 and head.content == b"", path
        assert client.post("/v2/repository/index").status_code == 200
        for method, path in [
            ("GET", f"{MODEL}/nothing"),
            ("POST", f"{MODEL}/infer/more"),
            ("GET", f"{MODEL}/versions/1/ready/more"),
            ("POST", "/v2/repository/nothing"),
            ("GET", "/v2/repository/models/digits_onnx/reload"),
        ]:
            answer = client.request(method, path)
            assert answer.status_code == 404, (method, path, answer.text)
            assert "allow" not in answer.headers
