"""The request view's disconnect and body reading, at the ASGI level: with lockgate's protocol
a disconnect is told, not watched by a task, and a body that is all in is read without a
timer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from lockgate.frontend.http import (
    ClientDisconnected,
    Disconnect,
    HttpRequest,
    Message,
    cancel_on_disconnect,
)


def request_with(scope: dict[str, Any], messages: list[Message]) -> HttpRequest:
    async def receive() -> Message:
        if messages:
            return messages.pop(0)
        await asyncio.sleep(3600)  # nothing more until the test ends
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        pass

    return HttpRequest(scope, receive, send, "POST", "/", max_body=1024)


def test_a_told_disconnect_cancels_the_block_without_a_watcher_task() -> None:
    async def main() -> tuple[int, int]:
        disconnect = Disconnect()
        request = request_with({"lockgate.disconnect": disconnect}, [])
        before = len(asyncio.all_tasks())
        asyncio.get_running_loop().call_later(0.01, disconnect.close)
        with pytest.raises(ClientDisconnected):
            async with cancel_on_disconnect(request):
                during = len(asyncio.all_tasks())
                await asyncio.sleep(10)
        return before, during

    before, during = asyncio.run(main())
    assert during == before  # no task of its own


def test_a_closed_connection_refuses_the_block_and_a_finished_block_is_not_cancelled() -> None:
    async def main() -> None:
        disconnect = Disconnect()
        request = request_with({"lockgate.disconnect": disconnect}, [])
        async with cancel_on_disconnect(request):
            await asyncio.sleep(0)
        disconnect.close()  # after the block: nothing to cancel
        await asyncio.sleep(0.01)
        with pytest.raises(ClientDisconnected):
            async with cancel_on_disconnect(request):
                pass

    asyncio.run(main())


def test_without_the_protocol_a_watcher_reads_the_disconnect() -> None:
    async def main() -> None:
        request = request_with({}, [{"type": "http.disconnect"}])
        with pytest.raises(ClientDisconnected):
            async with cancel_on_disconnect(request):
                await asyncio.sleep(10)

    asyncio.run(main())


def test_a_complete_body_is_read_and_an_incomplete_one_times_out() -> None:
    async def main() -> None:
        parts: list[Message] = [
            {"type": "http.request", "body": b"ab", "more_body": True},
            {"type": "http.request", "body": b"c", "more_body": False},
        ]
        complete = request_with({"headers": [], "lockgate.body_complete": True}, list(parts))
        assert await complete.body() == b"abc"
        stalled = request_with({"headers": []}, parts[:1])
        stalled.body_timeout = 0.05
        with pytest.raises(Exception, match="not received within"):
            await stalled.body()

    asyncio.run(main())
