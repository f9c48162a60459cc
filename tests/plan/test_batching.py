import math

import pytest

from lockgate.plan.batching import (
    batch_capacity,
    batch_latency,
    batch_window,
    max_batch_within_slo,
)


def t_of_b(batch: int) -> float:
    return 0.004 + 0.001 * batch  # T(B) = 4 ms + 1 ms per row


def test_latency_and_capacity() -> None:
    assert batch_latency(1, 100.0, t_of_b) == pytest.approx(0.005)
    assert batch_latency(9, 100.0, t_of_b) == pytest.approx(8 / 200 + 0.013)
    assert batch_capacity(8, t_of_b) == pytest.approx(8 / 0.012)


def test_window_is_min_of_slo_slack_and_sqrt_t_over_lambda() -> None:
    assert batch_window(0.004, 1000.0, 0.050) == pytest.approx(math.sqrt(0.004 / 1000))
    assert batch_window(0.040, 10.0, 0.050) == pytest.approx(0.010)  # SLO - T binds
    assert batch_window(0.060, 10.0, 0.050) == 0.0


def test_largest_batch_within_slo() -> None:
    # L(B) = (B - 1) / 200 + 0.004 + 0.001 B <= 0.02  =>  0.006 B <= 0.021  =>  B <= 3.5
    assert max_batch_within_slo(t_of_b, 100.0, 0.020, 32) == 3
    assert max_batch_within_slo(t_of_b, 100.0, 0.020, 2) == 2
    assert max_batch_within_slo(t_of_b, 100.0, 0.004, 32) == 0
