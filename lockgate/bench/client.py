"""One request on the wire: send a pre-encoded body, time it, and classify its failure."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from lockgate.bench.sse import SSEDecoder
from lockgate.bench.workload import Payload

JSON_HEADERS = {"content-type": "application/json"}


@dataclass(slots=True)
class RequestRecord:
    """Times are time.perf_counter() seconds. Latency counts from the *scheduled* send time,
    so a client or server stall shows up in every request it delayed."""

    scheduled: float
    warmup: bool = False
    started: float = 0.0
    finished: float = 0.0
    status: int = 0
    error: str | None = None  # "http_503", "timeout", "connection_error", ...
    chunk_times: list[float] = field(default_factory=list)  # LLM: each content chunk
    output_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def latency(self) -> float:
        return self.finished - self.scheduled

    @property
    def send_lag(self) -> float:
        return self.started - self.scheduled

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.scheduled if self.chunk_times else None

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (output tokens - 1); None with fewer than two tokens."""
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.latency - ttft) / (self.output_tokens - 1)

    def itls(self) -> list[float]:
        """Every gap between consecutive content chunks."""
        times = self.chunk_times
        return [b - a for a, b in itertools.pairwise(times)]


Sender = Callable[[aiohttp.ClientSession, str, Payload, RequestRecord], Awaitable[None]]


async def send(
    session: aiohttp.ClientSession, url: str, payload: Payload, record: RequestRecord, stream: bool
) -> None:
    """POST the payload and fill `record`; never raises for a failed request."""
    record.started = time.perf_counter()
    try:
        async with session.post(url, data=payload.body, headers=JSON_HEADERS) as response:
            record.status = response.status
            if response.status != 200:
                await response.read()
                record.error = f"http_{response.status}"
            elif stream:
                await _read_stream(response, record)
            else:
                await response.read()
    except TimeoutError:
        record.error = "timeout"
    except aiohttp.ClientConnectionError:
        record.error = "connection_error"
    except aiohttp.ClientError:
        record.error = "client_error"
    record.finished = time.perf_counter()


async def _read_stream(response: aiohttp.ClientResponse, record: RequestRecord) -> None:
    decoder = SSEDecoder()
    done = False
    content_chunks = 0
    async for chunk in response.content.iter_any():
        now = time.perf_counter()
        for data in decoder.feed(chunk):
            if data.strip() == "[DONE]":
                done = True
                continue
            content_chunks += _on_event(data, record, now)
    for data in decoder.flush():
        done = done or data.strip() == "[DONE]"
    if record.error is None and not done:
        record.error = "incomplete_stream"
    if record.output_tokens == 0:
        record.output_tokens = content_chunks


def _on_event(data: str, record: RequestRecord, now: float) -> int:
    """Handle one `data:` payload; 1 when it carried generated text."""
    try:
        event = json.loads(data)
    except json.JSONDecodeError:
        record.error = "bad_stream"
        return 0
    if not isinstance(event, dict):
        return 0
    if "error" in event:
        record.error = "stream_error"
        return 0
    usage = event.get("usage")
    if isinstance(usage, dict):
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        text = choice.get("text") if "text" in choice else delta.get("content")
        if text:
            record.chunk_times.append(now)
            return 1
    return 0
