"""Dynamic batching: what a batch cap B costs in latency and buys in throughput.

`service_time(B)` is the time one batch of B rows takes on the model, T(B) (often a + b B).
The rules of thumb (fill time, capacity, the SLO batcher's window) come first; `BatchQueue`
is the queue a dynamic batcher forms, whose response-time quantiles come from a simulation.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lockgate.errors import BadRequest
from lockgate.plan.queueing import Distribution, ServiceDistribution

ServiceTime = Callable[[int], float]
SIMULATED_ARRIVALS = 200_000  # BatchQueue: rows per simulation (the first 2% warm it up)


def batch_latency(batch: int, arrival_rate: float, service_time: ServiceTime) -> float:
    """L(B) ~= (B - 1) / (2 lambda) + T(B): the mean wait to fill a batch, then its service."""
    if batch < 1:
        raise BadRequest(f"batch size must be >= 1, got {batch}")
    if not arrival_rate > 0:
        raise BadRequest(f"arrival rate must be > 0, got {arrival_rate}")
    return (batch - 1) / (2 * arrival_rate) + service_time(batch)


def batch_capacity(batch: int, service_time: ServiceTime) -> float:
    """Throughput of back-to-back full batches: B / T(B) rows per second."""
    return batch / service_time(batch)


ADMITTED_SHARE = 0.8  # of the SLO, what the server's admission and its batcher plan within


def batch_window(t_one: float, t_cap: float, arrival_rate: float, slo: float) -> float:
    """The SLO batcher's window: 0 while lambda T(1) < 1, else
    min(0.8 SLO - 2 T(B*), sqrt(T(1) / lambda)) (0.8: `ADMITTED_SHARE`, admission's default
    slack).

    Below that load an idle instance takes what is queued at once: waiting cannot raise the
    throughput, and batches still grow while the instance is busy. Above it, sqrt(T / lambda)
    balances the wait for more rows against the batch's own service time, and SLO - 2 T(B*) is
    what the latency budget leaves after a request waits out one batch of the cap B* and then
    rides in the next. Never negative.
    """
    if not arrival_rate > 0:
        raise BadRequest(f"arrival rate must be > 0, got {arrival_rate}")
    if arrival_rate * t_one < 1:
        return 0.0
    budget = ADMITTED_SHARE * slo - 2 * t_cap
    return max(0.0, min(budget, math.sqrt(t_one / arrival_rate)))


def max_batch_within_slo(
    service_time: ServiceTime, arrival_rate: float, slo: float, max_batch: int
) -> int:
    """The largest B <= max_batch with L(B) <= slo; 0 when not even B = 1 fits."""
    best = 0
    for batch in range(1, max_batch + 1):
        if batch_latency(batch, arrival_rate, service_time) <= slo:
            best = batch
    return best


@dataclass(frozen=True, slots=True)
class BatchQueue:
    """One instance behind a dynamic batcher, fed Poisson arrivals of one row each.

    When the instance is free it takes every queued row, up to `max_batch`; an idle instance
    holds the first row for at most `window_s` for more to come (0: it starts at once, as
    lockgate's SLO batcher does while one-row service keeps up with the arrivals). A batch of
    B rows occupies the instance for (base_s + per_row_s * B) times a random factor of mean 1
    and coefficient of variation `cv`. A batch whose first row found the instance idle takes a
    draw of `first_service` for that row instead, plus per_row_s for each other row: waking an
    idle instance costs more than going on to the next batch. The queue has no
    closed form with batch-size dependent service, so its response times come from a
    simulation with a fixed seed: the same inputs always give the same answer.
    """

    arrival_rate: float
    base_s: float  # a of T(B) = a + b B
    per_row_s: float  # b, plus any work per row that shares the instance's core
    max_batch: int
    cv: float = 0.0
    window_s: float = 0.0
    first_service: Distribution | None = None  # one row after idle; None: as any other

    def __post_init__(self) -> None:
        if not (self.arrival_rate > 0 and math.isfinite(self.arrival_rate)):
            raise BadRequest(f"arrival rate must be a finite number > 0, got {self.arrival_rate}")
        if self.base_s < 0 or self.per_row_s < 0 or self.base_s + self.per_row_s <= 0:
            raise BadRequest("a batch's service time a + b B must be > 0 with a, b >= 0")
        if self.max_batch < 1:
            raise BadRequest(f"max batch must be >= 1, got {self.max_batch}")
        if self.window_s < 0:
            raise BadRequest(f"batch window must be >= 0, got {self.window_s}")
        if self.utilization >= 1:
            raise BadRequest(
                f"unstable queue: {self.arrival_rate:g} rows/s >= capacity "
                f"{self.capacity:g} rows/s at batches of {self.max_batch}"
            )

    def service_time(self, batch: int) -> float:
        return self.base_s + self.per_row_s * batch

    @property
    def capacity(self) -> float:
        """Rows per second with every batch full."""
        return self.max_batch / self.service_time(self.max_batch)

    @property
    def utilization(self) -> float:
        return self.arrival_rate / self.capacity

    def response_times(self, arrivals: int = SIMULATED_ARRIVALS, seed: int = 0) -> np.ndarray:
        """Seconds from arrival to the end of its batch, for each row after the first 2%: [n]."""
        rng = np.random.default_rng(seed)
        arrived = np.cumsum(rng.exponential(1 / self.arrival_rate, arrivals))  # [arrivals]
        return self.serve(arrived, rng)[arrivals // 50 :]

    def serve(self, arrived: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Seconds from arrival to the end of its batch for rows arriving at `arrived` (sorted
        seconds, [n]); the service factors are drawn from `rng`: [n]."""
        count = len(arrived)
        factors = ServiceDistribution(1.0, self.cv).sample(rng, count).tolist()
        first = self.first_service
        woken = (first.sample(rng, count) if first else np.zeros(count)).tolist()
        times = arrived.tolist()
        ends: list[float] = []  # per batch
        sizes: list[int] = []
        head, free, cap, window = 0, -math.inf, self.max_batch, self.window_s
        base, per_row = self.base_s, self.per_row_s
        while head < count:
            last = min(head + cap, count)
            start = max(free, min(times[head] + window, times[last - 1]))  # last: batch full
            size = bisect.bisect_right(times, start, head, last) - head
            if first is not None and times[head] > free:  # its first row found it idle
                free = start + woken[len(ends)] + per_row * (size - 1)
            else:
                free = start + (base + per_row * size) * factors[len(ends)]
            ends.append(free)
            sizes.append(size)
            head += size
        return np.repeat(np.asarray(ends), sizes) - arrived  # [n]

    def response_quantile(self, p: float = 0.99) -> float:
        if not 0 < p < 1:
            raise BadRequest(f"quantile must be in (0, 1), got {p}")
        return float(np.quantile(self.response_times(), p))
