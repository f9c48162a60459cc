"""Calls from browser pages of other origins (`--allowed-origins`): preflights answered, and
answers, errors and the lane's alike carrying the CORS headers, for allowed origins only."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import RunningServer, start_server

APP = "https://app.example.com"
ECHO = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}


@pytest.fixture(scope="module")
def cors_server(
    test_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("cors-repo")
    shutil.copytree(test_repo / "echo", repo / "echo")
    running = start_server(
        repo, tmp_path_factory.mktemp("cors-logs"), "--no-llm", "--allowed-origins", APP
    )
    yield running
    running.stop()


def test_a_preflight_from_an_allowed_origin_is_answered(cors_server: RunningServer) -> None:
    asked = {
        "Origin": APP,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    r = httpx.options(cors_server.url + "/v1/chat/completions", headers=asked)
    assert r.status_code == 204
    assert r.headers["access-control-allow-origin"] == APP
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"]
    other = httpx.options(
        cors_server.url + "/v1/chat/completions", headers={**asked, "Origin": "https://evil.test"}
    )
    assert other.status_code == 405 and "access-control-allow-origin" not in other.headers


def test_answers_and_errors_carry_the_headers_for_allowed_origins_only(
    cors_server: RunningServer,
) -> None:
    url = cors_server.url + "/v2/models/echo/infer"
    for origin, expected in ((APP, APP), ("https://evil.test", None), (None, None)):
        headers = {"Origin": origin} if origin else {}
        answer = httpx.post(url, json=ECHO, headers=headers)  # the lane's when no origin
        assert answer.status_code == 200
        assert answer.headers.get("access-control-allow-origin") == expected
        missing = httpx.post(cors_server.url + "/v2/models/nope/infer", json=ECHO, headers=headers)
        assert missing.status_code == 404
        assert missing.headers.get("access-control-allow-origin") == expected
    exposed = httpx.post(url, json=ECHO, headers={"Origin": APP}).headers
    assert "x-request-id" in exposed["access-control-expose-headers"]
    assert "Origin" in exposed["vary"]
