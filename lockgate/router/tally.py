"""Counts taken on the request path and added to their Prometheus counter when it is read (a
scrape, or `values`): a dict increment per request instead of the counter's own update, whose
lock and checks cost more than the rest of the bookkeeping of a proxied request."""

from __future__ import annotations

from lockgate.core.metrics import Counter, LabelValues


class Tally:
    __slots__ = ("counter", "pending")

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.pending: dict[LabelValues, float] = {}

    def inc(self, labels: LabelValues = (), amount: float = 1.0) -> None:
        pending = self.pending
        pending[labels] = pending.get(labels, 0.0) + amount

    def flush(self) -> None:
        """Add what was counted since the last flush to the counter."""
        pending, self.pending = self.pending, {}
        for labels, amount in pending.items():
            self.counter.inc(labels, amount)

    def values(self) -> dict[LabelValues, float]:
        self.flush()
        return self.counter.values()
