"""The per-batch-size tally behind Triton's batch_stats."""

from __future__ import annotations

import pytest

from lockgate.core.batch_times import BatchTimes


def test_batches_are_tallied_by_size_smallest_first() -> None:
    times = BatchTimes()
    times.record(8, 0.001, 0.010, 0.002)
    times.record(2, 0.001, 0.004, 0.001)
    times.record(8, 0.003, 0.020, 0.002)
    assert [(rows, t.count) for rows, t in times.by_size()] == [(2, 1), (8, 2)]
    eight = times.sizes[8]
    assert (eight.input_seconds, eight.infer_seconds, eight.output_seconds) == pytest.approx(
        (0.004, 0.030, 0.004)
    )
    assert times.input_seconds == pytest.approx(0.005)
    assert times.output_seconds == pytest.approx(0.005)
