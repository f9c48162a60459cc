"""Deadline-aware admission: refuse at once what cannot finish in time.

From the measured service-time profile and the rows already queued ahead of it, the batcher
predicts when a new request would finish. If that prediction misses the request's deadline,
the request is refused now with 503 and Retry-After, instead of being queued to time out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lockgate.core.request import InferRequest
from lockgate.core.slo import ServiceProfile
from lockgate.errors import Unavailable


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    deadline_aware: bool = True
    # Predictions are rough: refuse only when the predicted finish is this much past the deadline.
    slack: float = 1.0


class Admission:
    def __init__(self, settings: AdmissionSettings, profile: ServiceProfile) -> None:
        self.settings = settings
        self.profile = profile

    def predicted_finish(
        self, request: InferRequest, now: float, rows_ahead: int, capacity: float
    ) -> float:
        """now + time to serve the rows ahead + this request's own batch."""
        if capacity <= 0:
            return now
        own = self.profile.service_time(max(1, request.rows))
        return now + (rows_ahead + request.rows) / capacity + own

    def check(
        self, request: InferRequest, now: float, rows_ahead: int, capacity: float
    ) -> Unavailable | None:
        if not self.settings.deadline_aware or request.deadline is None or capacity <= 0:
            return None
        finish = self.predicted_finish(request, now, rows_ahead, capacity)
        budget = request.deadline - now
        if finish - now <= budget * self.settings.slack:
            return None
        return Unavailable(
            f"request would miss its deadline: predicted {(finish - now) * 1000:.1f} ms "
            f"with {rows_ahead} rows queued ahead, budget {budget * 1000:.1f} ms",
            retry_after=self.retry_after(rows_ahead, capacity),
        )

    @staticmethod
    def retry_after(rows_queued: int, capacity: float) -> float:
        if capacity <= 0 or math.isinf(capacity):
            return 1.0
        return max(1.0, rows_queued / capacity)
