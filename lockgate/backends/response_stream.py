"""The responses of one request to a model that answers with a stream (a decoupled model).

A model sends responses from its own threads, or from the event loop; one task on the loop
(the frontend's) takes them in order and writes them to the client. Between the two, at most
`limit` responses wait: a thread that sends past that waits for the client to catch up, so
a client that reads slowly holds the model back instead of filling memory. A send from the
event loop itself cannot wait: it is taken, and the model's coroutine waits for `room()`
at its next `await` instead (`backends/triton_decoupled.py`).

When the client goes away the stream is cancelled: waiting responses are dropped, senders
waiting for room wake, and later sends are dropped without an error (`cancelled` tells the
model to stop). The stream ends with its final response, which a sender always marks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from lockgate.backends.base import InferContext
from lockgate.datatypes import Arrays
from lockgate.errors import ServingError


@dataclass(frozen=True, slots=True)
class StreamedResponse:
    """One response of a stream: outputs, or an error, or neither (the final flag alone)."""

    outputs: Arrays | None = None
    error: ServingError | None = None
    final: bool = False  # no response follows

    @property
    def empty(self) -> bool:
        return self.outputs is None and self.error is None


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """What a streaming model gets of a request: its inputs, its id, its parameters as the
    client sent them, and its deadline (time.monotonic() seconds; a request still waiting
    for the model then is refused)."""

    inputs: Arrays
    id: str = ""
    deadline: float | None = None
    parameters: Mapping[str, object] = field(default_factory=dict)


class ResponseStream:
    """A bounded channel of `StreamedResponse`s from a model's senders to one reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop, limit: int) -> None:
        self._loop = loop
        self.limit = limit
        self._items: deque[StreamedResponse] = deque()
        self._lock = threading.Condition()
        self._waiter: asyncio.Future[None] | None = None  # the reader's
        self._room: asyncio.Future[None] | None = None  # a coroutine's waiting for room
        self._ended = False  # the final response is in
        self.cancelled = False

    @property
    def ended(self) -> bool:
        return self._ended or self.cancelled

    @property
    def full(self) -> bool:
        """`limit` responses (or more, sent from the loop) wait for the client."""
        return not self.ended and len(self._items) >= self.limit

    # -- senders (any thread) -----------------------------------------------------------
    def send(self, response: StreamedResponse) -> bool:
        """Queue a response; from a thread, wait for room while `limit` responses wait (on
        the loop it cannot: see `room`). False: dropped, the stream was cancelled or has
        ended."""
        on_loop = _running_loop() is self._loop
        with self._lock:
            while not on_loop and self._full(response) and not self.ended:
                self._lock.wait()
            if self.ended:
                return False
            self._items.append(response)
            self._ended = response.final
        self._notify(on_loop)
        return True

    def _full(self, response: StreamedResponse) -> bool:
        # the final response is always taken: a stream can end whatever the client reads
        return not response.final and len(self._items) >= self.limit

    def end(self, error: ServingError | None = None) -> None:
        """End the stream if no final response came: with `error`, or the final flag alone."""
        if not self.ended:
            self.send(StreamedResponse(error=error, final=True))

    async def room(self) -> None:
        """On the loop: wait until fewer than `limit` responses wait, or the stream ended."""
        while self.full:
            waiter = self._room = self._loop.create_future()
            try:
                await waiter
            finally:
                self._room = None

    # -- the reader (the event loop) ----------------------------------------------------
    def cancel(self) -> None:
        """The client went away: drop what waits, and wake every sender waiting for room."""
        with self._lock:
            self.cancelled = True
            self._items.clear()
            self._lock.notify_all()
        self._notify(_running_loop() is self._loop)

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> StreamedResponse:
        while True:
            with self._lock:
                if self._items:
                    response = self._items.popleft()
                    self._lock.notify()  # room for a waiting sender
                    _wake(self._room)  # (it checks whether there is room enough)
                    return response
                if self.ended:
                    raise StopAsyncIteration
                waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def _notify(self, on_loop: bool) -> None:
        """Wake the reader, on the loop's own thread."""
        if on_loop:
            self._wake()
            return
        with contextlib.suppress(RuntimeError):  # a closed loop has no reader left to wake
            self._loop.call_soon_threadsafe(self._wake)

    def _wake(self) -> None:
        _wake(self._waiter)
        _wake(self._room)  # the stream may have ended


@runtime_checkable
class StreamingService(Protocol):
    """A model that answers each request with a stream of responses (Triton's decoupled
    models), outside the batcher. The model manager drains and closes it as a
    `ModelService`; the executor opens a stream per request."""

    def open(self, request: StreamRequest, ctx: InferContext) -> ResponseStream:
        """Start answering `request` (on the running loop); `ctx` is the request's
        `InferContext`, for a model that calls others."""
        ...

    async def drain(self, timeout: float) -> bool: ...

    def close(self) -> None: ...


def _wake(waiter: asyncio.Future[None] | None) -> None:
    if waiter is not None and not waiter.done():
        waiter.set_result(None)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
