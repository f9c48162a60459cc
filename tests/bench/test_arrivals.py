import numpy as np
import pytest

from lockgate.bench.arrivals import arrival_schedule
from lockgate.errors import BadRequest


def test_poisson_mean_rate_and_exponential_gaps() -> None:
    schedule = arrival_schedule(1000.0, "poisson", duration=10.0, seed=7)
    assert len(schedule) == pytest.approx(10_000, rel=0.03)
    gaps = np.diff(schedule.offsets)
    assert gaps.mean() == pytest.approx(1e-3, rel=0.03)
    assert gaps.std() == pytest.approx(1e-3, rel=0.05)  # exponential: std == mean
    assert np.all(gaps >= 0) and schedule.offsets[0] == 0.0
    assert schedule.offsets[-1] < 10.0


def test_seeded_schedules_repeat() -> None:
    a = arrival_schedule(50.0, duration=2.0, seed=3)
    b = arrival_schedule(50.0, duration=2.0, seed=3)
    c = arrival_schedule(50.0, duration=2.0, seed=4)
    assert np.array_equal(a.offsets, b.offsets)
    assert not np.array_equal(a.offsets, c.offsets)


def test_constant_schedule_with_warmup_and_count() -> None:
    schedule = arrival_schedule(10.0, "constant", num_requests=25, warmup=1.0)
    assert schedule.warmup_count == 10
    assert len(schedule) == 35
    assert np.allclose(np.diff(schedule.offsets), 0.1)
    timed = arrival_schedule(10.0, "constant", duration=2.0, warmup=0.5)
    assert timed.warmup_count == 5 and len(timed) == 25


@pytest.mark.parametrize(
    "kwargs",
    [
        {"rate": 0.0, "duration": 1.0},
        {"rate": 1.0},
        {"rate": 1.0, "duration": 1.0, "num_requests": 3},
        {"rate": 1.0, "duration": 1.0, "arrival": "bursty"},
    ],
)
def test_bad_schedules_are_refused(kwargs: dict) -> None:
    with pytest.raises(BadRequest):
        arrival_schedule(**kwargs)
