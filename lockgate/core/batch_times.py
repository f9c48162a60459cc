"""The batches a batcher ran, by size, with the time of each phase: Triton's `batch_stats`.

Recorded once per batch on the event loop (no lock); read when statistics are asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class PhaseTimes:
    """The batches of one size that ran, and their total time in each phase, in seconds."""

    count: int = 0
    input_seconds: float = 0.0  # gathering the requests' inputs into the batch
    infer_seconds: float = 0.0  # the model's run
    output_seconds: float = 0.0  # splitting the batch's outputs back to its requests


@dataclass(slots=True)
class BatchTimes:
    """Per batch size (rows) actually executed: its `PhaseTimes`."""

    sizes: dict[int, PhaseTimes] = field(default_factory=dict)

    def record(self, rows: int, input_s: float, infer_s: float, output_s: float) -> None:
        times = self.sizes.get(rows)
        if times is None:
            times = self.sizes[rows] = PhaseTimes()
        times.count += 1
        times.input_seconds += input_s
        times.infer_seconds += infer_s
        times.output_seconds += output_s

    def by_size(self) -> list[tuple[int, PhaseTimes]]:
        """(rows, times) of each size that ran, smallest first."""
        return sorted(self.sizes.items())

    @property
    def input_seconds(self) -> float:
        return sum(t.input_seconds for t in self.sizes.values())

    @property
    def output_seconds(self) -> float:
        return sum(t.output_seconds for t in self.sizes.values())
