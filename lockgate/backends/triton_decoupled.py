"""A decoupled Triton Python model: each request answered by a stream of responses.

    class TritonPythonModel:
        def execute(self, requests):
            for request in requests:
                sender = request.get_response_sender()
                for i in range(count):                      # zero or more responses
                    sender.send(pb_utils.InferenceResponse([...]))
                sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return None

`model_transaction_policy { decoupled: true }` in its config serves a `model.py` this way,
as Triton does, outside the dynamic batcher: each request is one `execute` call, on a thread
of the model's own (at most `instance_count` at once, as Triton runs one per instance), or on
the event loop for an `async def execute`. A model may keep a request's sender and send
from threads of its own after `execute` has returned.

- Each response sent goes at once to the request's `ResponseStream`, in order; at most
  `max_buffered_responses` wait for a slow client, past which a sending thread waits, and
  an async `execute` waits at its next `await` (`Paced`).
- An `InferenceResponse(error=...)` is an error response on the stream (its status as in
  `TritonPythonBackend.error_of`); an exception from `execute` ends the request with it.
- A request whose client has gone is cancelled: `is_cancelled()` turns True, and what is
  sent afterwards is dropped. A sender dropped without the final flag ends its stream.
- At most `instance_count + max_queue_size` requests wait or run; past that, 503.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
import weakref
from collections.abc import Coroutine, Generator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lockgate.backends import pb_utils
from lockgate.backends.base import InferContext
from lockgate.backends.response_stream import ResponseStream, StreamedResponse, StreamRequest
from lockgate.backends.triton_python import TritonPythonBackend
from lockgate.config import ModelConfig
from lockgate.errors import BackendError, DeadlineExceeded, ServingError, Unavailable


class TritonPythonDecoupled:
    """A `StreamingService`: opens a stream per request and runs its `execute`."""

    def __init__(self, backend: TritonPythonBackend, config: ModelConfig) -> None:
        self._backend = backend
        self._model = config.name
        self._async = inspect.iscoroutinefunction(backend.instance.execute)
        self._pool = ThreadPoolExecutor(config.instance_count, thread_name_prefix="triton-stream")
        self._limit = config.max_buffered_responses
        self._max_waiting = config.instance_count + config.batcher.max_queue_size
        self._executing: set[asyncio.Future[None]] = set()  # admitted, execute not returned
        self._streams: weakref.WeakSet[ResponseStream] = weakref.WeakSet()
        self._closing = False

    def open(self, request: StreamRequest, ctx: InferContext) -> ResponseStream:
        """Start `execute` on `request`; its responses arrive on the stream returned."""
        if self._closing:
            raise Unavailable(f"model '{self._model}' is unloading", retry_after=1)
        if len(self._executing) >= self._max_waiting:
            raise Unavailable(
                f"model '{self._model}': {len(self._executing)} requests wait or run",
                retry_after=1,
            )
        loop = asyncio.get_running_loop()
        stream = ResponseStream(loop, self._limit)
        triton = self._backend.request(request.inputs, request.id, request.parameters)
        pb_utils.attach_responses(triton, stream, self._streamed, self._model)
        caller = pb_utils.Caller(loop, ctx)
        if self._async:
            done: asyncio.Future[None] = loop.create_task(
                self._execute_async(triton, stream, request.deadline, caller)
            )
        else:
            context = contextvars.copy_context()  # the thread sees the caller, for exec()
            context.run(pb_utils.CALLER.set, caller)
            done = loop.run_in_executor(
                self._pool, context.run, self._execute, triton, stream, request.deadline
            )
        del triton  # the model's now: the stream ends when its last holder drops it
        self._executing.add(done)
        done.add_done_callback(self._executing.discard)
        self._streams.add(stream)
        return stream

    def _execute(
        self, request: pb_utils.InferenceRequest, stream: ResponseStream, deadline: float | None
    ) -> None:
        """On a thread of the model's own."""
        if not self._startable(stream, deadline):
            return
        try:
            returned = self._backend.execute([request])
        except ServingError as exc:
            stream.end(exc)
            return
        self._returned(returned, stream)

    async def _execute_async(
        self,
        request: pb_utils.InferenceRequest,
        stream: ResponseStream,
        deadline: float | None,
        caller: pb_utils.Caller,
    ) -> None:
        if not self._startable(stream, deadline):
            return
        token = pb_utils.CALLER.set(caller)
        try:
            returned = await Paced(self._backend.execute_async([request]), stream)
        except ServingError as exc:
            stream.end(exc)
            return
        finally:
            pb_utils.CALLER.reset(token)
        self._returned(returned, stream)

    def _startable(self, stream: ResponseStream, deadline: float | None) -> bool:
        """Whether a request that waited for the model is still worth executing."""
        if stream.cancelled:
            return False  # its client has gone
        if deadline is not None and time.monotonic() >= deadline:
            stream.end(DeadlineExceeded(f"model '{self._model}': the request's deadline passed"))
            return False
        return True

    def _returned(self, returned: Any, stream: ResponseStream) -> None:
        if returned is not None:  # as Triton: a decoupled execute answers through senders
            kind = type(returned).__name__
            stream.end(
                BackendError(
                    f"model '{self._model}': execute() of a decoupled model returned a {kind}: "
                    "return None, and send responses with request.get_response_sender()"
                )
            )

    def _streamed(self, response: pb_utils.InferenceResponse, final: bool) -> StreamedResponse:
        """A response the model sent, as the stream carries it."""
        error = response.error()
        if error is not None:
            return StreamedResponse(error=self._backend.error_of(error), final=final)
        try:
            return StreamedResponse(self._backend.tensors_of(response), final=final)
        except BackendError as exc:
            return StreamedResponse(error=exc, final=final)

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests; wait up to `timeout` s for the admitted ones' `execute`."""
        self._closing = True
        if not self._executing:
            return True
        _, pending = await asyncio.wait(set(self._executing), timeout=timeout)
        return not pending

    def close(self) -> None:
        """Cancel the streams still open (their senders wake and drop what they send), then
        finalize the model."""
        self._closing = True
        for stream in list(self._streams):
            stream.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._backend.close()


class Paced:
    """An async `execute`, resumed only while its request's stream has room. A send from the
    event loop cannot wait for a slow client, so the coroutine waits instead: at each of its
    `await`s, once what it awaited is done, it goes on only when fewer than
    `max_buffered_responses` of its responses wait. Everything else passes through, as
    `await coroutine` would: what it yields to the event loop, and cancellation."""

    __slots__ = ("_coro", "_stream")

    def __init__(self, coro: Coroutine[Any, Any, Any], stream: ResponseStream) -> None:
        self._coro = coro
        self._stream = stream

    def __await__(self) -> Generator[Any, Any, Any]:
        coro, stream = self._coro, self._stream
        sent: Any = None
        error: BaseException | None = None
        while True:
            try:
                yielded = coro.send(sent) if error is None else coro.throw(error)
            except StopIteration as returned:
                return returned.value
            sent, error = None, None
            try:
                sent = yield yielded  # to the task: a future the coroutine awaits, or None
                while stream.full:
                    yield from stream.room().__await__()
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # cancelled: raised where the coroutine awaits
                error = exc
