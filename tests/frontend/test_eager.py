"""Eager start: a coroutine that never waits runs to its end with no task; one that waits is
carried on by a task from where it waits, with the values and cancellations it would have
seen in a task of its own."""

from __future__ import annotations

import asyncio
import contextvars

import pytest

from lockgate.frontend.eager import start_eagerly


def test_a_coroutine_that_never_waits_ends_on_the_callers_stack() -> None:
    async def main() -> None:
        done: list[str] = []

        async def inner() -> int:
            return 3

        async def handler() -> None:
            done.append(f"answered {await inner()}")

        loop = asyncio.get_running_loop()
        assert start_eagerly(loop, handler()) is None
        assert done == ["answered 3"]  # before any loop turn

        async def failing() -> None:
            raise ValueError("broken")

        with pytest.raises(ValueError, match="broken"):
            start_eagerly(loop, failing())

    asyncio.run(main())


def test_a_coroutine_that_waits_is_carried_on_by_a_task() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        first, second = loop.create_future(), loop.create_future()
        seen: list[object] = []

        async def handler() -> None:
            seen.append("started")
            seen.append(await first)
            await asyncio.sleep(0)  # a bare yield
            seen.append(await second)

        task = start_eagerly(loop, handler())
        assert task is not None and seen == ["started"]
        first.set_result("one")
        await asyncio.sleep(0.01)
        assert seen == ["started", "one"] and not task.done()
        second.set_result("two")
        await task
        assert seen == ["started", "one", "two"]

        failing = loop.create_future()

        async def raises() -> None:
            await failing

        task = start_eagerly(loop, raises())
        assert task is not None
        failing.set_exception(KeyError("gone"))
        with pytest.raises(KeyError):
            await task

    asyncio.run(main())


def test_cancelling_the_task_cancels_the_coroutine_where_it_waits() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        waited = loop.create_future()
        seen: list[str] = []

        async def handler() -> None:
            try:
                await waited
            except asyncio.CancelledError:
                seen.append("cancelled where it waited")
                raise
            finally:
                seen.append("finally")

        task = start_eagerly(loop, handler())
        assert task is not None
        await asyncio.sleep(0)
        task.cancel("client disconnected")
        with pytest.raises(asyncio.CancelledError):
            await task
        assert seen == ["cancelled where it waited", "finally"]
        assert waited.cancelled()  # the task cancelled what it waited on, as for any task

    asyncio.run(main())


CALLER: contextvars.ContextVar[str | None] = contextvars.ContextVar("caller", default=None)


def test_a_context_variable_set_before_the_wait_is_reset_after_it() -> None:
    """As a task runs its coroutine in one copy of the context: a variable set in the eager
    part can be reset in the task, and the caller's context never sees it."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        waited = loop.create_future()
        seen: list[str | None] = []

        async def handler() -> None:
            token = CALLER.set("request")
            try:
                await waited
                seen.append(CALLER.get())
            finally:
                CALLER.reset(token)  # a ValueError in another context
            seen.append(CALLER.get())

        task = start_eagerly(loop, handler())
        assert task is not None and CALLER.get() is None
        waited.set_result(None)
        await task
        assert seen == ["request", None]

    asyncio.run(main())
