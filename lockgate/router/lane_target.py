"""What the path of a lane request names (`lane.py`), resolved once per path: its model and
version, and the series its answers count on, made once per answer status: the label values
of the router's request counters, with a plain count of the answers not yet added to them
(`RouterApp` adds it on each scrape), and its latency histogram's tally."""

from __future__ import annotations

from dataclasses import dataclass, field

from lockgate.core.metrics import HistogramTally, LabelValues


@dataclass(slots=True)
class LaneSeries:
    """The series an answer of one status counts on."""

    status: LabelValues  # of lockgate_router_requests_total and ..._request_duration_seconds
    latency: HistogramTally  # lockgate_router_request_duration_seconds{status}
    model: LabelValues | None  # of lockgate_router_model_requests_total (None: not counted)
    answered: int = 0  # answers not yet added to the counters

    def taken(self) -> int:
        """The answers counted since the last call."""
        answered, self.answered = self.answered, 0
        return answered


@dataclass(slots=True)
class LaneTarget:
    path: str
    model: str
    version: str | None  # None: the path names none (the replica takes its newest)
    series: dict[int, LaneSeries] = field(default_factory=dict)  # by answer status
