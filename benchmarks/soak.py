"""soak: ten minutes at 60% of capacity, watching for errors, latency drift and memory growth.

The digits ONNX demo model (LogisticRegression, 64 features, one row per request, V2 JSON)
served by one lockgate process on the server core:

1. Capacity: a closed loop (32 workers) against the same server, after a warm-up.
2. Soak: open-loop Poisson arrivals at 60% of that capacity for 10 minutes (60 s with
   `--quick`). Latency counts from the *scheduled* send time. Every request must be answered
   (sent == answered); anything but a 200 counts as an error.
3. Memory: the server's resident set (VmRSS in /proc/<pid>/status) every 10 s. Growth is
   measured from the end of the first minute (allocators and caches have warmed up by then)
   to the end of the run. The client keeps a fixed pool of `CONNECTIONS` keep-alive
   connections, all opened before the soak, as a proxy in front of a server would: each
   open connection holds server memory, so a client that opened new connections whenever
   the machine stalled would show the high-water mark of its own concurrency as growth.
   The server's open sockets are sampled with its RSS to show the pool stayed fixed.
4. Cross-check: `lockgate_requests_total{outcome}` scraped before and after the soak; the
   server's success count must equal the client's 200s.

p50/p99 are reported per minute (per 10 s in quick mode) so that drift shows up, with the
1-minute load average of the machine next to each, because the machine is shared.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from benchmarks.common import (
    Context,
    Server,
    SuiteResult,
    Target,
    closed_loop,
    environment,
    percentile,
    run_async,
    running,
    scrape_metrics,
    start_lockgate,
    v2_body,
)
from benchmarks.serving_overhead import demo_model, digits_rows

SUITE = "soak"
MODEL = "digits_onnx"
LOAD_FRACTION = 0.6  # offered rate / measured capacity
SECONDS, QUICK_SECONDS = 600.0, 60.0
BUCKET_S, QUICK_BUCKET_S = 60.0, 10.0  # the latency table's time step
RSS_EVERY_S = 10.0
RSS_GROWTH_TARGET = 0.05
CAPACITY_WORKERS = 32
CONNECTIONS = 64  # the client's keep-alive pool; requests beyond it wait (and count) client-side


# -- measurements ------------------------------------------------------------------------


@dataclass(slots=True)
class Soak:
    """Per-request outcomes of the open loop, plus the server's memory and the machine's load."""

    offsets: list[float] = field(default_factory=list)  # scheduled send, s after the start
    latencies: list[float] = field(default_factory=list)  # s from the scheduled send
    statuses: list[int] = field(default_factory=list)  # HTTP status, 0: transport failure
    rss: list[tuple[float, int]] = field(default_factory=list)  # (s after start, kB)
    sockets: list[tuple[float, int]] = field(default_factory=list)  # (s after start, open)
    load: list[tuple[float, float]] = field(default_factory=list)  # (s after start, loadavg 1m)
    rate: float = 0.0  # offered Poisson rate, req/s
    duration: float = 0.0  # seconds of arrivals
    sent: int = 0
    seconds: float = 0.0  # wall time from the start to the last answer
    failures: Counter[str] = field(default_factory=Counter)  # transport errors by kind
    before: dict[str, float] = field(default_factory=dict)  # /metrics once the pool is open

    @property
    def answered(self) -> int:
        return len(self.statuses)

    def counts(self) -> Counter[int]:
        return Counter(self.statuses)

    def ok_latencies(self, start: float, end: float) -> list[float]:
        """Latencies of the 200s scheduled in [start, end) seconds."""
        return [
            lat
            for t, lat, s in zip(self.offsets, self.latencies, self.statuses, strict=True)
            if s == 200 and start <= t < end
        ]

    def statuses_in(self, start: float, end: float) -> Counter[int]:
        """Statuses of the requests scheduled in [start, end) seconds."""
        return Counter(
            s for t, s in zip(self.offsets, self.statuses, strict=True) if start <= t < end
        )

    def rss_at(self, second: float) -> int:
        """The first RSS sample taken at or after `second` (the last one if none is)."""
        for t, kb in self.rss:
            if t >= second:
                return kb
        return self.rss[-1][1]


def rss_kb(pid: int) -> int:
    """VmRSS of process `pid` in kB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


