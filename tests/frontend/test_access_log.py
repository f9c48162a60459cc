"""Request ids and JSON access logs through a real server: ids echoed or made, one JSON line
per request, and the connection gate's refusals carry an id and are logged with their reason."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.conftest import RunningServer, start_server

ECHO = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
SLOW = {
    "inputs": [
        {"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},
        {"name": "delay", "shape": [1, 1], "datatype": "FP32", "data": [1.5]},
    ]
}


@pytest.fixture(scope="module")
def logged_server(
    test_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    repo = tmp_path_factory.mktemp("access-repo")
    for name in ("echo", "slow"):
        shutil.copytree(test_repo / name, repo / name)
    server = start_server(
        repo,
        tmp_path_factory.mktemp("access"),
        "--no-llm",
        "--access-log",
        "--limit-concurrency",
        "1",
    )
    yield server
    server.stop()


def access_lines(server: RunningServer) -> list[dict[str, object]]:
    lines = []
    for line in server.log().splitlines():
        if line.startswith('{"time"'):  # each entry is a whole line of JSON
            lines.append(json.loads(line))
    return lines


def wait_for_line(server: RunningServer, rid: str) -> dict[str, object]:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        found = [e for e in access_lines(server) if e["request_id"] == rid]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no access log line for {rid}")


def test_a_client_request_id_is_echoed_and_logged(logged_server: RunningServer) -> None:
    r = httpx.post(
        logged_server.url + "/v2/models/echo/infer", json=ECHO, headers={"X-Request-Id": "abc-123"}
    )
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "abc-123"
    entry = wait_for_line(logged_server, "abc-123")
    assert entry["method"] == "POST" and entry["path"] == "/v2/models/echo/infer"
    assert entry["status"] == 200 and entry["model"] == "echo"
    assert entry["bytes_in"] == len(r.request.content) and entry["bytes_out"] == len(r.content)
    assert 0 < float(entry["duration_ms"]) < 10_000  # type: ignore[arg-type]


def test_ids_are_made_when_absent_or_unusable(logged_server: RunningServer) -> None:
    url = logged_server.url + "/v2/health/live"
    made = {httpx.get(url).headers["x-request-id"] for _ in range(3)}
    assert len(made) == 3  # unique
    bad = httpx.get(url, headers={"X-Request-Id": "has spaces and {json}"})
    assert bad.headers["x-request-id"] not in ("has spaces and {json}", "")
    long = httpx.get(url, headers={"X-Request-Id": "x" * 500})
    assert long.headers["x-request-id"] != "x" * 500
    assert httpx.get(logged_server.url + "/nowhere").headers["x-request-id"]  # errors too


def test_a_gate_refusal_carries_an_id_and_is_logged(logged_server: RunningServer) -> None:
    url = logged_server.url + "/v2/models/slow/infer"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(httpx.post, url, json=SLOW, timeout=30)
        time.sleep(0.5)  # the slow request holds the only place
        refused = httpx.post(url, json=SLOW, headers={"X-Request-Id": "refused-1"})
        assert busy.result().status_code == 200
    assert refused.status_code == 503, refused.text
    assert refused.headers["x-request-id"] == "refused-1"
    entry = wait_for_line(logged_server, "refused-1")
    assert entry["status"] == 503 and entry["refused"] == "requests"


def test_a_gate_refusal_on_the_openai_api_is_an_openai_error_the_client_retries(
    logged_server: RunningServer,
) -> None:
    """The official client reads the refusal as an OpenAI error (its message, type and code),
    waits the Retry-After it names and tries again."""
    slow = logged_server.url + "/v2/models/slow/infer"
    client = openai.OpenAI(base_url=logged_server.url + "/v1", api_key="unused", max_retries=0)
    patient = client.with_options(max_retries=4)
    chat = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        busy = pool.submit(httpx.post, slow, json=SLOW, timeout=30)
        time.sleep(0.5)  # the slow request holds the only place
        with pytest.raises(openai.InternalServerError) as refused:
            client.chat.completions.create(**chat)  # type: ignore[call-overload]
        started = time.monotonic()
        with pytest.raises(openai.NotFoundError):  # let through once the place is free
            patient.chat.completions.create(**chat)  # type: ignore[call-overload]
        assert busy.result().status_code == 200
    assert time.monotonic() - started >= 0.9  # it waited as it was told
    assert refused.value.status_code == 503
    assert int(refused.value.response.headers["retry-after"]) >= 1
    assert refused.value.body == {
        "message": "server is saturated: retry later",
        "type": "unavailable",
        "param": None,
        "code": 503,
    }
