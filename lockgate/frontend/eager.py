"""Eager start: run a coroutine now, on the caller's stack, and give it a task only if it waits.

A request the model answers inline (a cheap batch run on the event loop, `core/batcher.py`)
never waits: its handler decodes, runs, encodes and writes in one go. Run as a task, it
would cost the task, a loop turn for its first step and another for its done callback, more
than the handler itself on a small model. `start_eagerly` runs the coroutine's first step at
once; if it finishes there, no task is made. If it waits on a future, a task carries it on
from that point (`_Resumed`): the task waits on the same future, then goes on sending into
the coroutine, and a cancellation of the task is thrown into the coroutine where it waits,
as it would be into a task that had run it from the start.

(Python 3.12's `asyncio.eager_task_factory` does this for every task; this server runs on
3.11 too, and only the lane's requests want it.)
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Coroutine, Generator
from typing import Any


class _Resumed:
    """Awaitable: drives `coro`, started elsewhere and waiting on `awaited` (a future, or None
    for a bare yield), to its end."""

    __slots__ = ("awaited", "coro")

    def __init__(self, coro: Coroutine[Any, Any, None], awaited: Any) -> None:
        self.coro = coro
        self.awaited = awaited

    def __await__(self) -> Generator[Any, None, None]:
        coro, awaited = self.coro, self.awaited
        self.coro = self.awaited = None  # type: ignore[assignment]
        while True:
            try:
                yield awaited  # the task waits on it, as it would have for `coro`
            except GeneratorExit:
                coro.close()
                raise
            except BaseException as exc:  # a cancellation: into `coro`, where it waits
                try:
                    awaited = coro.throw(exc)
                except StopIteration:
                    return
                continue
            try:
                awaited = coro.send(None)
            except StopIteration:
                return


async def _carry_on(coro: Coroutine[Any, Any, None], awaited: Any) -> None:
    await _Resumed(coro, awaited)


def start_eagerly(
    loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, None]
) -> asyncio.Task[None] | None:
    """Run `coro` until it ends or waits: None when it ended (an exception it raised is
    raised here), else the task that carries it on. Every step runs in one copy of the
    caller's context, as a task's would: a context variable set before it waits is still
    set, and can be reset, after."""
    context = contextvars.copy_context()
    try:
        awaited = context.run(coro.send, None)
    except StopIteration:
        return None
    return loop.create_task(_carry_on(coro, awaited), context=context)
