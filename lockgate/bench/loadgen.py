"""Open-loop and closed-loop load over one aiohttp session, with client overhead measured.

Open loop: every request has a send time from a precomputed schedule and its latency counts
from that time, so the client never waits for the server before sending (no coordinated
omission). If the client itself falls behind, the lag is recorded per request.
Closed loop: C workers, each sends its next request when the previous one answers.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TextIO

import aiohttp

from lockgate.bench.arrivals import Schedule
from lockgate.bench.client import RequestRecord, send
from lockgate.bench.workload import Payload

LOOP_PROBE_INTERVAL_S = 0.005


@dataclass(frozen=True, slots=True)
class Level:
    """One load level: an offered rate (open loop) or a concurrency (closed loop)."""

    rate: float | None = None
    concurrency: int | None = None
    duration: float | None = None  # measured seconds, after warmup
    num_requests: int | None = None  # measured requests, after warmup
    warmup: float = 0.0

    @property
    def label(self) -> str:
        return (
            f"rate {self.rate:g}/s" if self.rate is not None else f"concurrency {self.concurrency}"
        )


@dataclass(slots=True)
class LevelResult:
    level: Level
    records: list[RequestRecord]
    wall_s: float  # the whole level, warmup included
    client_cpu_s: float  # this process's CPU time over the level
    loop_lag: list[float]  # event-loop overshoot of a periodic 5 ms sleep, seconds


@dataclass(slots=True)
class Tracker:
    """Live counters for the progress line."""

    total_s: float | None
    total_requests: int | None
    started: float = field(default_factory=time.perf_counter)
    completed: int = 0
    errors: int = 0

    def done(self, record: RequestRecord) -> None:
        if record.ok:
            self.completed += 1
        else:
            self.errors += 1

    def line(self, label: str) -> str:
        elapsed = time.perf_counter() - self.started
        total = f"/{self.total_s:.0f}s" if self.total_s else ""
        goal = f"/{self.total_requests}" if self.total_requests else ""
        rate = self.completed / elapsed if elapsed > 0 else 0.0
        return (
            f"[{label}] {elapsed:5.1f}s{total}  done {self.completed}{goal}  "
            f"errors {self.errors}  {rate:7.1f} req/s"
        )


async def run_level(
    session: aiohttp.ClientSession,
    url: str,
    payloads: list[Payload],
    level: Level,
    *,
    schedule: Schedule | None = None,
    stream: bool = False,
    progress: TextIO | None = sys.stderr,
) -> LevelResult:
    """Run one level to completion and return every request's record."""
    total_s = level.warmup + level.duration if level.duration is not None else None
    tracker = Tracker(total_s, level.num_requests)
    next_payload = itertools.cycle(payloads).__next__
    cpu0, wall0 = time.process_time(), time.perf_counter()
    loop_lag: list[float] = []
    probe = asyncio.create_task(_probe_loop(loop_lag))
    printer = asyncio.create_task(_print_progress(tracker, level.label, progress))
    try:
        if schedule is not None:
            records = await _open_loop(session, url, next_payload, schedule, stream, tracker)
        else:
            records = await _closed_loop(session, url, next_payload, level, stream, tracker)
    finally:
        probe.cancel()
        printer.cancel()
    if progress is not None:
        print("\r" + tracker.line(level.label), file=progress)
    return LevelResult(
        level, records, time.perf_counter() - wall0, time.process_time() - cpu0, loop_lag
    )


async def _open_loop(
    session: aiohttp.ClientSession,
    url: str,
    next_payload: Callable[[], Payload],
    schedule: Schedule,
    stream: bool,
    tracker: Tracker,
) -> list[RequestRecord]:
    start = time.perf_counter() + 0.005
    records: list[RequestRecord] = []
    pending: set[asyncio.Task[None]] = set()
    for index, offset in enumerate(schedule.offsets.tolist()):
        due = start + offset
        while (delay := due - time.perf_counter()) > 0:  # timers may fire a little early
            await asyncio.sleep(delay)
        record = RequestRecord(scheduled=due, warmup=index < schedule.warmup_count)
        records.append(record)
        task = asyncio.create_task(_tracked(session, url, next_payload(), record, stream, tracker))
        pending.add(task)
        task.add_done_callback(pending.discard)
    if pending:
        await asyncio.gather(*pending)
    return records


async def _closed_loop(
    session: aiohttp.ClientSession,
    url: str,
    next_payload: Callable[[], Payload],
    level: Level,
    stream: bool,
    tracker: Tracker,
) -> list[RequestRecord]:
    start = time.perf_counter()
    warm_until = start + level.warmup
    stop_at = warm_until + level.duration if level.duration is not None else math.inf
    budget = level.num_requests if level.num_requests is not None else math.inf
    records: list[RequestRecord] = []
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while (now := time.perf_counter()) < stop_at:
            warmup = now < warm_until
            if not warmup:
                if issued >= budget:
                    return
                issued += 1
            record = RequestRecord(scheduled=now, warmup=warmup)
            records.append(record)
            await _tracked(session, url, next_payload(), record, stream, tracker)

    await asyncio.gather(*(worker() for _ in range(level.concurrency or 1)))
    return records


async def _tracked(
    session: aiohttp.ClientSession,
    url: str,
    payload: Payload,
    record: RequestRecord,
    stream: bool,
    tracker: Tracker,
) -> None:
    await send(session, url, payload, record, stream)
    tracker.done(record)


async def _probe_loop(samples: list[float]) -> None:
    """Sleep 5 ms over and over; how late each wake-up comes is the event-loop lag."""
    while True:
        before = time.perf_counter()
        await asyncio.sleep(LOOP_PROBE_INTERVAL_S)
        samples.append(max(0.0, time.perf_counter() - before - LOOP_PROBE_INTERVAL_S))


async def _print_progress(tracker: Tracker, label: str, stream: TextIO | None) -> None:
    if stream is None:
        return
    while True:
        await asyncio.sleep(0.5)
        print("\r" + tracker.line(label), end="", file=stream, flush=True)


def connection_limit(level: Level) -> int:
    """Enough pooled connections that the pool never throttles the offered load."""
    if level.concurrency is not None:
        return level.concurrency
    return min(4096, max(64, math.ceil(level.rate or 0)))
