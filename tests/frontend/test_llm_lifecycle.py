"""Language models in the one model lifecycle, through a real server and real clients: the
repository API loads, reloads (without a gap for streams in flight) and unloads SmolLM2 as it
does any model, and readiness and the OpenAI routes follow."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from lockgate.demo.smollm2 import SERVED_NAME
from tests.conftest import ONE_THREAD, RunningServer, smollm2_repository, start_server


@pytest.fixture(scope="module")
def explicit_llm_server(
    demo_repo: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    repo = smollm2_repository(
        demo_repo,
        tmp_path_factory.mktemp("llm-lifecycle-repo"),
        {"kv_cache_gib": "0.05", "max_model_len": "512", **ONE_THREAD},
    )
    server = start_server(
        repo,
        tmp_path_factory.mktemp("llm-lifecycle"),
        "--model-control-mode",
        "explicit",
        "--load-model",
        "*",
        "--drain-timeout",
        "30",
        ready_timeout=600,
    )
    yield server
    server.stop()


def index(server: RunningServer) -> list[dict[str, str]]:
    r = httpx.post(server.url + "/v2/repository/index", timeout=30)
    assert r.status_code == 200, r.text
    return list(r.json())


def stream_tokens(server: RunningServer, max_tokens: int) -> int:
    """Stream one greedy completion; the number of tokens the server says it generated."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    try:
        stream = client.completions.create(
            model=SERVED_NAME,
            prompt="Once upon a time",
            max_tokens=max_tokens,
            temperature=0.0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    except openai.InternalServerError as error:  # the server's reason, in the failure's message
        raise AssertionError(f"{error.status_code}: {error.response.text}") from error
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    return usage[-1].completion_tokens if usage else 0


def test_a_language_model_is_listed_ready_with_its_version(
    explicit_llm_server: RunningServer,
) -> None:
    entries = index(explicit_llm_server)
    assert {"name": "smollm2", "version": "1", "state": "READY", "reason": ""} in entries
    ready = httpx.get(explicit_llm_server.url + "/v2/models/smollm2/ready")
    assert ready.status_code == 200, ready.text
    assert httpx.get(explicit_llm_server.url + "/v2/health/ready").status_code == 200
    models = httpx.get(explicit_llm_server.url + "/v1/models").json()
    assert [m["id"] for m in models["data"]] == [SERVED_NAME]


def test_reload_without_a_gap_for_streams_in_flight(explicit_llm_server: RunningServer) -> None:
    """Long streams admitted before a reload run to their end on the old version; requests
    sent while the new version loads, warms up and takes over are served, not refused (one
    that resolved the old version just before it began draining starts over on the new)."""
    url = explicit_llm_server.url

    def while_reloading(reload: concurrent.futures.Future[httpx.Response]) -> list[int]:
        served = []
        while not reload.done():
            served.append(stream_tokens(explicit_llm_server, 2))
        return served

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream_tokens, explicit_llm_server, 200) for _ in range(2)]
        reload = pool.submit(httpx.post, url + "/v2/repository/models/smollm2/load", timeout=600)
        senders = [pool.submit(while_reloading, reload) for _ in range(3)]
        during = [n for sender in senders for n in sender.result(timeout=600)]
        tokens = [s.result(timeout=300) for s in streams]
    assert reload.result().status_code == 200, reload.result().text
    assert tokens == [200, 200]
    assert during and all(n == 2 for n in during), during
    assert stream_tokens(explicit_llm_server, 8) == 8  # the new version serves
    assert "Traceback" not in explicit_llm_server.log()


def test_unload_then_load(explicit_llm_server: RunningServer) -> None:
    url = explicit_llm_server.url
    assert httpx.post(url + "/v2/repository/models/smollm2/unload", timeout=120).status_code == 200
    assert httpx.get(url + "/v2/models/smollm2/ready").status_code == 404
    assert httpx.get(url + "/v1/models").json()["data"] == []
    with pytest.raises(openai.NotFoundError):
        stream_tokens(explicit_llm_server, 4)
    assert httpx.get(url + "/v2/health/ready").status_code == 503  # nothing left to serve
    r = httpx.post(url + "/v2/repository/models/smollm2/load", timeout=600)
    assert r.status_code == 200, r.text
    assert httpx.get(url + "/v2/models/smollm2/ready").status_code == 200
    assert stream_tokens(explicit_llm_server, 4) == 4
