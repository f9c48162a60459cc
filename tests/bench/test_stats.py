import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lockgate.bench.stats import Summary, percentile


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy_linear(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-6)


def test_percentile_edges() -> None:
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([1.0, 2.0], 0) == 1.0 and percentile([1.0, 2.0], 100) == 2.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summary_scales_and_orders() -> None:
    values = [i / 1000 for i in range(1, 101)]  # 1..100 ms in seconds
    summary = Summary.of(values, 1e3)
    assert summary.count == 100
    assert summary.p50 == pytest.approx(50.5)
    assert summary.p99 == pytest.approx(99.01)
    assert summary.max == pytest.approx(100.0)
    assert summary.mean == pytest.approx(50.5)
    assert summary.p50 <= summary.p90 <= summary.p95 <= summary.p99 <= summary.max
    assert Summary.of([]).count == 0 and math.isnan(Summary.of([]).p50)
