"""Request coalescing: identical requests in flight at the same time run once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    """`run(key, work)` starts `work` unless a call with the same key is in flight; then it
    waits for that call's answer instead.

    A waiter that leaves (cancelled, or out of time) leaves the work running for the others;
    the work is cancelled only when every caller has left. When the shared work fails, a
    waiter runs its own `work`: the failure may be the first caller's alone (its deadline, a
    refusal of its priority), and no request is lost to another's failure.
    """

    def __init__(self) -> None:
        self._flights: dict[str, _Flight[T]] = {}
        self.coalesced = 0  # calls answered by another call's work

    def __len__(self) -> int:
        return len(self._flights)

    async def run(self, key: str, work: Callable[[], Awaitable[T]]) -> T:
        flight = self._flights.get(key)
        if flight is not None:
            try:
                result = await self._wait(flight)
            except Exception:
                pass  # the first caller's failure: run our own below
            else:
                self.coalesced += 1
                return result
        return await self._lead(key, work)

    async def _lead(self, key: str, work: Callable[[], Awaitable[T]]) -> T:
        flight = _Flight(asyncio.ensure_future(work()))
        self._flights[key] = flight
        flight.task.add_done_callback(lambda _: self._land(key, flight))
        return await self._wait(flight)

    async def _wait(self, flight: _Flight[T]) -> T:
        flight.waiters += 1
        try:
            return await asyncio.shield(flight.task)
        finally:
            flight.waiters -= 1
            if flight.waiters == 0 and not flight.task.done():
                flight.task.cancel()

    def _land(self, key: str, flight: _Flight[T]) -> None:
        if self._flights.get(key) is flight:
            del self._flights[key]
        if not flight.task.cancelled():
            flight.task.exception()  # retrieved: no "never retrieved" warning when all left


class _Flight(Generic[T]):
    __slots__ = ("task", "waiters")

    def __init__(self, task: asyncio.Future[T]) -> None:
        self.task = task
        self.waiters = 0
