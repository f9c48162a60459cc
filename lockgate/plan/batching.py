"""Dynamic batching rules of thumb: what a batch cap B costs in latency and buys in throughput.

`service_time(B)` is the time one batch of B rows takes on the model, T(B) (often a + b B).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from lockgate.errors import BadRequest

ServiceTime = Callable[[int], float]


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


def batch_window(service_time: float, arrival_rate: float, slo: float) -> float:
    """The batching window: min(SLO - T, sqrt(T / lambda)), never negative.

    sqrt(T / lambda) balances the wait for more rows against the batch's own service time;
    SLO - T is what the latency budget leaves after the service.
    """
    if not arrival_rate > 0:
        raise BadRequest(f"arrival rate must be > 0, got {arrival_rate}")
    return max(0.0, min(slo - service_time, math.sqrt(service_time / arrival_rate)))


def max_batch_within_slo(
    service_time: ServiceTime, arrival_rate: float, slo: float, max_batch: int
) -> int:
    """The largest B <= max_batch with L(B) <= slo; 0 when not even B = 1 fits."""
    best = 0
    for batch in range(1, max_batch + 1):
        if batch_latency(batch, arrival_rate, service_time) <= slo:
            best = batch
    return best
