"""When to send a second copy of a request: after the `quantile` of the model's recent
latencies (the 95th by default), once enough answers have been seen."""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Latencies:
    """The last `size` latencies of a model; the quantile is taken again after every
    `refresh` new ones (a sort of `size` values: a share of a microsecond per request)."""

    size: int = 512
    refresh: int = 64
    values: deque[float] = field(default_factory=deque)
    cached: float | None = None  # the quantile, until the next refresh
    since: int = 0

    def add(self, seconds: float) -> None:
        self.values.append(seconds)
        if len(self.values) > self.size:
            self.values.popleft()
        self.since += 1

    def quantile(self, q: float) -> float | None:
        if len(self.values) < 20:
            return None
        if self.cached is None or self.since >= self.refresh:
            ordered = sorted(self.values)
            self.cached = ordered[min(len(ordered) - 1, int(q * len(ordered)))]
            self.since = 0
        return self.cached


@dataclass(slots=True)
class HedgePolicy:
    enabled: bool = True
    quantile: float = 0.95
    min_delay: float = 0.002  # never hedge sooner than this (seconds)
    fixed_delay: float | None = None  # a fixed delay instead of the quantile
    models: dict[str, Latencies] = field(default_factory=dict)

    def observe(self, model: str, seconds: float) -> None:
        window = self.models.get(model)
        if window is None:
            window = self.models[model] = Latencies()
        window.add(seconds)

    def delay(self, model: str) -> float | None:
        """Seconds to wait before the second copy; None: do not hedge (yet)."""
        if not self.enabled:
            return None
        if self.fixed_delay is not None:
            return self.fixed_delay
        window = self.models.get(model)
        q = window.quantile(self.quantile) if window is not None else None
        return None if q is None else max(self.min_delay, q)


async def finished_within(task: asyncio.Future[Any], delay: float) -> bool:
    """Whether `task` is done within `delay` seconds (it runs on either way): what
    `asyncio.wait({task}, timeout=delay)` tells, with one future and one timer, as every
    hedged request asks it."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    task.add_done_callback(wake)
    timer = loop.call_later(delay, wake)
    try:
        await waiter
    finally:
        timer.cancel()
        task.remove_done_callback(wake)
    return task.done()
