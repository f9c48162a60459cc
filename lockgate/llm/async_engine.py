"""`AsyncLLMEngine`: steps an `LLMEngine` on its own thread and streams each request's
outputs to asyncio consumers, batched into one loop callback per step."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass

from lockgate.errors import BackendError, ServingError, Unavailable
from lockgate.llm.engine import LLMEngine, RequestOutput
from lockgate.llm.sequence import FinishReason, SamplingParams

DRAIN_POLL_S = 0.02  # how often a drain looks for the last request to finish


@dataclass(slots=True)
class _Delivery:
    stream: RequestStream
    item: RequestOutput | ServingError


class RequestStream:
    """The outputs of one request as an async iterator. Closing it (or cancelling the task
    that awaits it) aborts the request and frees its KV blocks."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | ServingError] = asyncio.Queue()
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the consumer went away
            self._abort()
            raise
        if isinstance(item, ServingError):
            self._done = True
            raise item
        self._done = item.finished
        return item

    async def aclose(self) -> None:
        self._abort()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self._abort()

    def put(self, item: RequestOutput | ServingError) -> None:
        self._queue.put_nowait(item)

    def _abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)

    def __del__(self) -> None:
        if not self._done:
            self._engine.abort_later(self.request_id)


class AsyncLLMEngine:
    """Steps an `LLMEngine` on a dedicated thread that sleeps while there is no work."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        # weak: a stream dropped by its consumer is collected, and its finalizer aborts
        self._streams: dict[str, weakref.ref[RequestStream]] = {}
        self._pending_aborts: list[str] = []
        self._wakeup = threading.Condition()
        self._closing = False
        self._draining = False  # admitted requests finish; new ones are refused
        self._thread = threading.Thread(target=self._loop, name="lockgate-llm-engine", daemon=True)
        self._thread.start()

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        deadline: float | None = None,
        priority: int = 1,
    ) -> RequestStream:
        """Submit now (refusals raise here) and stream the outputs."""
        if self._closing or self._draining:
            raise Unavailable("the language model is draining", retry_after=1)
        loop = asyncio.get_running_loop()
        with self._wakeup:
            request_id = self.engine.add_request(
                prompt_token_ids, params, request_id, deadline, priority
            )
            stream = RequestStream(self, request_id, loop)
            self._streams[request_id] = weakref.ref(stream)
            self._wakeup.notify()
        return stream

    def abort(self, request_id: str) -> None:
        with self._wakeup:
            self._streams.pop(request_id, None)
        self.engine.abort(request_id)

    def abort_later(self, request_id: str) -> None:
        """Abort from a context that must not block (a finalizer); done on the engine thread."""
        self._pending_aborts.append(request_id)  # list.append is atomic

    async def drain(self, timeout: float) -> bool:
        """Refuse new requests and wait up to `timeout` s for the admitted ones to finish.
        True if they all did."""
        self._draining = True
        deadline = time.monotonic() + timeout
        while self._busy():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    def _busy(self) -> bool:
        with self._wakeup:
            return bool(self._streams) or self.engine.has_unfinished

    def close(self) -> None:
        """Stop the engine thread; streams still open get Unavailable."""
        with self._wakeup:
            self._closing = True
            self._wakeup.notify()
        self._thread.join()
        self._fail_all(Unavailable("the LLM engine shut down"))

    def _loop(self) -> None:
        while self._wait_for_work():
            while self._pending_aborts:
                self.abort(self._pending_aborts.pop())
            try:
                outputs = self.engine.step()
            except Exception as exc:  # the model raised: fail what was in flight, keep serving
                self._fail_all(BackendError(f"LLM engine step failed: {exc!r}"))
                continue
            self._deliver(outputs)

    def _wait_for_work(self) -> bool:
        with self._wakeup:
            while not (self._closing or self.engine.has_unfinished or self._pending_aborts):
                self._wakeup.wait()
            return not self._closing

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        deliveries, orphans = [], []
        with self._wakeup:
            for o in outputs:
                ref = (
                    self._streams.pop(o.request_id, None)
                    if o.finished
                    else self._streams.get(o.request_id)
                )
                stream = ref() if ref is not None else None
                if stream is not None:
                    item: RequestOutput | ServingError = o
                    if o.finish_reason is FinishReason.SHED:
                        item = Unavailable("shed for a request of higher priority", retry_after=1)
                    deliveries.append(_Delivery(stream, item))
                elif ref is not None:  # the consumer dropped its stream
                    orphans.append(o.request_id)
        for request_id in orphans:
            self.abort(request_id)
        _send(deliveries)

    def _fail_all(self, error: ServingError) -> None:
        with self._wakeup:
            refs, self._streams = list(self._streams.items()), {}
        for request_id, _ in refs:
            self.engine.abort(request_id)
        _send([_Delivery(stream, error) for _, ref in refs if (stream := ref()) is not None])


def _send(deliveries: list[_Delivery]) -> None:
    """Hand items to their streams: one call into each consumer loop."""
    by_loop: defaultdict[asyncio.AbstractEventLoop, list[_Delivery]] = defaultdict(list)
    for d in deliveries:
        by_loop[d.stream.loop].append(d)
    for loop, batch in by_loop.items():
        _call_soon(loop, batch)


def _call_soon(loop: asyncio.AbstractEventLoop, batch: list[_Delivery]) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
        loop.call_soon_threadsafe(_put_all, batch)


def _put_all(batch: list[_Delivery]) -> None:
    for d in batch:
        d.stream.put(d.item)
