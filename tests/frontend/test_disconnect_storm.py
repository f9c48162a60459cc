"""Clients that hang up mid-request leave no work behind, for classic models and the LLM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time

import httpx
import pytest

from tests.conftest import RunningServer, http_post

CLIENTS = 200
LLM_MODEL = "SmolLM2-135M-Instruct"


def metric_values(server: RunningServer, name: str, model: str) -> list[float]:
    text = httpx.get(server.url + "/metrics", timeout=5).text
    pattern = rf'^{name}\{{[^}}]*model(?:_name)?="{re.escape(model)}"[^}}]*\}} (\S+)$'
    return [float(v) for v in re.findall(pattern, text, re.MULTILINE)]


def wait_for_zero(
    server: RunningServer, names: tuple[str, ...], model: str, within: float
) -> float:
    """Seconds until every named gauge of `model` reads 0; fails after `within`."""
    start = time.monotonic()
    while True:
        values = {n: metric_values(server, n, model) for n in names}
        if all(v and all(x == 0 for x in v) for v in values.values()):
            return time.monotonic() - start
        if time.monotonic() - start > within:
            pytest.fail(f"still busy {within} s after the clients left: {values}")
        time.sleep(0.05)


async def hang_up(port: int, raw: bytes, read_first: bool, linger: float) -> bool:
    """Send a whole request, maybe wait for the first bytes of the answer, then close.

    True when the server had answered nothing before the close.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    got = b""
    if read_first:
        with contextlib.suppress(TimeoutError):
            got = await asyncio.wait_for(reader.read(4096), linger)
    else:
        await asyncio.sleep(linger)
    writer.transport.abort()  # RST: the rudest way to leave
    return not got


async def storm(port: int, raw: bytes, read_first: bool, linger: float) -> int:
    """Clients that left before any answer."""
    left = await asyncio.gather(
        *(hang_up(port, raw, read_first and i % 2 == 0, linger) for i in range(CLIENTS))
    )
    return sum(left)


def test_classic_disconnect_storm_leaves_no_queued_work(server: RunningServer) -> None:
    # Every batch of `echo` sleeps 0.5 s: the first batch is in flight, the rest queue.
    body = json.dumps(
        {
            "inputs": [
                {"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
                {"name": "delay", "datatype": "FP32", "shape": [1, 1], "data": [0.5]},
            ]
        }
    ).encode()
    raw = http_post("/v2/models/echo/infer", body, server.port)
    left = asyncio.run(storm(server.port, raw, read_first=False, linger=0.3))
    assert left == CLIENTS  # all were still waiting when they hung up
    names = ("lockgate_queue_depth", "lockgate_inflight_requests")
    waited = wait_for_zero(server, names, "echo", within=2.0)
    assert waited < 2.0
    counts = metric_values(server, "lockgate_requests_total", "echo")
    assert counts  # the storm was counted
    answer = httpx.post(
        server.url + "/v2/models/echo/infer",
        content=json.dumps(
            {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]}
        ),
        timeout=10,
    )
    assert answer.status_code == 200
    assert answer.json()["outputs"][0]["data"] == [2.0, 4.0, 6.0, 8.0]


def test_llm_disconnect_storm_frees_every_sequence(llm_server: RunningServer) -> None:
    body = json.dumps(
        {
            "model": LLM_MODEL,
            "prompt": "Write a long story about a lighthouse keeper and the sea.",
            "max_tokens": 200,
            "temperature": 0,
            "stream": True,
        }
    ).encode()
    raw = http_post("/v1/completions", body, llm_server.port)
    # half wait for the first chunk (or 2 s), half hang up at once
    asyncio.run(storm(llm_server.port, raw, read_first=True, linger=2.0))
    names = (
        "lockgate_llm_num_requests_running",
        "lockgate_llm_num_requests_waiting",
        "lockgate_llm_kv_cache_usage_perc",
    )
    wait_for_zero(llm_server, names, LLM_MODEL, within=10.0)
    answer = httpx.post(
        llm_server.url + "/v1/completions",
        json={"model": LLM_MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] >= 1
