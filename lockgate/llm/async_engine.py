"""`AsyncLLMEngine`: steps an `LLMEngine` on its own thread and streams each request's
outputs to asyncio consumers, batched into one loop callback per step.

A request may hold several sequences of one prompt (the `n` choices of an OpenAI request):
they are submitted together, all or none, stream through one `RequestStream`, and are aborted
together."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from lockgate.errors import BackendError, ServingError, Unavailable
from lockgate.llm.engine import LLMEngine, RequestOutput
from lockgate.llm.openmp import release_workers
from lockgate.llm.sequence import FinishReason, SamplingParams

DRAIN_POLL_S = 0.02  # how often a drain looks for the last request to finish


@dataclass(slots=True)
class _Delivery:
    stream: RequestStream
    item: RequestOutput | ServingError


class RequestStream:
    """The outputs of one request's sequences as an async iterator, in the order the engine
    makes them. It ends when every sequence has finished; an error on any of them ends it for
    all. Closing it (or cancelling the task that awaits it) aborts every sequence not yet
    finished and frees its KV blocks."""

    def __init__(
        self, engine: AsyncLLMEngine, request_ids: list[str], loop: asyncio.AbstractEventLoop
    ) -> None:
        self.request_ids = tuple(request_ids)
        self.loop = loop
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | ServingError] = asyncio.Queue()
        self._indexes = {rid: i for i, rid in enumerate(request_ids)}
        self._unfinished = dict.fromkeys(request_ids)  # ordered set

    @property
    def request_id(self) -> str:
        return self.request_ids[0]

    def index(self, request_id: str) -> int:
        """The position of a sequence among the request's (its choice)."""
        return self._indexes[request_id]

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:  # cancelled: the consumer went away
            self._abort()
            raise
        if isinstance(item, ServingError):
            self._abort()  # the others of the request go with it
            raise item
        if item.finished:
            self._unfinished.pop(item.request_id, None)
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
        unfinished, self._unfinished = list(self._unfinished), {}
        for request_id in unfinished:
            self._engine.abort(request_id)

    def __del__(self) -> None:
        for request_id in self._unfinished:
            self._engine.abort_later(request_id)


class AsyncLLMEngine:
    """Steps an `LLMEngine` on a dedicated thread that sleeps while there is no work.

    `build` makes that thread build the engine too (load, warm up), so the model's tensors
    are only ever computed on it. torch's OpenMP runtime (libgomp) keeps a team of worker
    threads for each thread that has run parallel work, and while it manages more threads
    than there are CPUs, a team's workers sleep between parallel regions instead of
    spinning: each of the thousands of ops in a step then waits to wake them. A model loaded
    on one thread and stepped on another leaves two teams; on two cores its decode step took
    1.8 times as long (SmolLM2, batch 1: 32 against 18 ms). For the same reason an engine
    that runs out of work hands its team back (`llm/openmp.py`), so that in a process serving
    several language models only the engines at work have one."""

    engine: LLMEngine

    def __init__(self, engine: LLMEngine) -> None:
        self._start(lambda: engine)

    @classmethod
    def build(cls, factory: Callable[[], LLMEngine]) -> AsyncLLMEngine:
        """Build the engine on the thread that will step it, and return once it is built;
        the factory's error raises here (and the thread ends)."""
        self = cls.__new__(cls)
        self._start(factory)
        return self

    def _start(self, factory: Callable[[], LLMEngine]) -> None:
        # weak: a stream dropped by its consumer is collected, and its finalizer aborts
        self._streams: dict[str, weakref.ref[RequestStream]] = {}
        self._pending_aborts: list[str] = []
        self._wakeup = threading.Condition()
        self._closing = False
        self._draining = False  # admitted requests finish; new ones are refused
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self._thread = threading.Thread(
            target=self._run, args=(factory,), name="lockgate-llm-engine", daemon=True
        )
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    @property
    def draining(self) -> bool:
        """New requests are refused: the engine drains or closes."""
        return self._closing or self._draining

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        deadline: float | None = None,
        priority: int = 1,
    ) -> RequestStream:
        """Submit now (refusals raise here) and stream the outputs."""
        return self.generate_choices([prompt_token_ids], [params], [request_id], deadline, priority)

    def generate_choices(
        self,
        prompts: list[list[int]],
        params: list[SamplingParams],
        request_ids: list[str | None],
        deadline: float | None = None,
        priority: int = 1,
    ) -> RequestStream:
        """Submit one sequence per `params`, of the prompt at the same place in `prompts`,
        all or none, and stream the outputs of all. Each is admitted behind the ones submitted
        before it, so admission counts the work of them all: when it refuses one, those before
        it are withdrawn and the refusal raises here."""
        if self._closing or self._draining:
            raise Unavailable("the language model is draining", retry_after=1)
        loop = asyncio.get_running_loop()
        added: list[str] = []
        with self._wakeup:
            try:
                for prompt, choice, request_id in zip(prompts, params, request_ids, strict=True):
                    added.append(
                        self.engine.add_request(prompt, choice, request_id, deadline, priority)
                    )
            except BaseException:
                for request_id in added:
                    self.engine.abort(request_id)
                raise
            stream = RequestStream(self, added, loop)
            ref = weakref.ref(stream)
            for request_id in added:
                self._streams[request_id] = ref
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

    def _run(self, factory: Callable[[], LLMEngine]) -> None:
        try:
            self.engine = factory()
        except BaseException as exc:  # handed to the thread that waits in _start
            self._build_error = exc
            return
        finally:
            self._built.set()
        self._loop()

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
        if not self._has_work():
            release_workers()  # idle: its OpenMP team must not slow another engine's
        with self._wakeup:
            while not self._has_work():
                self._wakeup.wait()
            return not self._closing

    def _has_work(self) -> bool:
        return self._closing or self.engine.has_unfinished or bool(self._pending_aborts)

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
        streams = {stream: None for _, ref in refs if (stream := ref()) is not None}  # once each
        _send([_Delivery(stream, error) for stream in streams])


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
