"""A small real HTTP server for bench tests: KServe v2 infer and OpenAI streaming endpoints.

It runs on its own event loop in a thread, on 127.0.0.1 with a free port. Its behaviour is
set per test: service time per request (by arrival count), errors, a one-off stall, and the
pace of streamed tokens.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from aiohttp import web


@dataclass
class Behaviour:
    # n: 1-based arrival count of infer requests -> seconds to sleep
    sleep: Callable[[int], float] = lambda n: 0.0
    # n -> an HTTP status to answer instead (None: answer normally)
    fail: Callable[[int], int | None] = lambda n: None
    rows_sleep: Callable[[int], float] | None = None  # rows in the request -> seconds
    stall_at: int | None = None  # the stall starts when this request arrives
    stall_s: float = 0.3
    first_token_s: float = 0.05
    token_gap_s: float = 0.02
    tokens: int = 11
    send_usage: bool = True
    seen_prompts: list[object] = field(default_factory=list)
    client_ports: list[int] = field(default_factory=list)  # of each completion request


class FakeServer:
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.count = 0
        self.stall_until = 0.0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v2/models/{model}", self.metadata)
        app.router.add_post("/v2/models/{model}/infer", self.infer)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        return app

    async def metadata(self, request: web.Request) -> web.Response:
        if request.match_info["model"] != "toy":
            return web.json_response({"error": "no such model"}, status=404)
        inputs = [
            {"name": "x", "datatype": "FP32", "shape": [-1, 4]},
            {"name": "ids", "datatype": "INT64", "shape": [-1, 2]},
            {"name": "text", "datatype": "BYTES", "shape": [-1, 1]},
        ]
        return web.json_response({"name": "toy", "versions": ["1"], "inputs": inputs})

    async def infer(self, request: web.Request) -> web.Response:
        self.count += 1
        n = self.count
        body = await request.json()
        b = self.behaviour
        now = time.perf_counter()
        if b.stall_at is not None and n == b.stall_at:
            self.stall_until = now + b.stall_s
        if now < self.stall_until:
            await asyncio.sleep(self.stall_until - now)
        status = b.fail(n)
        if status is not None:
            return web.json_response({"error": "busy"}, status=status, headers={"retry-after": "1"})
        rows = body["inputs"][0]["shape"][0]
        delay = b.rows_sleep(rows) if b.rows_sleep else b.sleep(n)
        await asyncio.sleep(delay)
        out = {"name": "y", "datatype": "FP32", "shape": [rows, 1], "data": [0.5] * rows}
        return web.json_response({"model_name": "toy", "id": str(n), "outputs": [out]})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny-llm"}]})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        b = self.behaviour
        chat = "messages" in body
        b.seen_prompts.append(body.get("messages") or body.get("prompt"))
        peer = request.transport.get_extra_info("peername") if request.transport else None
        b.client_ports.append(peer[1] if peer else 0)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(b.first_token_s)
        if chat:  # a role-only first chunk carries no text and is no token
            await self._event(response, {"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(b.tokens):
            if i:
                await asyncio.sleep(b.token_gap_s)
            choice = {"index": 0, "delta": {"content": f" t{i}"}} if chat else {"text": f" t{i}"}
            await self._event(response, {"choices": [choice]})
        if b.send_usage:
            prompt = body.get("prompt")
            usage = {
                "prompt_tokens": len(prompt) if isinstance(prompt, list) else 7,
                "completion_tokens": b.tokens,
                "total_tokens": 0,
            }
            await self._event(response, {"choices": [], "usage": usage})
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    @staticmethod
    async def _event(response: web.StreamResponse, payload: dict[str, object]) -> None:
        await response.write(b"data: " + json.dumps(payload).encode() + b"\n\n")


@contextmanager
def serve(behaviour: Behaviour) -> Iterator[tuple[str, FakeServer]]:
    """Run the server in a thread; yields (base URL, server)."""
    server = FakeServer(behaviour)
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, object] = {}

    async def start() -> None:
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder["runner"] = runner
        holder["port"] = runner.addresses[0][1]
        ready.set()

    def main() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        loop.run_forever()
        loop.run_until_complete(holder["runner"].cleanup())  # type: ignore[attr-defined]
        loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(10), "fake server did not start"
    try:
        yield f"http://127.0.0.1:{holder['port']}", server
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
