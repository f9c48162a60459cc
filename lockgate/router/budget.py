"""Retry and hedge budgets: extra attempts allowed as a share of recent requests.

Over a sliding window of `window` seconds, the extra attempts may be at most `ratio` times
the requests plus `floor` (so a quiet router can still retry). A brown-out then costs at most
that share of extra load, and never turns into a retry storm."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass(slots=True)
class Budget:
    ratio: float = 0.1
    floor: int = 10
    window: float = 10.0
    requests: deque[float] = field(default_factory=deque)
    spent: deque[float] = field(default_factory=deque)

    def request(self, now: float) -> None:
        self.requests.append(now)
        # here too: with nothing spent the window must still move on (the oldest request is
        # enough to look at: each call forgets what fell out of the window since the last)
        if self.requests[0] < now - self.window:
            self._forget(now)

    def try_spend(self, now: float) -> bool:
        """Take one extra attempt if the budget has it."""
        self._forget(now)
        if len(self.spent) >= self.ratio * len(self.requests) + self.floor:
            return False
        self.spent.append(now)
        return True

    def _forget(self, now: float) -> None:
        for times in (self.requests, self.spent):
            while times and times[0] < now - self.window:
                times.popleft()
