"""Service-time profile T(B): measure a model at batch sizes 1, 2, 4, ... and fit a + b B.

Two ways to measure: in-process through a callable `infer(batch_size)`, or through a running
server by sending one KServe v2 request of B rows at a time, sequentially, with 16 distinct
synthesized bodies per size used in turn (a model whose cost depends on its input, text
say, is timed over a spread of inputs, as load tests and clients send them). Each batch size
is timed `repeats` times after `warmup` untimed calls, and the median is kept. One-row
requests are timed first, back to back: right after a large batch a small one runs slower
(the large one's memory is still being released), which is not what a one-row request
costs. The larger sizes are then visited in rounds (2, 4, ..., then again), so a machine
whose load drifts during the profile slows every batch size alike instead of bending the
line.

Through a server that keeps Triton-style statistics (`GET /v2/models/{m}/stats`), each
request's compute time is read from the server too. The model instance is the queue's server,
so T(B) is fitted to the compute times, and the rest of the round trip (HTTP, parsing, the
network, the client) becomes `overhead_s`: latency every request pays that occupies no
instance (measured on one-row requests, the size clients send). Without statistics, T(B) is
the round trip and the overhead is 0.

More numbers make the profile a description of the replica, not only of the model
(`ReplicaProfile`):

- How much T(1) varies: the coefficient of variation (sd / mean) of the one-row compute
  times, a time above 3 times the median counted as 3 times the median (a stall of the
  machine, not of the model). With `repeats` of 30 or more it is worth using.
- The server's CPU per request. When the server publishes `process_cpu_seconds_total` on
  `/metrics` (lockgate does), the profile sends one-row requests back to back for
  `cpu_seconds` and divides the CPU the process used, less what it uses idle over the same
  time, by the requests. The part of it beyond the model's mean compute time is the front
  end's (HTTP, JSON, the batcher): on a CPU-bound model that shares its core, it queues with
  the model; on a model that waits (a sleep, a GPU, another service) it runs beside it, and
  the CPU per request stays under the compute time. The first half of the time sends one
  request at a time, the second keeps `cpu_concurrency` in flight: queued requests form
  batches, and what the front end's CPU per row saves there is the part a batch pays once
  (`frontend_per_batch_s`).
- What a request costs when it finds the server idle. Back to back, the server's caches,
  clock and threads stay warm; a request that arrives after the server has slept a while
  takes longer, and the longer it slept, the longer it takes (on a CPU-bound model, 20 ms of
  sleep can add a quarter to the round trip and far more to its tail). The profile sends
  `idle_requests` one-row requests, each after an idle gap drawn log-uniformly between
  0.1 ms and `idle_longest_s` (slept, then waited out in a spin for the last 1.5 ms), and
  keeps each gap with its round trip. The planner turns them into the service of a request
  that finds the replica idle at its arrival rate (`queueing.IdleStart`).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lockgate.errors import BadRequest
from lockgate.plan.queueing import IdleStart
from lockgate.service_time import ServiceTime, fit_service_time

if TYPE_CHECKING:
    import aiohttp

    from lockgate.bench.workload import V2Target


@dataclass(frozen=True, slots=True)
class ReplicaProfile:
    """What `lockgate profile` measured: T(B) and the overhead, how much T(1) varies, and what
    one request costs the server's CPU. Saved as the ServiceTime JSON plus three fields."""

    service: ServiceTime
    service_cv: float = 0.0  # sd / mean of the one-row compute time
    cpu_per_request_s: float | None = None  # the server process's CPU per one-row request
    compute_per_request_s: float | None = None  # mean compute time in the same requests
    idle_gaps_s: tuple[float, ...] = ()  # how long the server was idle before ...
    idle_extra_s: tuple[float, ...] = ()  # ... a one-row request took this much longer
    frontend_per_batch_s: float = 0.0  # the part of frontend_s paid once per batch

    @property
    def frontend_s(self) -> float:
        """CPU per request beyond the model's compute: 0 when the model's time is not CPU."""
        if self.cpu_per_request_s is None or self.compute_per_request_s is None:
            return 0.0
        return max(0.0, self.cpu_per_request_s - self.compute_per_request_s)

    def idle_start(self, service_s: float) -> IdleStart | None:
        """The service of a one-row request after each idle gap: `service_s` (what one takes
        inside a busy period) plus how much longer it took; None without idle samples.

        A service above STALL times the median of its neighbours (the NEIGHBOURS samples on
        either side, by gap) counts as that much, as in `variation`: a stall of the machine."""
        if not self.idle_gaps_s:
            return None
        order = np.argsort(self.idle_gaps_s, kind="stable")
        gaps = np.asarray(self.idle_gaps_s)[order]
        services = np.maximum(service_s + np.asarray(self.idle_extra_s)[order], 1e-6)
        near = [services[max(0, i - NEIGHBOURS) : i + NEIGHBOURS + 1] for i in range(len(gaps))]
        capped = np.minimum(services, STALL * np.array([np.median(t) for t in near]))
        return IdleStart(tuple(gaps.tolist()), tuple(capped.tolist()))

    def to_json(self) -> dict[str, object]:
        return {
            **self.service.to_json(),
            "service_cv": self.service_cv,
            "cpu_per_request_s": self.cpu_per_request_s,
            "compute_per_request_s": self.compute_per_request_s,
            "idle_gaps_s": list(self.idle_gaps_s),
            "idle_extra_s": list(self.idle_extra_s),
            "frontend_per_batch_s": self.frontend_per_batch_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, object], source: str = "profile") -> ReplicaProfile:
        service = ServiceTime.from_json(data, source)
        fields = {}
        for key in (
            "service_cv",
            "cpu_per_request_s",
            "compute_per_request_s",
            "frontend_per_batch_s",
        ):
            value = data.get(key)
            if value is None:
                continue
            if not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise BadRequest(f"{source}: '{key}' must be a finite number >= 0, got {value!r}")
            fields[key] = float(value)
        gaps = _seconds_list(data, "idle_gaps_s", source)
        trips = _seconds_list(data, "idle_extra_s", source, signed=True)
        if len(gaps) != len(trips):
            raise BadRequest(f"{source}: 'idle_gaps_s' and 'idle_extra_s' differ in length")
        return cls(
            service,
            fields.get("service_cv", 0.0),
            fields.get("cpu_per_request_s"),
            fields.get("compute_per_request_s"),
            gaps,
            trips,
            fields.get("frontend_per_batch_s", 0.0),
        )

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> ReplicaProfile:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise BadRequest(f"cannot read profile {path}: {exc}") from exc
        if not isinstance(data, dict):
            raise BadRequest(f"{path}: a profile is a JSON object")
        return cls.from_json(data, str(path))


