"""Deadline-aware admission: refuse at once what cannot finish in time.

From the measured service-time profile, the rows already queued ahead of a new request and
when each instance will be free, the batcher predicts when the request would finish. If that
prediction misses the request's deadline, the request is refused now with 503 and
Retry-After, instead of being queued to time out.

The prediction follows the batcher: queued rows leave in batches of the cap B*, each taking
T(B*), handed to instances as they free up. The request rides in batch k = ⌈(ahead+rows)/B*⌉;
(the first batch, when it is not full, leaves no sooner than its batching window allows);
with n instances whose next free times are f_0 ≤ f_1 ≤ … ≤ f_{n-1}, batch k starts at
about f_{(k-1) mod n} + ⌊(k-1)/n⌋·T(B*) and the request finishes T(its batch) later: T(B*)
when it has to wait, since requests admitted after it join its batch until it leaves. Batches
of one size vary with their inputs: the profile's `tail` says how much longer a slow one runs
(1.5: half as long again), and the prediction adds (tail − 1) times the batches' times summed
in quadrature (the rest of the running batch, those ahead, its own), since a slow batch among
many is diluted and one alone is not.

The prediction is then checked against what happens: every admitted request records how much
longer it took than predicted. The calibration margin is a high quantile
(`calibration_quantile`, the 98th) of the last `calibration_window` such errors within the
last `calibration_horizon` seconds, never below zero, and is added to every prediction.
Whatever the profile misses (inputs whose cost varies, batches that vary around their mean,
the event loop's work between batches) shows up in the errors within a few hundred
requests, so admitted requests keep to their deadlines in the tail, not only on average.
(The profile's own scale follows a change of load as a whole; the margin covers the spread
around it.) Two kinds of error are not the prediction's to learn: those of predictions made
before traffic's first batches reshaped the profile (warmup's three words against real
sentences), which would keep a margin of 140 ms for two seconds after the profile had
learned; and the rows a burst added to a first batch planned to leave at once, which no
prediction made at the burst's front can see, and which the cap bounds.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field

from lockgate.core.request import InferRequest
from lockgate.core.slo import ServiceProfile
from lockgate.errors import Unavailable


@dataclass(frozen=True, slots=True)
class AdmissionSettings:
    deadline_aware: bool = True
    # Admit when the predicted time to answer is within this share of the request's budget; the
    # rest pays for the network, the HTTP layer and the noise in T(B).
    slack: float = 0.8
    calibration_window: int = 256  # admitted requests whose predictions are compared
    calibration_quantile: float = 0.98
    calibration_horizon: float = 2.0  # seconds an observed error counts


@dataclass(slots=True)
class QueueState:
    """What admission needs to know about a batcher at one instant (times in seconds)."""

    rows_ahead: int  # rows queued at the request's priority level or higher
    cap: int  # the batch cap B* in rows
    free_at: tuple[float, ...]  # when each healthy instance takes its next batch, ascending
    capacity: float  # rows per second all instances serve at the cap
    # When a batch that is not full may leave at the earliest: an idle instance holds a
    # partial batch until the oldest request's batching window is spent (0: it leaves at once)
    opens: float = 0.0


@dataclass(frozen=True, slots=True)
class Plan:
    """When a request joining the queue now would be answered, and the batch it would ride."""

    finish: float  # time.monotonic() seconds
    batch: int  # rows planned in its batch


@dataclass(frozen=True, slots=True)
class Admit:
    """An admitted request's prediction, which its answer is compared with."""

    predicted: float  # seconds from admission to the answer, the margin included
    margin: float  # the calibration margin in it
    batch: int  # rows planned in its batch


@dataclass(slots=True)
class Calibration:
    """How much longer than predicted recent admitted requests took, in seconds. Pure.

    Errors older than `horizon` seconds are forgotten: a margin learned in a transient (a
    process that started beside the server and stopped) must not outlive it, above all when
    that margin itself keeps requests from being admitted and observed."""

    window: int = 256
    quantile: float = 0.98
    horizon: float = 2.0
    errors: deque[tuple[float, float]] = field(default_factory=deque)  # (when, error)
    ordered: list[float] = field(default_factory=list)  # the same errors, ascending
    margin: float = 0.0  # the quantile, never below zero, kept current as errors arrive
    _since: int = 0

    def observe(self, predicted: float, observed: float, now: float) -> None:
        error = observed - predicted
        self.errors.append((now, error))
        bisect.insort(self.ordered, error)
        if len(self.errors) > self.window:
            self._drop_oldest()
        self._since += 1
        if self._since >= 8 or len(self.errors) < 32:  # refresh every few requests
            self._refresh()

    def clear(self) -> None:
        self.errors.clear()
        self.ordered.clear()
        self.margin = 0.0
        self._since = 0

    def current(self, now: float) -> float:
        """The margin, once errors past the horizon are dropped."""
        if self.errors and self.errors[0][0] < now - self.horizon:
            while self.errors and self.errors[0][0] < now - self.horizon:
                self._drop_oldest()
            self._refresh()
        return self.margin

    def _drop_oldest(self) -> None:
        _, error = self.errors.popleft()
        ordered = self.ordered
        i = bisect.bisect_left(ordered, error)
        if i < len(ordered) and ordered[i] == error:
            del ordered[i]
        else:  # NaN, which sorts nowhere: the very object
            ordered.remove(error)

    def _refresh(self) -> None:
        self._since = 0
        ordered = self.ordered  # kept sorted as errors come and go: no sort here
        if not ordered:
            self.margin = 0.0
            return
        q = ordered[min(len(ordered) - 1, int(self.quantile * len(ordered)))]
        self.margin = max(0.0, q)