def open_sockets(pid: int) -> int:
    """How many sockets process `pid` holds open (listening ones included)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd).startswith("socket:")
    return count


async def open_pool(session: aiohttp.ClientSession, target: Target) -> None:
    """Open every connection of the pool at once, with real requests (their answers unused)."""
    headers = {"Content-Type": target.content_type}

    async def one(body: bytes) -> None:
        async with session.post(target.url, data=body, headers=headers) as response:
            await response.read()

    bodies = [target.bodies[i % len(target.bodies)] for i in range(CONNECTIONS)]
    await asyncio.gather(*(one(body) for body in bodies))


async def soak(target: Target, pid: int, rate: float, seconds: float, seed: int = 0) -> Soak:
    """Poisson arrivals at `rate` for `seconds`, sampling the server's RSS every 10 s."""
    result = Soak(rate=rate, duration=seconds)
    rng = random.Random(seed)
    connector = aiohttp.TCPConnector(limit=CONNECTIONS)
    timeout = aiohttp.ClientTimeout(total=120.0)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await open_pool(session, target)
        result.before = scrape_metrics(target.url.split("/v2/")[0])
        start = time.perf_counter()
        sampler = asyncio.create_task(sample_server(result, pid, start, seconds))
        pending: set[asyncio.Task[None]] = set()
        offset = rng.expovariate(rate)
        while offset < seconds:
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = target.bodies[rng.randrange(len(target.bodies))]
            task = asyncio.create_task(send(session, target, body, start, offset, result))
            pending.add(task)
            task.add_done_callback(pending.discard)
            result.sent += 1
            offset += rng.expovariate(rate)
        await asyncio.gather(*pending)
        result.seconds = time.perf_counter() - start
        await sampler
    return result


async def send(
    session: aiohttp.ClientSession,
    target: Target,
    body: bytes,
    start: float,
    offset: float,
    result: Soak,
) -> None:
    headers = {"Content-Type": target.content_type}
    try:
        async with session.post(target.url, data=body, headers=headers) as response:
            await response.read()
            status = response.status
    except (aiohttp.ClientError, TimeoutError) as exc:
        status = 0
        result.failures[type(exc).__name__] += 1
    result.offsets.append(offset)
    result.latencies.append(time.perf_counter() - start - offset)
    result.statuses.append(status)


async def sample_server(result: Soak, pid: int, start: float, seconds: float) -> None:
    """RSS and load average at 0, 10, 20, … s and once more at the end."""
    tick = 0.0
    while tick <= seconds:
        delay = start + tick - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        result.rss.append((tick, rss_kb(pid)))
        result.sockets.append((tick, open_sockets(pid)))
        result.load.append((tick, os.getloadavg()[0]))
        tick += RSS_EVERY_S
    if result.rss[-1][0] < seconds:
        await asyncio.sleep(max(0.0, start + seconds - time.perf_counter()))
        result.rss.append((seconds, rss_kb(pid)))
        result.sockets.append((seconds, open_sockets(pid)))
        result.load.append((seconds, os.getloadavg()[0]))


def run_soak(target: Target, pid: int, rate: float, seconds: float) -> Soak:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(soak(target, pid, rate, seconds))
    return uvloop.run(soak(target, pid, rate, seconds))


def outcomes(values: dict[str, float]) -> dict[str, float]:
    """lockgate_requests_total of the model, by outcome."""
    found: dict[str, float] = {}
    for key, value in values.items():
        if key.split("{")[0] == "lockgate_requests_total" and f'model="{MODEL}"' in key:
            outcome = key.split('outcome="')[1].split('"')[0] if 'outcome="' in key else "?"
            found[outcome] = found.get(outcome, 0.0) + value
    return found


