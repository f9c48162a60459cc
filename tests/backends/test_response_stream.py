"""The bounded channel between a decoupled model's senders and the task that writes to the
client: order, the bound (a sending thread waits; a coroutine waits for room), cancellation
(senders wake, later sends are dropped), and the final response."""

from __future__ import annotations

import asyncio
import threading

import numpy as np

from lockgate.backends.response_stream import ResponseStream, StreamedResponse
from lockgate.errors import BadRequest


def item(value: int, final: bool = False) -> StreamedResponse:
    return StreamedResponse({"OUT": np.array([value])}, final=final)


def values(responses: list[StreamedResponse]) -> list[int]:
    return [int(r.outputs["OUT"][0]) for r in responses if r.outputs is not None]


def test_a_thread_waits_at_the_bound_until_the_reader_takes_a_response() -> None:
    async def main() -> None:
        stream = ResponseStream(asyncio.get_running_loop(), limit=3)
        sent: list[int] = []

        def sender() -> None:
            for value in range(6):
                stream.send(item(value))
                sent.append(value)
            stream.end()

        thread = threading.Thread(target=sender)
        thread.start()
        await asyncio.sleep(0.2)
        assert sent == [0, 1, 2]  # the fourth send waits for room
        taken = [await anext(stream)]
        await asyncio.sleep(0.1)
        assert sent == [0, 1, 2, 3]  # one taken, one more in
        taken += [response async for response in stream]
        thread.join(5)
        assert values(taken) == [0, 1, 2, 3, 4, 5]
        assert taken[-1].final and taken[-1].empty

    asyncio.run(main())


def test_cancel_wakes_a_waiting_sender_and_drops_what_comes_after() -> None:
    async def main() -> None:
        stream = ResponseStream(asyncio.get_running_loop(), limit=1)
        results: list[bool] = []
        thread = threading.Thread(
            target=lambda: results.extend(stream.send(item(i)) for i in (0, 1, 2))
        )
        thread.start()
        await asyncio.sleep(0.1)
        stream.cancel()
        thread.join(5)
        assert not thread.is_alive()
        assert results == [True, False, False]  # dropped, without an error
        assert [r async for r in stream] == []  # the waiting response went too

    asyncio.run(main())


def test_the_final_response_ends_the_stream_whatever_the_bound() -> None:
    async def main() -> None:
        stream = ResponseStream(asyncio.get_running_loop(), limit=1)
        stream.send(item(1))
        stream.send(item(2))  # on the loop a send cannot wait: taken past the bound
        assert stream.full
        stream.send(StreamedResponse(error=BadRequest("no"), final=True))
        assert not stream.send(item(3))  # after the final one: dropped
        stream.end()  # a no-op once ended
        taken = [r async for r in stream]
        assert values(taken) == [1, 2]
        assert taken[2].final and isinstance(taken[2].error, BadRequest)

    asyncio.run(main())


def test_a_coroutine_waits_for_room_until_the_reader_takes_enough() -> None:
    async def main() -> None:
        stream = ResponseStream(asyncio.get_running_loop(), limit=2)
        for value in range(3):
            stream.send(item(value))
        room = asyncio.ensure_future(stream.room())
        await asyncio.sleep(0.01)
        assert not room.done()
        await anext(stream)  # 2 wait: still the bound
        await asyncio.sleep(0.01)
        assert not room.done()
        await anext(stream)
        await asyncio.wait_for(room, 1)
        stream.send(item(3))
        stream.send(item(4))
        room = asyncio.ensure_future(stream.room())
        stream.cancel()  # a cancelled stream has room: nothing more is kept
        await asyncio.wait_for(room, 1)

    asyncio.run(main())