class Admission:
    def __init__(self, settings: AdmissionSettings, profile: ServiceProfile) -> None:
        self.settings = settings
        self.profile = profile
        self.calibration = Calibration(
            settings.calibration_window,
            settings.calibration_quantile,
            settings.calibration_horizon,
        )
        self._reshaped = 0.0  # the profile's last reshape the calibration has forgotten

    def predicted_finish(self, request: InferRequest, now: float, queue: QueueState) -> float:
        """When the request would be answered if it joined the queue now."""
        return self.plan(request.rows, now, queue).finish

    def plan(self, rows: int, now: float, queue: QueueState) -> Plan:
        if not queue.free_at:
            return Plan(now, rows)
        cap = max(1, queue.cap)
        rows += queue.rows_ahead
        k = max(1, math.ceil(rows / cap))  # the request rides in the k-th batch
        n = len(queue.free_at)
        free = queue.free_at[(k - 1) % n]
        ahead = (k - 1) // n  # full batches between that instance's next and its own
        profile = self.profile
        t_cap = profile.service_time(cap)
        # The running batch's rest varies with its inputs; a window held open does not.
        waiting = max(0.0, free - now)
        if k == 1 and queue.opens > free:  # its batch, not full, is held for its window
            free = queue.opens
        # If it waits, requests admitted after it join its batch until the batch leaves, so
        # the batch it rides in is planned full; if not, it is the first batch: all it holds.
        batch = cap if k > 1 or free > now else rows
        own = t_cap if batch == cap else profile.service_time(rows)
        # Planned as slow batches: each runs up to `tail` times the typical, and the excess of
        # several independent batches adds in quadrature (a long queue averages it out).
        spread = math.sqrt(waiting * waiting + ahead * t_cap * t_cap + own * own)
        finish = max(now, free) + ahead * t_cap + own + (profile.tail - 1.0) * spread
        return Plan(finish, batch)

    def check(
        self, request: InferRequest, now: float, queue: QueueState, delay: float = 0.0
    ) -> Unavailable | None:
        """None to admit, or the refusal to raise. `delay`: seconds before the request reaches
        the queue (`queue` is the state it will find then). An admitted request keeps the
        prediction (`predicted`, `margin`) its answer is compared with."""
        if request.deadline is None:
            return None
        verdict = self.verdict(
            request.deadline, request.soft_deadline, request.rows, now, queue, delay
        )
        if isinstance(verdict, Unavailable):
            return verdict
        if verdict is not None:
            request.predicted, request.margin = verdict.predicted, verdict.margin
            request.planned_rows = verdict.batch
        return None

    def verdict(
        self,
        deadline: float,
        soft_deadline: bool,
        rows: int,
        now: float,
        queue: QueueState,
        delay: float = 0.0,
    ) -> Unavailable | Admit | None:
        """`check` on a request's deadline and rows alone: the refusal; or, admitted, its
        prediction (None: admitted with no prediction to make)."""
        if not self.settings.deadline_aware:
            return None
        if not self.profile.known or not queue.free_at:
            return None
        if self.profile.reshaped > self._reshaped:  # errors of predictions since remade
            self._reshaped = self.profile.reshaped
            self.calibration.clear()
        margin = self.calibration.current(now)
        plan = self.plan(rows, now + delay, queue)
        predicted = plan.finish - now + margin
        budget = deadline - now
        idle = queue.rows_ahead == 0 and queue.free_at[0] <= now
        if predicted <= budget * self.settings.slack or (soft_deadline and idle):
            # admitted; an idle model admits a request under its SLO default whatever the
            # prediction (the default bounds waiting, not the model), and learns from it
            return Admit(predicted, margin, plan.batch)
        return Unavailable(
            f"request would miss its deadline: predicted {predicted * 1000:.1f} ms "
            f"(margin {margin * 1000:.1f} ms, scale {self.profile.scale:.2f}) with "
            f"{queue.rows_ahead} rows queued ahead, budget {budget * 1000:.1f} ms",
            retry_after=self.retry_after(queue.rows_ahead, queue.capacity),
        )

    def answered(self, request: InferRequest, now: float) -> None:
        """An admitted request was answered: compare the time it took with its prediction,
        made again for the batch it rode in when that held more rows than planned.

        Only a request planned to leave at once in the first batch (all it saw queued) can
        ride a larger batch: when a burst arrives in one loop turn, or while the batch is held
        for its window, the burst's first requests cannot see the rest coming. That batch
        still stays within the cap, which the SLO bounds; counted as the prediction's error,
        the burst would add its front's wait to every later prediction, and a closed loop
        that comes back all at once (perf_analyzer's) would be refused near its deadline
        while its answers take well under it."""
        if request.predicted > 0 and request.admitted >= self.profile.reshaped:
            raw = request.predicted - request.margin
            if request.batch_rows > request.planned_rows > 0:
                service = self.profile.service_time
                raw += service(request.batch_rows) - service(request.planned_rows)
            self.calibration.observe(raw, now - request.admitted, now)

    @staticmethod
    def retry_after(rows_queued: int, capacity: float) -> float:
        """Seconds until the rows queued now would be served (at least 1)."""
        if capacity <= 0 or math.isinf(capacity):
            return 1.0
        return max(1.0, rows_queued / capacity)
