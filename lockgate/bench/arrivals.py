"""Arrival schedules for open-loop load, precomputed from a seeded generator."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lockgate.errors import BadRequest

ARRIVALS = ("poisson", "constant")


@dataclass(frozen=True, slots=True)
class Schedule:
    """Send times in seconds from the start; the first `warmup_count` are warmup requests."""

    offsets: np.ndarray  # [n] float64, non-decreasing
    warmup_count: int

    def __len__(self) -> int:
        return len(self.offsets)


def _gaps(rate: float, arrival: str, count: int, rng: np.random.Generator) -> np.ndarray:
    if arrival == "poisson":
        return rng.exponential(1.0 / rate, size=count)  # [count]
    return np.full(count, 1.0 / rate)


def arrival_schedule(
    rate: float,
    arrival: str = "poisson",
    *,
    duration: float | None = None,
    num_requests: int | None = None,
    warmup: float = 0.0,
    seed: int = 0,
) -> Schedule:
    """Send times at `rate` per second for `warmup` seconds, then `duration` seconds or
    `num_requests` requests (exactly one of them). The first arrival is at time 0."""
    if not rate > 0:
        raise BadRequest(f"rate must be > 0, got {rate}")
    if arrival not in ARRIVALS:
        raise BadRequest(f"arrival must be one of {ARRIVALS}, got {arrival!r}")
    if (duration is None) == (num_requests is None):
        raise BadRequest("give exactly one of duration and num_requests")
    rng = np.random.default_rng(seed)
    horizon = warmup + (duration or 0.0)
    chunk = max(16, int(rate * (horizon + 1) * 1.2))
    times = np.zeros(0)
    start = 0.0
    while True:
        gaps = _gaps(rate, arrival, chunk, rng)
        gaps[0] = gaps[0] if len(times) else 0.0
        times = np.concatenate([times, start + np.cumsum(gaps)])
        if arrival == "constant":
            times = np.arange(len(times)) / rate  # exact multiples, no summed rounding
        start = float(times[-1])
        warmup_count = int(np.searchsorted(times, warmup, side="left"))
        if duration is not None and start >= horizon:
            return Schedule(times[times < horizon], warmup_count)
        if num_requests is not None and len(times) >= warmup_count + num_requests:
            return Schedule(times[: warmup_count + num_requests], warmup_count)