# -- the suite ---------------------------------------------------------------------------


def run(ctx: Context) -> SuiteResult:
    started = time.perf_counter()
    model_dir = demo_model(ctx, MODEL)
    repository = ctx.work / "soak-repo"
    shutil.copytree(model_dir, repository / MODEL)
    rows = digits_rows(64)  # [64, 64] float32
    bodies = tuple(v2_body({"input": rows[i : i + 1]}) for i in range(len(rows)))
    ctx.say(SUITE, "starting lockgate with digits_onnx on the server core")
    server = start_lockgate(repository, ctx.work)
    with running(server):
        capacity, data, before, after = measure(ctx, server, bodies)
        if server.process.poll() is not None:
            raise RuntimeError(f"lockgate exited during the soak:\n{server.log_tail()}")
    result = report(ctx, capacity, data, diff(before, after))
    result.seconds = time.perf_counter() - started
    return result


def measure(
    ctx: Context, server: Server, bodies: tuple[bytes, ...]
) -> tuple[float, Soak, dict[str, float], dict[str, float]]:
    target = Target(f"{server.url}/v2/models/{MODEL}/infer", bodies)
    probe = run_async(closed_loop(target, CAPACITY_WORKERS, seconds=5.0, warmup=200))
    capacity = probe.throughput
    rate = LOAD_FRACTION * capacity
    seconds = QUICK_SECONDS if ctx.quick else SECONDS
    ctx.say(
        SUITE,
        f"capacity {capacity:.0f}/s (closed loop, c={CAPACITY_WORKERS}, statuses "
        f"{dict(probe.statuses)}); soaking at {rate:.0f}/s for {seconds:.0f} s, "
        f"load average {os.getloadavg()[0]:.1f}",
    )
    data = run_soak(target, server.process.pid, rate, seconds)
    after = scrape_metrics(server.url)
    ctx.say(SUITE, f"done: sent {data.sent}, answered {data.answered}, {dict(data.counts())}")
    return capacity, data, data.before, after


