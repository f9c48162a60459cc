"""A model instance and the thread that owns it.

Each instance runs its backend on one dedicated thread, so a model never sees two batches at
once and the event loop never blocks on compute. An instance whose batch runs past
`hang_timeout` is marked unhealthy, its batch is answered with an error, and it is replaced
by a freshly loaded backend. A reload that fails is tried again after `restart_backoff`
seconds, doubling up to `max_restart_backoff`, until it succeeds or the instance is closed;
meanwhile the instance stays unhealthy (a model with no healthy instance is not ready, and
its requests get 503 at once).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar, cast

from lockgate.backends.base import Answer, Arrays, Backend, BatchedRequest, RequestBackend
from lockgate.errors import Unavailable

T = TypeVar("T")

log = logging.getLogger("lockgate.runner")


def instance_thread(name: str) -> ThreadPoolExecutor:
    """The one thread an instance's backend is loaded, warmed up and run on. One thread
    for all three: torch's OpenMP runtime keeps a team of worker threads for each thread
    that runs parallel work, and while it manages more threads than there are CPUs, their
    workers sleep between ops instead of spinning (a model loaded on one thread and run on
    another ran 1.8 times slower on two cores)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"lockgate-{name}")


class Instance:
    def __init__(
        self,
        name: str,
        backend: Backend,
        *,
        hang_timeout: float | None = None,
        reload: Callable[[], Backend] | None = None,
        on_replaced: Callable[[Instance], None] | None = None,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self.name = name
        self.backend = backend
        self.hang_timeout = hang_timeout
        self.reload = reload
        self.on_replaced = on_replaced
        self.healthy = True
        # Native runtimes (onnxruntime, scikit-learn) may run tiny batches on the event loop.
        self.inline_safe = bool(getattr(backend, "inline_safe", False))
        # A Triton Python model takes a batch as its requests (`RequestBackend`), unmerged.
        self.per_request = bool(getattr(backend, "per_request", False))
        self.restarts = 0
        self.last_seconds = 0.0
        self.last_finished = 0.0  # time.monotonic() at the end of the last batch
        self._restarting: asyncio.Task[None] | None = None
        self.closed = False
        self.restart_backoff = 0.5  # seconds before the first retry of a failed reload
        self.max_restart_backoff = 30.0
        self.executor = executor or instance_thread(name)

    def infer_sync(self, inputs: Arrays) -> Arrays:
        """Run a batch on the calling thread; `last_seconds` is its compute time."""
        start = time.perf_counter()
        outputs = self.backend.infer(inputs)
        self.last_seconds = time.perf_counter() - start
        self.last_finished = time.monotonic()
        return outputs

    def infer_requests_sync(self, requests: Sequence[BatchedRequest]) -> list[Answer]:
        """Run a batch given as its requests (a `RequestBackend`) on the calling thread."""
        start = time.perf_counter()
        answers = cast(RequestBackend, self.backend).infer_requests(requests)
        self.last_seconds = time.perf_counter() - start
        self.last_finished = time.monotonic()
        return answers

    async def infer(self, inputs: Arrays) -> Arrays:
        """Run a batch on the instance's thread. `last_seconds` is timed on that thread, so
        it holds the model's time alone, not the handoff between threads."""
        loop = asyncio.get_running_loop()
        return await self._answered(loop.run_in_executor(self.executor, self.infer_sync, inputs))

    async def infer_requests(self, requests: Sequence[BatchedRequest]) -> list[Answer]:
        """Run a batch given as its requests on the instance's thread: one answer each."""
        loop = asyncio.get_running_loop()
        call = self.infer_requests_sync
        return await self._answered(loop.run_in_executor(self.executor, call, requests))

    async def _answered(self, work: asyncio.Future[T]) -> T:
        """What the instance's thread returns, or Unavailable past `hang_timeout`."""
        if self.hang_timeout is None:
            return await work
        try:
            return await asyncio.wait_for(asyncio.shield(work), self.hang_timeout)
        except TimeoutError:
            self._hung()
            raise Unavailable(
                f"model instance {self.name} did not answer within {self.hang_timeout:.1f} s "
                "and is being restarted",
                retry_after=1,
            ) from None

    def _hung(self) -> None:
        log.error("instance %s hung past %.1f s; restarting it", self.name, self.hang_timeout)
        self.healthy = False
        stuck = self.executor
        stuck.shutdown(wait=False, cancel_futures=True)
        if self.reload is None:
            return
        self._restarting = asyncio.get_running_loop().create_task(self._restart())

    async def _restart(self) -> None:
        assert self.reload is not None
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        delay = self.restart_backoff
        while not self.closed:
            fresh_executor = instance_thread(self.name)
            try:
                backend = await loop.run_in_executor(fresh_executor, self.reload)
            except Exception as exc:
                fresh_executor.shutdown(wait=False)
                log.error(
                    "restart of instance %s failed (%r); again in %.1f s", self.name, exc, delay
                )
                await asyncio.sleep(delay)
                delay = min(2 * delay, self.max_restart_backoff)
                continue
            self.backend = backend
            self.executor = fresh_executor
            self.healthy = True
            self.restarts += 1
            log.info("instance %s restarted in %.2f s", self.name, time.monotonic() - start)
            if self.on_replaced is not None:
                self.on_replaced(self)
            return

    def close(self) -> None:
        self.closed = True
        if self._restarting is not None:
            self._restarting.cancel()
        self.executor.shutdown(wait=False, cancel_futures=True)
        try:
            self.backend.close()
        except Exception as exc:
            log.warning("closing instance %s: %r", self.name, exc)