def _seconds_list(
    data: dict[str, object], key: str, source: str, signed: bool = False
) -> tuple[float, ...]:
    """A profile's list of seconds (absent: empty); every one finite, and >= 0 unless
    `signed`."""
    values = data.get(key) or []
    ok = isinstance(values, list) and all(
        isinstance(v, int | float) and math.isfinite(v) and (signed or v >= 0) for v in values
    )
    if not ok:
        floor = "" if signed else " >= 0"
        raise BadRequest(f"{source}: '{key}' must be a list of finite numbers{floor}")
    assert isinstance(values, list)
    return tuple(float(v) for v in values)


def batch_sizes_up_to(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to max_batch_size, which is always included."""
    if max_batch_size < 1:
        raise BadRequest(f"max batch size must be >= 1, got {max_batch_size}")
    sizes = [1]
    while sizes[-1] * 2 <= max_batch_size:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return tuple(sizes)


def profile_callable(
    infer: Callable[[int], None],
    max_batch_size: int,
    *,
    repeats: int = 5,
    warmup: int = 1,
    model: str = "",
) -> ServiceTime:
    """Time `infer(B)` in-process for each batch size; median of `repeats` runs."""
    sizes = batch_sizes_up_to(max_batch_size)
    samples: dict[int, list[float]] = {batch: [] for batch in sizes}
    for round_index in range(warmup + max(1, repeats)):
        for batch in sizes:
            start = time.perf_counter()
            infer(batch)
            if round_index >= warmup:
                samples[batch].append(time.perf_counter() - start)
    return fit_service_time(model, sizes, _medians(samples))


def _medians(samples: dict[int, list[float]]) -> tuple[float, ...]:
    return tuple(statistics.median(times) for times in samples.values())


def profile_server(
    url: str,
    model: str,
    max_batch_size: int,
    *,
    version: str | None = None,
    repeats: int = 5,
    warmup: int = 1,
    timeout_s: float = 60.0,
    seed: int = 0,
    cpu_seconds: float = 2.0,
    cpu_concurrency: int = 4,
    idle_requests: int = 200,
    idle_longest_s: float = 0.1,
    say: Callable[[str], None] | None = None,
) -> ReplicaProfile:
    """Time one B-row v2 request at a time against a running server, for each batch size, then
    (`cpu_seconds` > 0) the server's CPU per one-row request, then `idle_requests` one-row
    requests after idle gaps up to `idle_longest_s`. `say` is told each step."""
    if not 0 <= cpu_seconds < math.inf:
        raise BadRequest(f"cpu seconds must be a finite number >= 0, got {cpu_seconds}")
    if cpu_concurrency < 1:
        raise BadRequest(f"cpu concurrency must be >= 1, got {cpu_concurrency}")
    if idle_requests < 0:
        raise BadRequest(f"idle requests must be >= 0, got {idle_requests}")
    if not IDLE_SHORTEST_S < idle_longest_s <= 60:
        raise BadRequest(
            f"the longest idle gap must be in ({IDLE_SHORTEST_S * 1e3:g} ms, 60 s], "
            f"got {idle_longest_s * 1e3:g} ms"
        )
    idle = _Idle(idle_requests, idle_longest_s)
    settings = _Settings(
        url,
        model,
        version,
        max_batch_size,
        repeats,
        warmup,
        seed,
        cpu_seconds,
        cpu_concurrency,
        idle,
    )
    return asyncio.run(_profile_server(settings, timeout_s, say or (lambda _: None)))


@dataclass(frozen=True, slots=True)
class _Settings:
    url: str
    model: str
    version: str | None
    max_batch_size: int
    repeats: int
    warmup: int
    seed: int
    cpu_seconds: float
    cpu_concurrency: int
    idle: _Idle


@dataclass(frozen=True, slots=True)
class _Idle:
    """How many one-row requests to send after idle gaps, and the longest gap (seconds)."""

    requests: int
    longest_s: float


@dataclass(slots=True)
class _Samples:
    """Seconds per request, by batch size."""

    round_trip: dict[int, list[float]]
    compute: dict[int, list[float]]
    served: list[float]  # one-row requests: time in the server, by its statistics

    def add(
        self, batch: int, round_trip: float, compute: float | None, served: float | None
    ) -> None:
        self.round_trip[batch].append(round_trip)
        if compute is not None:
            self.compute[batch].append(compute)
        if served is not None and batch == 1:
            self.served.append(served)

    def one_row_reference(self) -> tuple[float, bool]:
        """(a one-row request's median time, True: in the server by its statistics, False: the
        round trip, without them)."""
        if self.served:
            return statistics.median(self.served), True
        return statistics.median(self.round_trip[1]), False


async def _timed_request(
    session: aiohttp.ClientSession, target: V2Target, body: bytes
) -> tuple[float, float | None, float | None]:
    """(round trip, the model's compute time and the request's time in the server by the
    server's statistics, or None), seconds."""
    before = await _model_stats(session, target.model_url)
    start = time.perf_counter()
    await _post_once(session, target.infer_url, body)
    elapsed = time.perf_counter() - start
    after = await _model_stats(session, target.model_url)
    if before is None or after is None or after.compute_ns <= before.compute_ns:
        return elapsed, None, None
    served = (after.request_ns - before.request_ns) / 1e9
    return elapsed, (after.compute_ns - before.compute_ns) / 1e9, served


async def _profile_server(
    settings: _Settings, timeout_s: float, say: Callable[[str], None]
) -> ReplicaProfile:
    import aiohttp

    from lockgate.bench.workload import V2Target, fetch_v2_metadata, synthesize_v2_body

    target = V2Target(settings.url, settings.model, settings.version)
    rng = np.random.default_rng(settings.seed)
    sizes = batch_sizes_up_to(settings.max_batch_size)
    samples = _Samples({batch: [] for batch in sizes}, {batch: [] for batch in sizes}, [])
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        metadata = await fetch_v2_metadata(session, target)
        bodies = {b: [synthesize_v2_body(metadata, b, rng) for _ in range(BODIES)] for b in sizes}
        # one-row requests first and apart: one right after a large batch runs slower (its
        # allocations are still being cleaned up), which is not what a one-row request costs
        rounds = settings.warmup + max(1, settings.repeats)
        for sizes_now in ((1,), sizes[1:]):
            for round_index in range(rounds):
                if sizes_now:
                    shown = ", ".join(str(b) for b in sizes_now)
                    say(f"round {round_index + 1} of {rounds}: batch sizes {shown}")
                for batch in sizes_now:
                    body = bodies[batch][round_index % BODIES]
                    timed = await _timed_request(session, target, body)
                    if round_index >= settings.warmup:
                        samples.add(batch, *timed)
        cpu = queued = None
        if settings.cpu_seconds > 0:
            say(f"measuring the server's CPU per request for {settings.cpu_seconds:g} s")
            half = settings.cpu_seconds / 2
            cpu = await _cpu_per_request(session, target, bodies[1], half, 1)
            queued = await _cpu_per_request(
                session, target, bodies[1], half, settings.cpu_concurrency
            )
        gaps: list[float] = []
        extra: list[float] = []
        if settings.idle.requests:
            say(f"timing {settings.idle.requests} one-row requests after idle gaps")
            reference = samples.one_row_reference()
            gaps, extra = await _after_idle(
                session, target, bodies[1], settings.idle, rng, reference
            )
    service = _server_profile(settings.model, sizes, samples.round_trip, samples.compute)
    cv = variation(samples.compute[1] or samples.round_trip[1])
    if cpu is None:
        return ReplicaProfile(service, cv, None, None, tuple(gaps), tuple(extra))
    per_batch = 0.0 if queued is None else _frontend_per_batch(cpu, queued)
    return ReplicaProfile(
        service, cv, cpu.cpu_s, cpu.compute_s, tuple(gaps), tuple(extra), per_batch
    )


IDLE_SHORTEST_S = 1e-4  # the shortest idle gap drawn
SPIN_S = 0.0015  # an idle gap's last part, waited out in a spin: a sleep overshoots by ~1 ms


async def _after_idle(
    session: aiohttp.ClientSession,
    target: V2Target,
    bodies: list[bytes],
    idle: _Idle,
    rng: np.random.Generator,
    reference: tuple[float, bool],
) -> tuple[list[float], list[float]]:
    """One-row requests, each sent after an idle gap drawn log-uniformly between
    IDLE_SHORTEST_S and `idle.longest_s`: (the gaps as they were, how much longer each took
    than `reference`), seconds. With the server's statistics (`reference[1]`) the time is the
    request's in the server, so a client that also went cold adds nothing; else the round trip.
    """
    low, high = math.log(IDLE_SHORTEST_S), math.log(idle.longest_s)
    wanted = np.exp(rng.uniform(low, high, idle.requests)).tolist()
    typical, in_server = reference
    gaps: list[float] = []
    extra: list[float] = []
    for index, gap in enumerate(wanted):
        before = await _model_stats(session, target.model_url) if in_server else None
        answered = time.perf_counter()  # the server's last work: this statistics request
        due = answered + gap
        if due - time.perf_counter() > SPIN_S:
            await asyncio.sleep(due - time.perf_counter() - SPIN_S)
        while time.perf_counter() < due:
            pass
        sent = time.perf_counter()
        await _post_once(session, target.infer_url, bodies[index % len(bodies)])
        took = time.perf_counter() - sent
        after = await _model_stats(session, target.model_url) if in_server else None
        if before is not None and after is not None:
            took = (after.request_ns - before.request_ns) / 1e9
        gaps.append(sent - answered)
        extra.append(took - typical)
    return gaps, extra


BODIES = 16  # distinct synthesized request bodies per batch size, used in turn
NEIGHBOURS = 10  # idle_start(): samples on either side whose median caps a round trip
STALL = 3.0  # variation(): a time above this multiple of the median is a stall of the machine


def variation(times: list[float]) -> float:
    """sd / mean of service times, each counted as at most STALL times the median.

    One preempted request in thirty can triple the plain coefficient of variation; it says
    how busy the machine was that second, not how the model's work varies."""
    if len(times) < 2:
        return 0.0
    cap = STALL * statistics.median(times)
    clipped = [min(t, cap) for t in times]
    return statistics.stdev(clipped) / statistics.mean(clipped)


def _server_profile(
    model: str,
    sizes: tuple[int, ...],
    round_trip: dict[int, list[float]],
    compute: dict[int, list[float]],
) -> ServiceTime:
    """Fit T(B) to compute times when every batch size has them, else to round trips; the
    overhead is that of a one-row request."""
    trips = _medians(round_trip)
    if not all(compute.values()):
        return fit_service_time(model, sizes, trips)
    service = _medians(compute)
    return fit_service_time(model, sizes, service, _one_row_overhead(round_trip[1], compute[1]))


def _one_row_overhead(trips: list[float], computes: list[float]) -> float:
    """median(round trip - compute) of the one-row requests; from the medians when a
    statistic was missed and the samples do not pair up."""
    if len(trips) != len(computes):
        return max(0.0, statistics.median(trips) - statistics.median(computes))
    return statistics.median(max(0.0, t - c) for t, c in zip(trips, computes, strict=True))


@dataclass(frozen=True, slots=True)
class _Cpu:
    """The server's CPU per one-row request, its model's mean compute in the same requests, and
    the mean rows per batch they formed."""

    cpu_s: float
    compute_s: float
    batch: float

    @property
    def frontend_s(self) -> float:
        return max(0.0, self.cpu_s - self.compute_s)


def _frontend_per_batch(alone: _Cpu, queued: _Cpu) -> float:
    """The front end's CPU per batch, from its CPU per row one at a time and with requests
    queued: f(m) = alpha / m + beta per row at a mean batch of m rows, solved for alpha >= 0
    (and beta >= 0). 0 when the queued requests did not form larger batches."""
    if queued.batch < alone.batch + MIN_BATCH_GAIN:
        return 0.0
    alpha = (alone.frontend_s - queued.frontend_s) / (1 / alone.batch - 1 / queued.batch)
    return min(max(0.0, alpha), alone.frontend_s * alone.batch)


MIN_BATCH_GAIN = 0.25  # rows per batch, queued over alone, below which no per-batch part is fit


async def _cpu_per_request(
    session: aiohttp.ClientSession,
    target: V2Target,
    bodies: list[bytes],
    seconds: float,
    concurrency: int,
) -> _Cpu | None:
    """`concurrency` requests in flight for `seconds`, against half that time idle (scaled).
    None when the server does not publish its CPU time or its statistics."""
    idle_s = seconds / 2
    idle_start = await _process_cpu_s(session, target.url)
    if idle_start is None:
        return None
    await asyncio.sleep(idle_s)
    idle_end = await _process_cpu_s(session, target.url)
    compute_start = await _model_stats(session, target.model_url)
    cpu_start = await _process_cpu_s(session, target.url)
    began, sent = time.perf_counter(), [0]

    async def worker() -> None:
        while time.perf_counter() - began < seconds:
            sent[0] += 1
            await _post_once(session, target.infer_url, bodies[sent[0] % len(bodies)])

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    busy_s, requests = time.perf_counter() - began, sent[0]
    cpu_end = await _process_cpu_s(session, target.url)
    compute_end = await _model_stats(session, target.model_url)
    readings = (idle_start, idle_end, cpu_start, cpu_end, compute_start, compute_end)
    if any(r is None for r in readings):
        return None
    assert idle_end is not None and cpu_start is not None and cpu_end is not None  # for mypy
    assert compute_start is not None and compute_end is not None
    background = (idle_end - idle_start) * busy_s / idle_s
    cpu = max(0.0, cpu_end - cpu_start - background) / requests
    compute_ns = compute_end.compute_ns - compute_start.compute_ns
    batches = max(1, compute_end.batches - compute_start.batches)
    return _Cpu(cpu, compute_ns / 1e9 / requests, requests / batches)


_CPU_LINE = re.compile(r"^process_cpu_seconds_total\s+(\S+)", re.MULTILINE)


async def _process_cpu_s(session: aiohttp.ClientSession, url: str) -> float | None:
    """The server process's CPU seconds from its /metrics; None without them."""
    import aiohttp

    try:
        async with session.get(f"{url}/metrics") as response:
            if response.status != 200:
                return None
            found = _CPU_LINE.search(await response.text())
            return float(found[1]) if found else None
    except (aiohttp.ClientError, UnicodeDecodeError, ValueError):
        return None


@dataclass(frozen=True, slots=True)
class _Stats:
    """A model's counters from the server's statistics: total compute (ns), batches run, and
    the total time its successful requests spent in the server (ns)."""

    compute_ns: int
    batches: int
    request_ns: int


async def _model_stats(session: object, model_url: str) -> _Stats | None:
    """The model's counters from the server's statistics; None without them."""
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    try:
        async with session.get(f"{model_url}/stats") as response:
            if response.status != 200:
                return None
            data = await response.json(content_type=None)
        entries = data["model_stats"]
        parts = ("compute_input", "compute_infer", "compute_output")
        compute = sum(int(e["inference_stats"][k]["ns"]) for e in entries for k in parts)
        batches = sum(int(e["execution_count"]) for e in entries)
        served = sum(int(e["inference_stats"]["success"]["ns"]) for e in entries)
        return _Stats(compute, batches, served)
    except (aiohttp.ClientError, ValueError, KeyError, TypeError):
        return None


async def _post_once(session: object, url: str, body: bytes) -> None:
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    headers = {"content-type": "application/json"}
    try:
        async with session.post(url, data=body, headers=headers) as response:
            payload = await response.read()
            if response.status != 200:
                text = payload.decode(errors="replace")[:200]
                raise BadRequest(f"{url} answered {response.status}: {text}")
    except aiohttp.ClientError as exc:
        raise BadRequest(f"cannot reach {url}: {exc}") from exc