def diff(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    start = outcomes(before)
    return {k: v - start.get(k, 0.0) for k, v in outcomes(after).items() if v - start.get(k, 0.0)}


# -- report ------------------------------------------------------------------------------


def report(ctx: Context, capacity: float, data: Soak, server: dict[str, float]) -> SuiteResult:
    seconds = data.duration
    bucket = QUICK_BUCKET_S if ctx.quick else BUCKET_S
    counts = data.counts()
    errors = data.answered - counts.get(200, 0)
    lost = data.sent - data.answered
    base_kb, end_kb = data.rss_at(bucket), data.rss[-1][1]
    growth = (end_kb - base_kb) / base_kb if base_kb else float("nan")
    server_ok = server.get("success", 0.0)
    matches = server_ok == counts.get(200, 0)
    met = errors == 0 and lost == 0 and growth < RSS_GROWTH_TARGET and matches
    result = SuiteResult(
        suite=SUITE,
        title=f"Soak: {MODEL} at {LOAD_FRACTION:.0%} of capacity for {seconds:.0f} s (open loop)",
        target=(
            f"zero errors, nothing lost, RSS growth < {RSS_GROWTH_TARGET:.0%} from the "
            f"{bucket:.0f} s mark to the end, server counts match the client's"
        ),
        met=met,
        environment=environment(),
    )
    add_totals(result, capacity, data, counts, errors, lost)
    add_memory(result, data, bucket, base_kb, end_kb, growth)
    add_buckets(result, data, seconds, bucket)
    result.add(
        "server: lockgate_requests_total{outcome=success}",
        server_ok,
        "req",
        baseline_label="client: 200s",
        baseline=float(counts.get(200, 0)),
        note="match" if matches else f"MISMATCH; server outcomes {server}",
    )
    result.notes += notes(data, server)
    result.raw = raw(capacity, data, server, bucket)
    return result


def add_totals(
    result: SuiteResult,
    capacity: float,
    data: Soak,
    counts: Counter[int],
    errors: int,
    lost: int,
) -> None:
    result.add("capacity (closed loop, c=32)", capacity, "req/s")
    result.add(
        "offered rate (Poisson)",
        data.sent / data.duration,
        "req/s",
        baseline_label="capacity",
        baseline=capacity,
        note=f"target {data.rate:.0f}/s",
    )
    result.add("requests sent", data.sent, "req")
    result.add("requests answered", data.answered, "req", note=f"lost {lost}")
    breakdown = ", ".join(f"{s}: {n}" for s, n in sorted(counts.items()) if s != 200)
    if data.failures:
        breakdown += f" (status 0: {dict(data.failures)})"
    result.add("errors (any status but 200)", errors, "req", note=breakdown or "none")
    ok = data.ok_latencies(0.0, float("inf"))
    result.add("p50, whole run", percentile(ok, 50) * 1e3, "ms")
    result.add("p99, whole run", percentile(ok, 99) * 1e3, "ms")


def add_memory(
    result: SuiteResult, data: Soak, bucket: float, base_kb: int, end_kb: int, growth: float
) -> None:
    result.add("server RSS at start", data.rss[0][1] / 1024, "MiB")
    result.add(f"server RSS at {bucket:.0f} s", base_kb / 1024, "MiB")
    result.add(
        "server RSS at the end",
        end_kb / 1024,
        "MiB",
        baseline_label=f"RSS at {bucket:.0f} s",
        baseline=base_kb / 1024,
        note=f"growth {growth:+.2%}; peak {max(kb for _, kb in data.rss) / 1024:.1f} MiB",
    )
    if data.sockets:
        counts = [n for _, n in data.sockets]
        result.add(
            "server open sockets, min / max over the run",
            min(counts),
            "sockets",
            note=f"max {max(counts)}; client pool {CONNECTIONS} connections",
        )


def add_buckets(result: SuiteResult, data: Soak, seconds: float, bucket: float) -> None:
    for start in np.arange(0.0, seconds, bucket):
        end = float(start + bucket)
        ok = data.ok_latencies(float(start), end)
        load = [v for t, v in data.load if start <= t < end]
        label = f"{start:.0f}-{end:.0f} s"
        bad = data.statuses_in(float(start), end)
        bad.pop(200, None)
        failed = ", ".join(f"{code}: {n}" for code, n in sorted(bad.items())) or "none"
        note = (
            f"{len(ok)} ok; not ok {failed}; load average {max(load) if load else float('nan'):.1f}"
        )
        result.add(f"{label}: p50", percentile(ok, 50) * 1e3, "ms")
        result.add(f"{label}: p99", percentile(ok, 99) * 1e3, "ms", note=note)


def notes(data: Soak, server: dict[str, float]) -> list[str]:
    loads = [v for _, v in data.load]
    return [
        "Latency from the scheduled send time, 200s only; errors count every other answer "
        "(status 0: the connection failed). digits_onnx ships with latency_slo_ms 20, the "
        "default deadline of these requests: a 504 is a request that waited past it.",
        f"1-minute load average during the soak: min {min(loads):.1f}, max {max(loads):.1f} "
        f"on {os.cpu_count()} CPUs (a shared machine: other jobs run alongside).",
        f"Server outcomes during the soak (lockgate_requests_total): {server}.",
    ]


def raw(capacity: float, data: Soak, server: dict[str, float], bucket: float) -> dict[str, Any]:
    return {
        "capacity": capacity,
        "sent": data.sent,
        "answered": data.answered,
        "statuses": dict(data.counts()),
        "seconds": data.seconds,
        "rss_kb": data.rss,
        "open_sockets": data.sockets,
        "load_average": data.load,
        "server_outcomes": server,
        "transport_failures": dict(data.failures),
        "bucket_s": bucket,
    }
