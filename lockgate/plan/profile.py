"""Service-time profile T(B): measure a model at batch sizes 1, 2, 4, ... and fit a + b B.

Two ways to measure: in-process through a callable `infer(batch_size)`, or through a running
server by sending one KServe v2 request of B rows at a time, sequentially. Each batch size is
timed `repeats` times after `warmup` untimed calls, and the median is kept. The sizes are
visited in rounds (1, 2, 4, ..., then again), so a machine whose load drifts during the
profile slows every batch size alike instead of bending the line.

Through a server that keeps Triton-style statistics (`GET /v2/models/{m}/stats`), each
request's compute time is read from the server too. The model instance is the queue's server,
so T(B) is fitted to the compute times, and the rest of the round trip (HTTP, parsing, the
network, the client) becomes `overhead_s`: latency every request pays that occupies no
instance. Without statistics, T(B) is the round trip and the overhead is 0.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable

import numpy as np

from lockgate.errors import BadRequest
from lockgate.service_time import ServiceTime, fit_service_time


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
) -> ServiceTime:
    """Time one B-row v2 request at a time against a running server, for each batch size."""
    return asyncio.run(
        _profile_server(url, model, max_batch_size, version, repeats, warmup, timeout_s, seed)
    )


async def _profile_server(
    url: str,
    model: str,
    max_batch_size: int,
    version: str | None,
    repeats: int,
    warmup: int,
    timeout_s: float,
    seed: int,
) -> ServiceTime:
    import aiohttp

    from lockgate.bench.workload import V2Target, fetch_v2_metadata, synthesize_v2_body

    target = V2Target(url, model, version)
    rng = np.random.default_rng(seed)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    sizes = batch_sizes_up_to(max_batch_size)
    round_trip: dict[int, list[float]] = {batch: [] for batch in sizes}
    compute: dict[int, list[float]] = {batch: [] for batch in sizes}
    async with aiohttp.ClientSession(timeout=timeout) as session:
        metadata = await fetch_v2_metadata(session, target)
        bodies = {batch: synthesize_v2_body(metadata, batch, rng) for batch in sizes}
        for round_index in range(warmup + max(1, repeats)):
            for batch in sizes:
                before = await _compute_ns(session, target.model_url)
                start = time.perf_counter()
                await _post_once(session, target.infer_url, bodies[batch])
                elapsed = time.perf_counter() - start
                after = await _compute_ns(session, target.model_url)
                if round_index < warmup:
                    continue
                round_trip[batch].append(elapsed)
                if before is not None and after is not None and after > before:
                    compute[batch].append((after - before) / 1e9)
    return _server_profile(model, sizes, round_trip, compute)


def _server_profile(
    model: str,
    sizes: tuple[int, ...],
    round_trip: dict[int, list[float]],
    compute: dict[int, list[float]],
) -> ServiceTime:
    """Fit T(B) to compute times when every batch size has them, else to round trips."""
    trips = _medians(round_trip)
    if not all(compute.values()):
        return fit_service_time(model, sizes, trips)
    service = _medians(compute)
    overhead = statistics.median(max(0.0, t - s) for t, s in zip(trips, service, strict=True))
    return fit_service_time(model, sizes, service, overhead)


async def _compute_ns(session: object, model_url: str) -> int | None:
    """The model's total compute time (ns) from the server's statistics; None without them."""
    import aiohttp

    assert isinstance(session, aiohttp.ClientSession)
    try:
        async with session.get(f"{model_url}/stats") as response:
            if response.status != 200:
                return None
            data = await response.json(content_type=None)
        entries = data["model_stats"]
        parts = ("compute_input", "compute_infer", "compute_output")
        return sum(int(e["inference_stats"][k]["ns"]) for e in entries for k in parts)
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
