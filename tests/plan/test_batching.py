import heapq
import math
from collections import deque

import numpy as np
import pytest

from lockgate.errors import BadRequest
from lockgate.plan.batching import (
    BatchQueue,
    batch_capacity,
    batch_latency,
    batch_window,
    max_batch_within_slo,
)
from lockgate.plan.queueing import MG1, ServiceDistribution


def t_of_b(batch: int) -> float:
    return 0.004 + 0.001 * batch  # T(B) = 4 ms + 1 ms per row


def test_latency_and_capacity() -> None:
    assert batch_latency(1, 100.0, t_of_b) == pytest.approx(0.005)
    assert batch_latency(9, 100.0, t_of_b) == pytest.approx(8 / 200 + 0.013)
    assert batch_capacity(8, t_of_b) == pytest.approx(8 / 0.012)


def test_window_follows_the_slo_batchers_rule() -> None:
    # lambda T(1) < 1: one-row service keeps up, so an idle instance does not wait
    assert batch_window(0.004, 0.010, 200.0, 0.050) == 0.0
    # above it: min(0.8 SLO - 2 T(B*), sqrt(T(1) / lambda)), 0.8 the share admission plans in
    assert batch_window(0.004, 0.010, 1000.0, 0.050) == pytest.approx(math.sqrt(0.004 / 1000))
    assert batch_window(0.004, 0.020, 1000.0, 0.05125) == pytest.approx(0.001)  # 0.8 SLO binds
    assert batch_window(0.004, 0.030, 1000.0, 0.050) == 0.0


def test_largest_batch_within_slo() -> None:
    # L(B) = (B - 1) / 200 + 0.004 + 0.001 B <= 0.02  =>  0.006 B <= 0.021  =>  B <= 3.5
    assert max_batch_within_slo(t_of_b, 100.0, 0.020, 32) == 3
    assert max_batch_within_slo(t_of_b, 100.0, 0.020, 2) == 2
    assert max_batch_within_slo(t_of_b, 100.0, 0.004, 32) == 0


@pytest.mark.parametrize(("rho", "cv"), [(0.3, 0.0), (0.7, 0.0), (0.5, 0.5), (0.7, 1.0)])
def test_batch_queue_without_batching_is_mg1(rho: float, cv: float) -> None:
    """max_batch 1: the batcher is a plain M/G/1 queue, whose p99 is known exactly."""
    queue = BatchQueue(rho / 0.01, 0.0, 0.01, 1, cv)
    exact = MG1(rho / 0.01, ServiceDistribution(0.01, cv)).response_quantile(0.99)
    assert queue.response_quantile(0.99) == pytest.approx(exact, rel=0.05)


def test_batch_queue_idle_start_is_mg1_with_an_exceptional_first_service() -> None:
    first = ServiceDistribution(0.014, 0.3 * 0.01 / 0.014)  # the same stall, 4 ms more fixed
    queue = BatchQueue(60.0, 0.0, 0.01, 1, 0.3, first_service=first)
    exact = MG1(60.0, ServiceDistribution(0.01, 0.3), first).response_quantile(0.99)
    assert queue.response_quantile(0.99) == pytest.approx(exact, rel=0.05)


def simulate_batcher(queue: BatchQueue, arrivals: int, seed: int) -> np.ndarray:
    """An event-driven batcher written apart from BatchQueue: events on a heap, a FIFO queue,
    an instance that takes up to max_batch queued rows when free (after the window)."""
    rng = np.random.default_rng(seed)
    times = np.cumsum(rng.exponential(1 / queue.arrival_rate, arrivals)).tolist()
    factors = iter(ServiceDistribution(1.0, queue.cv).sample(rng, arrivals).tolist())
    events = [
        (t, 1, i) for i, t in enumerate(times)
    ]  # (time, kind, row): 0 free, 1 arrive, 2 timer
    heapq.heapify(events)
    waiting: deque[int] = deque()
    busy, timer_for, answered = False, -1, [0.0] * arrivals
    while events:
        now, kind, row = heapq.heappop(events)
        if kind == 0:
            busy = False
        elif kind == 1:
            waiting.append(row)
        window_done = waiting and now >= times[waiting[0]] + queue.window_s - 1e-12
        if not busy and waiting and (len(waiting) >= queue.max_batch or window_done):
            batch = [waiting.popleft() for _ in range(min(queue.max_batch, len(waiting)))]
            end = now + queue.service_time(len(batch)) * next(factors)
            for member in batch:
                answered[member] = end
            busy = True
            heapq.heappush(events, (end, 0, -1))
        elif not busy and waiting and timer_for != waiting[0]:
            timer_for = waiting[0]
            heapq.heappush(events, (times[waiting[0]] + queue.window_s, 2, -1))
    return (np.asarray(answered) - np.asarray(times))[arrivals // 50 :]


@pytest.mark.parametrize("window", [0.0, 0.003])
def test_batch_queue_matches_an_event_driven_simulation(window: float) -> None:
    """T(B) = 4 ms + 1 ms per row, cap 8, at 70% of one-row capacity, with and without a window."""
    queue = BatchQueue(140.0, 0.004, 0.001, 8, 0.3, window)
    ours = queue.response_times(100_000, seed=3)
    theirs = simulate_batcher(queue, 100_000, seed=3)
    for q in (0.5, 0.9, 0.99):
        assert np.quantile(ours, q) == pytest.approx(np.quantile(theirs, q), rel=1e-9)
    # batching serves 70% of one-row capacity with room to spare: far below M/G/1 at 1 row
    one_row = MG1(140.0, ServiceDistribution(0.005, 0.3)).response_quantile(0.99)
    assert np.quantile(ours, 0.99) < one_row


def test_batch_queue_refuses_an_unstable_load() -> None:
    with pytest.raises(BadRequest, match="unstable"):
        BatchQueue(1000.0, 0.004, 0.001, 4, 0.0)  # capacity 4 / 8 ms = 500 rows/s
