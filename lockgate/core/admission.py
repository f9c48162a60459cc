"""Deadline-aware admission: refuse at once what cannot finish in time.

From the measured service-time profile, the rows already queued ahead of a new request and
when each instance will be free, the batcher predicts when the request would finish. If that
prediction misses the request's deadline, the request is refused now with 503 and
Retry-After, instead of being queued to time out.

The prediction follows the batcher: queued rows leave in batches of the cap B*, each taking
T(B*), handed to instances as they free up. The request rides in batch k = ⌈(ahead+rows)/B*⌉;
with n instances whose next free times are f_0 ≤ f_1 ≤ … ≤ f_{n-1}, batch k starts at
about f_{(k-1) mod n} + ⌊(k-1)/n⌋·T(B*) and the request finishes T(its batch) later.
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
    # Admit when the predicted time to answer is within this share of the request's budget; the
    # rest pays for the network, the HTTP layer and the noise in T(B).
    slack: float = 0.8


@dataclass(frozen=True, slots=True)
class QueueState:
    """What admission needs to know about a batcher at one instant (times in seconds)."""

    rows_ahead: int  # rows queued at the request's priority level or higher
    cap: int  # the batch cap B* in rows
    free_at: tuple[float, ...]  # when each healthy instance takes its next batch, ascending
    capacity: float  # rows per second all instances serve at the cap


class Admission:
    def __init__(self, settings: AdmissionSettings, profile: ServiceProfile) -> None:
        self.settings = settings
        self.profile = profile

    def predicted_finish(self, request: InferRequest, now: float, queue: QueueState) -> float:
        """When the request would be answered if it joined the queue now."""
        if not queue.free_at:
            return now
        cap = max(1, queue.cap)
        rows = queue.rows_ahead + request.rows
        k = max(1, math.ceil(rows / cap))  # the request rides in the k-th batch
        n = len(queue.free_at)
        start = max(now, queue.free_at[(k - 1) % n]) + ((k - 1) // n) * self.profile.service_time(
            cap
        )
        own = min(cap, max(request.rows, rows - (k - 1) * cap))
        return start + self.profile.service_time(own)

    def check(self, request: InferRequest, now: float, queue: QueueState) -> Unavailable | None:
        """None to admit, or the refusal to raise."""
        if not self.settings.deadline_aware or request.deadline is None:
            return None
        if not self.profile.known or not queue.free_at:
            return None
        if request.soft_deadline and queue.rows_ahead == 0 and queue.free_at[0] <= now:
            return None  # nothing to wait for: the SLO default bounds waiting, not the model
        finish = self.predicted_finish(request, now, queue)
        budget = request.deadline - now
        if finish - now <= budget * self.settings.slack:
            return None
        return Unavailable(
            f"request would miss its deadline: predicted {(finish - now) * 1000:.1f} ms "
            f"with {queue.rows_ahead} rows queued ahead, budget {budget * 1000:.1f} ms",
            retry_after=self.retry_after(queue.rows_ahead, queue.capacity),
        )

    @staticmethod
    def retry_after(rows_queued: int, capacity: float) -> float:
        """Seconds until the rows queued now would be served (at least 1)."""
        if capacity <= 0 or math.isinf(capacity):
            return 1.0
        return max(1.0, rows_queued / capacity)
