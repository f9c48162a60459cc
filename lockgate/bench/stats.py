"""Percentiles and latency summaries, pure and small."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), interpolated linearly between order statistics.

    Matches numpy's default ("linear") method. NaN for no values.
    """
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Summary:
    """Distribution of one quantity, in milliseconds when it is a time."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float], scale: float = 1.0) -> Summary:
        """Summarize `values`, each multiplied by `scale` (1e3 turns seconds into ms)."""
        scaled = sorted(v * scale for v in values)
        if not scaled:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan, nan)
        return cls(
            count=len(scaled),
            mean=sum(scaled) / len(scaled),
            p50=percentile(scaled, 50),
            p90=percentile(scaled, 90),
            p95=percentile(scaled, 95),
            p99=percentile(scaled, 99),
            max=scaled[-1],
        )
