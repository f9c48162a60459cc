from __future__ import annotations

import asyncio

import pytest

from lockgate.cache.single_flight import SingleFlight


def test_identical_calls_in_flight_run_once() -> None:
    asyncio.run(asyncio.wait_for(_test_identical_calls_in_flight_run_once(), 10))


async def _test_identical_calls_in_flight_run_once() -> None:
    flights: SingleFlight[int] = SingleFlight()
    runs = 0
    gate = asyncio.Event()

    async def work() -> int:
        nonlocal runs
        runs += 1
        await gate.wait()
        return 42

    calls = [asyncio.ensure_future(flights.run("k", work)) for _ in range(5)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*calls) == [42] * 5
    assert runs == 1 and flights.coalesced == 4 and len(flights) == 0


def test_a_waiter_that_leaves_does_not_cancel_the_work_for_the_others() -> None:
    asyncio.run(
        asyncio.wait_for(_test_a_waiter_that_leaves_does_not_cancel_the_work_for_the_others(), 10)
    )


async def _test_a_waiter_that_leaves_does_not_cancel_the_work_for_the_others() -> None:
    flights: SingleFlight[int] = SingleFlight()
    gate = asyncio.Event()

    async def work() -> int:
        await gate.wait()
        return 7

    first = asyncio.ensure_future(flights.run("k", work))
    second = asyncio.ensure_future(flights.run("k", work))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    gate.set()
    assert await second == 7
    with pytest.raises(asyncio.CancelledError):
        await first


def test_the_work_stops_when_every_caller_left() -> None:
    asyncio.run(asyncio.wait_for(_test_the_work_stops_when_every_caller_left(), 10))


async def _test_the_work_stops_when_every_caller_left() -> None:
    flights: SingleFlight[int] = SingleFlight()
    cancelled = asyncio.Event()

    async def work() -> int:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return 0

    call = asyncio.ensure_future(flights.run("k", work))
    await asyncio.sleep(0)
    call.cancel()
    await asyncio.wait_for(cancelled.wait(), 1)


def test_a_waiter_runs_its_own_work_when_the_shared_work_fails() -> None:
    asyncio.run(asyncio.wait_for(_test_a_waiter_runs_its_own_work_when_the_shared_work_fails(), 10))


async def _test_a_waiter_runs_its_own_work_when_the_shared_work_fails() -> None:
    flights: SingleFlight[str] = SingleFlight()
    gate = asyncio.Event()

    async def failing() -> str:
        await gate.wait()
        raise TimeoutError("the first caller's deadline")

    async def own() -> str:
        return "answered"

    first = asyncio.ensure_future(flights.run("k", failing))
    second = asyncio.ensure_future(flights.run("k", own))
    await asyncio.sleep(0)
    gate.set()
    with pytest.raises(TimeoutError):
        await first
    assert await second == "answered"
