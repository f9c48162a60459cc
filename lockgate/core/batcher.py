"""The dynamic batcher: one per served model version.

Requests wait in bounded queues, one per priority level. A batch leaves when an instance is
free and either the batch is full or the oldest request's window is spent. The batcher waits
on events, never by polling. With `latency_slo_ms` the window and the batch cap come from the
model's measured profile T(B) (see `lockgate/core/slo.py`); otherwise from
`max_queue_delay_us` and `max_batch_size`, as in Triton.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from lockgate.backends.base import Answer
from lockgate.config import ModelConfig
from lockgate.core.admission import Admission, AdmissionSettings, QueueState
from lockgate.core.batch_times import BatchTimes
from lockgate.core.request import Arrays, InferRequest
from lockgate.core.runner import Instance
from lockgate.core.serving_metrics import ServingMetrics
from lockgate.core.slo import RateMeter, ServiceProfile, batch_window
from lockgate.errors import (
    BackendError,
    BadRequest,
    DeadlineExceeded,
    ServingError,
    Unavailable,
)

log = logging.getLogger("lockgate.batcher")

Signature = tuple[tuple[str, tuple[int, ...], str], ...]


def signature(
    request: InferRequest, batching: bool, ragged: frozenset[str] = frozenset()
) -> Signature:
    """Requests with equal signatures can share a batch: same inputs, same non-batch shapes
    but for the `ragged` inputs (Triton's `allow_ragged_batch`, for a model that takes each
    request on its own). A request that must run alone has a signature of its own."""
    if request.alone:
        return ((f"#alone-{request.seq}", (), ""),)
    skip = 1 if batching else 0
    if ragged:
        return tuple(
            sorted(
                (name, () if name in ragged else tuple(a.shape[skip:]), a.dtype.str)
                for name, a in request.inputs.items()
            )
        )
    return tuple(
        sorted((name, tuple(a.shape[skip:]), a.dtype.str) for name, a in request.inputs.items())
    )


def batch_bytes(inputs: Arrays) -> int:
    """Input bytes of a batch; BYTES tensors count their items' lengths."""
    total = 0
    for array in inputs.values():
        if array.dtype == object:
            total += sum(len(item) if isinstance(item, bytes | str) else 8 for item in array.flat)
        else:
            total += array.nbytes
    return total


@dataclass(slots=True)
class Batch:
    requests: list[InferRequest]
    rows: int
    formed: float = field(default_factory=time.monotonic)
    started: float = 0.0  # when an instance took it

    def inputs(self, batching: bool) -> Arrays:
        first = self.requests[0].inputs
        if len(self.requests) == 1 or not batching:
            return first
        # [sum(rows), ...] per input, in request order
        return {name: np.concatenate([r.inputs[name] for r in self.requests]) for name in first}

    def matched(self, answers: list[Answer]) -> list[Answer]:
        """The answers of a backend that took the batch request by request, one each."""
        if len(answers) != len(self.requests):
            raise BackendError(
                f"model answered a batch of {len(self.requests)} requests with "
                f"{len(answers)} answers"
            )
        return answers

    def split(self, outputs: Arrays, batching: bool) -> list[Arrays]:
        if len(self.requests) == 1:
            return [outputs]
        for name, array in outputs.items():
            if array.ndim == 0 or array.shape[0] != self.rows:
                got = "a scalar" if array.ndim == 0 else f"{array.shape[0]} rows"
                raise BackendError(
                    f"model returned {got} in output '{name}' for a batch of {self.rows} rows; "
                    "a batching model must return the batch dimension first"
                )
        parts: list[Arrays] = []
        start = 0
        for request in self.requests:
            stop = start + request.rows
            parts.append({name: array[start:stop] for name, array in outputs.items()})
            start = stop
        return parts


@dataclass(slots=True)
class NextTurn:
    """Whether a batch cheap enough for the event loop is worth forming on the loop's next
    turn rather than at once. Pure: the caller gives times.

    Formed on the next turn, a batch takes every request that arrived in the same turn and
    shares the per-batch cost; it also waits for the rest of the turn and the next one's
    reads. With 32 connections on digits_onnx that wait is a millisecond or two and the batch
    holds about 11 rows; in a retry storm a turn is thousands of refusals, and waiting for it
    made the admitted requests late, so admission refused nearly everything. So the wait is
    measured, and the next turn is taken only while it stays under `share` of the SLO. So is
    the company it gathers: a client sending one request at a time finds nobody to batch
    with, and its request waiting a turn would cost two more turns of the loop (the batcher's
    task, then its own handler's) for a batch of one; the next turn is taken only while the
    batches formed there hold `least_company` requests or more on average; a batch alone is
    measured again after `alone_stale_s`, so that a burst of lone batches under load does not
    keep the next ones apart for long. A measure older than `stale_s` is taken again (one
    request waits a turn to tell)."""

    share: float = 0.1  # of the SLO a turn's wait may take
    least_company: float = 1.5  # requests a batch formed on the next turn must hold, on average
    stale_s: float = 1.0
    alone_stale_s: float = 0.05
    weight: float = 0.3  # of a new measure in the running average
    wait: float = 0.0  # seconds from a deferred request to its batch's start, on average
    company: float = 1.0  # requests in a batch formed for a deferred request, on average
    measured: float = -math.inf  # when `wait` and `company` were last measured
    since: float | None = None  # when the oldest request now deferred was

    def worth_it(self, now: float, slo: float | None) -> bool:
        if slo is None:  # no SLO to spend: a batch at once, as `max_queue_delay_us: 0` asks
            return False
        age = now - self.measured
        if age > self.stale_s:
            return True
        if self.wait > self.share * slo:
            return False
        return self.company >= self.least_company or age > self.alone_stale_s

    def deferred(self, now: float) -> None:
        if self.since is None:
            self.since = now

    def formed(self, now: float, requests: int) -> None:
        """A batch of `requests` is formed: what the deferred request at its head waited, and
        the company it found."""
        if self.since is not None:
            self.wait += self.weight * (now - self.since - self.wait)
            self.company += self.weight * (requests - self.company)
            self.measured, self.since = now, None


@dataclass(slots=True)
class Arriving:
    """Requests the front end has handed to the event loop, per model, whose handlers have
    not yet started. Pure counting: the front end adds one when it creates a request's task
    and takes it back when that task starts (or ends without starting).

    The handlers of requests read in one loop turn all start on the next turn, one after
    another. While some of a model's are still to start, a cheap batch is not run at once
    for the first one: each is queued, and the last to reach the batcher runs them all,
    batch after batch, before the turn ends. Under load that turns one batch per request
    into one per turn without waiting a turn more (`NextTurn` waits one); a handler that
    never reaches its batcher (a bad request, a disconnect) leaves the others to the
    batcher's task on the next turn."""

    pending: dict[str, int] = field(default_factory=dict)

    def add(self, model: str) -> None:
        self.pending[model] = self.pending.get(model, 0) + 1

    def started(self, model: str) -> None:
        left = self.pending.get(model, 0) - 1
        if left > 0:
            self.pending[model] = left
        else:
            self.pending.pop(model, None)


EARLY_REFUSAL_REUSE_S = 0.001


@dataclass(slots=True)
class EarlyAdmit:
    """An early admission with room to spare, given again until `until` to requests with the
    same time budget that are no later than `most_late` (their event-loop work ahead plus the
    time they have already spent): it was predicted to answer within `EARLY_ADMIT_SHARE` of
    its budget, so a millisecond's new arrivals do not make it late. Passing a head on
    decides nothing: the full admission check still runs once the body is read. Under steady
    load this makes most early checks a comparison."""

    budget: float
    until: float
    most_late: float

    def holds(self, budget: float, now: float, late: float) -> bool:
        return budget == self.budget and now < self.until and late <= self.most_late


EARLY_ADMIT_SHARE = 0.5  # of its budget, the most an early admission may predict to be reused


@dataclass(slots=True)
class EarlyRefusal:
    """An early refusal, given again to requests with the same time budget until `until`
    or until a batch starts or ends, whichever is first: between those, what admission
    predicts only moves by the time passed, under a millisecond. It is given only to
    requests at least as late: with at least its `loop_wait` ahead and at least its `spent`
    seconds already gone (a request read after a paused connection's wait is refused for
    that wait, and a fresh one after it must be predicted for itself). Under overload this
    makes most refusals a comparison, not a prediction."""

    budget: float
    until: float
    verdict: Unavailable
    loop_wait: float = 0.0
    spent: float = 0.0

    def holds(self, budget: float, now: float, loop_wait: float, spent: float) -> bool:
        return (
            budget == self.budget
            and now < self.until
            and loop_wait >= self.loop_wait
            and spent >= self.spent
        )


@dataclass(frozen=True, slots=True)
class CapPolicy:
    """What the batch cap and the batching window come from, as the profile stands at one
    `version`: asked several times for every request (admission, the fast path, the end of
    a batch), it changes only when a batch changes the profile. Pure: the window still
    follows the arrival rate (`Batcher._window`)."""

    version: int  # of the profile this was derived from
    cap: int  # the batch cap B* in rows, within max_batch_size
    capacity: float  # rows per second all instances serve at the cap (0.0: not known)
    by_rate: bool  # the window follows the arrival rate (an SLO and a measured profile)
    fixed: float = 0.0  # else the window, seconds: `max_queue_delay_us`
    t1: float = 0.0  # T(1), seconds
    room: float = 0.0  # the longest window: the budget less 2·T(B*) of the uncapped B*


class Batcher:
    """Admission, queueing and batch formation for one model version."""

    def __init__(
        self,
        config: ModelConfig,
        version: int,
        instances: list[Instance],
        metrics: ServingMetrics,
        profile: ServiceProfile,
        admission: AdmissionSettings | None = None,
        arriving: Arriving | None = None,
    ) -> None:
        self.config = config
        self.version = version
        self.instances = instances
        self.metrics = metrics
        self.profile = profile  # occupancy: dispatch to release, as the queue sees it
        # compute alone, timed on the instance's thread: decides what may run inline
        self.compute = ServiceProfile(profile.max_batch_size, times=dict(profile.times))
        self.compute.refit()
        self.labels = (config.name, str(version))
        self.slo = config.latency_slo_ms / 1000.0 if config.latency_slo_ms else None  # seconds
        settings = config.batcher
        self.levels = max(1, settings.priority_levels)
        default_level = settings.default_priority_level or self.levels
        self.default_level = min(max(default_level, 1), self.levels)
        self.queues: list[deque[InferRequest]] = [deque() for _ in range(self.levels)]
        self.queued_rows = 0
        self.max_queue_rows = settings.max_queue_size
        # inputs whose shapes may differ within a batch: for a model that takes each request
        # on its own (a Triton Python model), those with Triton's `allow_ragged_batch`
        per_request = any(i.per_request for i in instances)
        self.ragged = frozenset(
            s.name for s in config.inputs if s.allow_ragged_batch and per_request
        )
        self.free: deque[Instance] = deque(instances)
        self.running: dict[Instance, Batch] = {}  # the batch each busy instance runs
        self._back_to_back: dict[Instance, tuple[float, int]] = {}  # start, rows of last batch
        self.rate = RateMeter()
        admitting = admission or AdmissionSettings()
        if config.admission_slack is not None:
            admitting = replace(admitting, slack=config.admission_slack)
        self.admission = Admission(admitting, profile)
        self.accepting = True
        self.times = BatchTimes()  # batches run, by size, and their phase times
        self.inline_seconds = float(config.parameters.get("inline_max_us", "150")) / 1e6
        self.inline_bytes: dict[int, int] = {}  # rows -> largest input bytes timed cheap
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._inflight = 0
        self._idle = asyncio.Event()
        self._refused: EarlyRefusal | None = None  # the last early refusal, while it holds
        # the series an early refusal counts on, as tallies (it is asked on the loop's thread):
        # under overload most requests are early refusals (admission's verdict is Unavailable)
        self._unmeetable = metrics.rejected.tally((*self.labels, "deadline_unmeetable"))
        self._unavailable = metrics.requests.tally((*self.labels, Unavailable.kind))
        # and those every answered request counts on, on the loop's thread too
        self._succeeded = metrics.requests.tally((*self.labels, "success"))
        self._answered_latency = metrics.request_latency.tally(self.labels)
        self._queued_latency = metrics.queue_latency.tally(self.labels)
        self._computed_latency = metrics.compute_latency.tally(self.labels)  # and every batch
        self._batch_rows = metrics.batch_size.tally(self.labels)
        self._batches = metrics.batches.tally(self.labels)
        self._admitting: EarlyAdmit | None = None  # the last early admission with room
        self._policy: CapPolicy | None = None  # of the profile's current version
        # (deadline, seq, request) of requests not yet answered, or answered since the timer
        # last passed them; one timer, armed for the earliest (`_watch`)
        self._deadlines: list[tuple[float, int, InferRequest]] = []
        self._deadline_timer: asyncio.TimerHandle | None = None
        self._armed = math.inf  # the deadline the timer is armed for
        self.next_turn = NextTurn()  # whether a cheap batch waits for the loop's next turn
        self.arriving = arriving or Arriving()  # handlers read this turn, not yet started
        self._gathering = False  # queued for the last of this turn's arrivals to send
        self._idle.set()
        self._depth_fn = lambda: float(self.queued_rows)
        self._inflight_fn = lambda: float(self._inflight)
        metrics.queue_depth.set_function(self.labels, self._depth_fn)
        metrics.inflight.set_function(self.labels, self._inflight_fn)

    def warmed(self, input_bytes: dict[int, int]) -> None:
        """Warmup timed batches of these sizes (rows -> their inputs' bytes) on an instance's
        thread: those that were cheap may run inline from the first request, with inputs no
        bigger, as if traffic had timed them."""
        if not any(i.inline_safe for i in self.instances):
            return
        for rows, size in input_bytes.items():
            if self.compute.times.get(rows, math.inf) <= self.inline_seconds:
                self.inline_bytes[rows] = max(self.inline_bytes.get(rows, 0), size)

    # -- policy ------------------------------------------------------------------------
    def cap_and_window(self, now: float) -> tuple[int, float]:
        """The batch cap in rows and how long an idle instance may wait for it to fill."""
        policy = self.cap_policy()
        return policy.cap, self._window(policy, now)

    def _window(self, policy: CapPolicy, now: float) -> float:
        """`policy`'s window at the arrival rate now (read only where the window follows it)."""
        if not policy.by_rate:
            return policy.fixed
        return batch_window(policy.t1, policy.room, self.rate.current(now))

    def cap_policy(self) -> CapPolicy:
        """The cap, the capacity and the window's terms, derived again only when the profile
        has changed since they were."""
        profile = self.profile
        policy = self._policy
        version = profile.version  # before what is derived from it
        if policy is not None and policy.version == version:
            return policy
        max_rows = max(1, self.config.max_batch_size)
        slo = self.slo
        if slo is not None and profile.known:
            if self.admission.settings.deadline_aware:  # a full batch waits behind a full
                slo *= self.admission.settings.slack  # batch and is still admitted
            best = profile.batch_cap(slo)
            cap = min(max_rows, best)
            room = slo - 2 * profile.service_time(best)
            capacity = profile.throughput(cap) * len(self.instances)
            policy = CapPolicy(version, cap, capacity, True, t1=profile.service_time(1), room=room)
        else:
            capacity = profile.throughput(max_rows) * len(self.instances) if profile.known else 0.0
            fixed = self.config.batcher.max_queue_delay_us / 1e6
            policy = CapPolicy(version, max_rows, capacity, False, fixed)
        self._policy = policy
        return policy

    def level_of(self, request: InferRequest) -> int:
        if request.priority <= 0:
            return self.default_level
        return min(request.priority, self.levels)

    # -- intake ------------------------------------------------------------------------
    async def submit(self, request: InferRequest) -> Arrays:
        """Admit, queue and wait for the answer. Raises a ServingError on refusal or failure."""
        now = time.monotonic()
        request.arrival = min(request.arrival, now)  # the front end may have stamped it earlier
        slo = self.slo
        if request.deadline is None and slo is not None:
            request.deadline = request.arrival + slo  # the SLO is the default deadline
            request.soft_deadline = True
        try:
            self._admit(request, now)
        except ServingError:
            self._last_of_turn(now)  # refused: the requests gathered before it go now
            raise
        loop = asyncio.get_running_loop()
        request.future = loop.create_future()
        self.rate.add(request.rows, now)
        self._inflight += 1
        self._idle.clear()
        if self._dispatch_now(request, now):
            pass
        else:
            self.queues[self.level_of(request) - 1].append(request)
            self.queued_rows += request.rows
            if not self._last_of_turn(now):
                self._wake.set()
        if request.deadline is not None and not request.future.done():
            # Answer 504 at the deadline itself, not when the batcher next looks at the queue.
            self._watch(request, request.deadline, loop, now)
        try:
            result = await request.future
        except asyncio.CancelledError:
            self._forget(request)
            self._count("cancelled")
            raise
        except ServingError as exc:
            if isinstance(exc, DeadlineExceeded):  # at least this late: a lower bound counts
                self.admission.answered(request, time.monotonic())
            self._count(exc.kind)
            raise
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()
        self._succeeded.count += 1
        done = time.monotonic()
        self.admission.answered(request, done)
        self._answered_latency.observe(done - request.arrival, request.trace_id)
        return result

    def _dispatch_now(self, request: InferRequest, now: float) -> bool:
        """The fast path: nothing queued, an instance idle and no window to wait for. The
        request starts at once.

        A batch cheap enough to run on the event loop is queued instead while the loop's
        turns are short (`NextTurn`), for the batcher's task to form on the loop's next turn:
        with no window it waits for nothing, yet takes every request that arrived in the same
        turn. Run at once, each would be a batch of its own, and under load the per-batch cost
        then takes the core: digits_onnx at 32 connections ran batches of 1 row at about
        255 µs of CPU per request, against about 170 µs for batches of 11 formed on the next
        turn (docs/dynamic-batching.md)."""
        if self.queued_rows or not self.free or self._task is None:
            return False
        cap, window = self.cap_and_window(now)
        if window > 0 and request.rows < cap:
            return False
        batch = Batch([request], request.rows)
        if request.rows < cap and self._inline(self.free[0], batch):
            if self.config.name in self.arriving.pending:
                self._gathering = True  # the last of this turn's arrivals sends the batch
                return False
            if self.next_turn.worth_it(now, self.slo):
                self.next_turn.deferred(now)
                return False
        self._start(self.free.popleft(), batch)
        return True

    def _last_of_turn(self, now: float) -> bool:
        """Run the batch the requests of this loop turn gathered (`Arriving`) once the last
        of them is queued; False when it is not the last, or another rule holds the queue
        (an instance busy, a batching window)."""
        if not self._gathering or self.config.name in self.arriving.pending or not self.free:
            return False
        self._gathering = False
        cap, window = self.cap_and_window(now)
        if self._held_until(cap, window, now) > now:
            return False
        # No more rows than have run inline (warmup's sizes, or traffic's): a bigger batch
        # would go to the thread, and on a busy loop its answer waits a turn for the loop to
        # take it back. More than one batch's worth runs now, batch after batch: left to the
        # next turn, the batches would be timed back to back across the turn, and the turn
        # taken for their cost.
        rows = min(cap, max(self.inline_bytes, default=1))
        started = False
        while self.queued_rows and self.free:
            batch = self._form(rows, now)
            if batch is None:
                break
            self._start(self.free.popleft(), batch)
            started = True
        if self.queued_rows:  # an instance busy on its thread: the batcher's task goes on
            self._wake.set()
        return started

    def _admit(self, request: InferRequest, now: float) -> None:
        if not self.accepting:
            self._reject("draining", Unavailable("model is shutting down", retry_after=1))
        if request.expired(now):
            self._reject("deadline", DeadlineExceeded("request deadline passed before admission"))
        level = self.level_of(request)
        while self.queued_rows + request.rows > self.max_queue_rows:
            victim = self._lowest_below(level)
            if victim is None:
                self._reject(
                    "queue_full",
                    Unavailable(
                        f"queue of model '{self.config.name}' is full "
                        f"({self.max_queue_rows} rows, max_queue_size)",
                        retry_after=self.admission.retry_after(
                            self.queued_rows, self.cap_policy().capacity
                        ),
                    ),
                )
                break
            self._shed(victim)
        request.admitted = now
        verdict = self.admission.check(request, now, self.queue_state(level, now))
        if verdict is not None:
            self._reject("deadline_unmeetable", verdict)

    def early_refusal(
        self, arrival: float, timeout: float | None, now: float, loop_wait: float = 0.0
    ) -> Unavailable | None:
        """The refusal a one-row request of the highest priority would get now, asked before
        its body is read: None when the model would admit it, or has no deadline to go by (no
        `timeout` and no SLO). Its handler reaches the batcher after `loop_wait` seconds of
        the event loop's work ahead of it; an idle model with none ahead always admits. A
        refusal is counted as admission would count it."""
        idle = not self.queued_rows and self.free
        if (idle and loop_wait <= 0) or not self.accepting:
            return None
        budget = timeout if timeout is not None else self.slo
        if budget is None:
            return None
        spent = now - arrival
        memo = self._refused
        if memo is not None and memo.holds(budget, now, loop_wait, spent):
            self._unmeetable.count += 1
            self._unavailable.count += 1
            return memo.verdict
        if self._admitting is not None and self._admitting.holds(budget, now, loop_wait + spent):
            return None
        then = now + loop_wait  # when its handler reaches the batcher
        # as a one-row request of the highest priority: an idle model admits under its SLO
        # whatever the prediction, but not when the loop's work ahead would make it late
        soft = timeout is None and loop_wait <= 0
        found = self.admission.verdict(
            arrival + budget, soft, 1, now, self.queue_state(1, then), loop_wait
        )
        until = now + EARLY_REFUSAL_REUSE_S
        if isinstance(found, Unavailable):
            self._admitting = None
            self._refused = EarlyRefusal(budget, until, found, loop_wait, spent)
            self._unmeetable.count += 1
            self._unavailable.count += 1
            return found
        if found is not None:  # admitted with a prediction: reused while it has room
            spare = EARLY_ADMIT_SHARE * budget - found.predicted - spent
            if spare > 0:
                self._admitting = EarlyAdmit(budget, until, loop_wait + spent + spare)
        return None

    def _reject(self, reason: str, error: ServingError) -> None:
        self.metrics.rejected.inc((*self.labels, reason))
        self.metrics.requests.inc((*self.labels, error.kind))
        raise error

    def _count(self, outcome: str) -> None:
        self.metrics.requests.inc((*self.labels, outcome))

    def queue_state(self, level: int, now: float) -> QueueState:
        """The queue as a request of priority `level` arriving now would find it."""
        policy = self.cap_policy()
        cap = policy.cap
        window = self._window(policy, now)
        if len(self.instances) == 1:  # the common case, without a sort
            (only,) = self.instances
            free_at: tuple[float, ...] = (self._free_at(only, now),) if only.healthy else ()
        else:
            free_at = tuple(sorted(self._free_at(i, now) for i in self.instances if i.healthy))
        opens = self._held_until(cap, window, now)
        return QueueState(self._rows_ahead(level), cap, free_at, policy.capacity, opens)

    def _held_until(self, cap: int, window: float, now: float) -> float:
        """When an idle instance takes a partial batch: at the end of the oldest queued
        request's window (of a request arriving `now`, when none is queued); 0.0 when a batch
        leaves at once (no window, a full batch, or a preferred size reached)."""
        if window <= 0 or self.queued_rows >= cap or self._preferred_reached():
            return 0.0
        oldest = self._oldest()
        return (oldest.arrival if oldest is not None else now) + window

    def _free_at(self, instance: Instance, now: float) -> float:
        """When the instance should take its next batch, from the profile as it is now."""
        batch = self.running.get(instance)
        if batch is None:
            return now
        return max(now, batch.started + self.profile.service_time(batch.rows))

    def _rows_ahead(self, level: int) -> int:
        if level >= self.levels:  # every level counts (and with one level, always)
            return self.queued_rows
        return sum(sum(r.rows for r in q) for q in self.queues[:level])

    def _lowest_below(self, level: int) -> InferRequest | None:
        """The newest queued request of the lowest priority level below `level`."""
        for index in range(self.levels - 1, level - 1, -1):
            if self.queues[index]:
                return self.queues[index][-1]
        return None

    def _shed(self, victim: InferRequest) -> None:
        self._forget(victim)
        self.metrics.rejected.inc((*self.labels, "shed_priority"))
        error = Unavailable("shed for a higher-priority request under load", retry_after=1)
        if victim.future is not None and not victim.future.done():
            victim.future.set_exception(error)

    def _watch(
        self, request: InferRequest, deadline: float, loop: asyncio.AbstractEventLoop, now: float
    ) -> None:
        """Watch the deadline of a request not yet answered. One timer serves the batcher, armed
        for the earliest deadline watched: a request costs a push on a heap, not a timer of its
        own, and an answered one is dropped when the timer passes it (or by a sweep, when the
        answered outnumber those waiting)."""
        heapq.heappush(self._deadlines, (deadline, request.seq, request))
        if deadline < self._armed:
            if self._deadline_timer is not None:
                self._deadline_timer.cancel()
            self._arm(deadline, loop, now)
        elif len(self._deadlines) > 2 * self._inflight + 64:
            self._deadlines = [e for e in self._deadlines if not _answered(e[2])]
            heapq.heapify(self._deadlines)

    def _deadlines_passed(self) -> None:
        """The earliest deadline watched has come: the requests whose deadline it is (or an
        earlier one) answer 504 if they are still queued; the timer is armed again for the
        earliest deadline of a request not yet answered."""
        self._deadline_timer = None
        due, self._armed = self._armed, math.inf
        heap = self._deadlines
        while heap:
            deadline, _, request = heap[0]
            answered = _answered(request)
            if deadline > due and not answered:
                break
            heapq.heappop(heap)
            if not answered:
                self._deadline_passed(request)
        if heap:
            self._arm(heap[0][0], asyncio.get_running_loop(), time.monotonic())

    def _arm(self, deadline: float, loop: asyncio.AbstractEventLoop, now: float) -> None:
        self._armed = deadline
        at = deadline + loop.time() - now  # on the loop's clock
        self._deadline_timer = loop.call_at(at, self._deadlines_passed)

    def _deadline_passed(self, request: InferRequest) -> None:
        queue = self.queues[self.level_of(request) - 1]
        if request in queue:  # still waiting: it has not reached the model
            self._forget(request)
            self._expire(request)

    def _forget(self, request: InferRequest) -> None:
        queue = self.queues[self.level_of(request) - 1]
        with contextlib.suppress(ValueError):
            queue.remove(request)
            self.queued_rows -= request.rows

    # -- batch formation ---------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self}")

    def __str__(self) -> str:
        return f"{self.config.name}:{self.version}"

    async def _loop(self) -> None:
        while True:
            await self._wait_for_work()
            now = time.monotonic()
            cap, window = self.cap_and_window(now)
            if (wait := self._held_until(cap, window, now) - now) > 0:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
                continue  # look again: the batch may be full, or the window spent
            batch = self._form(cap, now)
            self.next_turn.formed(now, len(batch.requests) if batch is not None else 0)
            self._gathering = False
            if batch is not None:
                self._start(self.free.popleft(), batch)

    def _start(self, instance: Instance, batch: Batch) -> None:
        if self._inline(instance, batch):
            self._run_inline(instance, batch)
            return
        task = asyncio.get_running_loop().create_task(self._run(instance, batch))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _wait_for_work(self) -> None:
        while not (self.queued_rows and self.free):
            self._wake.clear()
            await self._wake.wait()

    def _oldest(self) -> InferRequest | None:
        heads = [q[0] for q in self.queues if q]
        return min(heads, key=lambda r: r.arrival) if heads else None

    def _preferred_reached(self) -> bool:
        preferred = self.config.batcher.preferred_batch_sizes
        return bool(preferred) and self.queued_rows >= min(preferred)

    def _form(self, cap: int, now: float) -> Batch | None:
        """Take requests, highest priority first, that fit the cap and share a signature."""
        batching = self.config.batching
        chosen: list[InferRequest] = []
        rows = 0
        sig: Signature | None = None
        for queue in self.queues:
            kept: list[InferRequest] = []
            while queue:
                request = queue.popleft()
                if request.future is None or request.future.done():
                    self.queued_rows -= request.rows
                    continue
                if request.expired(now):
                    self.queued_rows -= request.rows
                    self._expire(request)
                    continue
                request_sig = signature(request, batching, self.ragged)
                fits = rows + request.rows <= cap or not chosen
                if sig is None or (request_sig == sig and fits):
                    sig = request_sig
                    chosen.append(request)
                    rows += request.rows
                    self.queued_rows -= request.rows
                    if not batching or rows >= cap:
                        break
                else:
                    kept.append(request)
                    if not fits:
                        break
            queue.extendleft(reversed(kept))
            if chosen and (not batching or rows >= cap):
                break
        return self._drop_late(Batch(chosen, rows), now) if chosen else None

    def _drop_late(self, batch: Batch, now: float) -> Batch | None:
        """Answer 504 now to requests whose deadline falls before their batch would end.

        Running them would spend the model on answers that come too late to count.
        """
        if not self.admission.settings.deadline_aware or not self.profile.known:
            return batch
        finish = now + self.profile.service_time(batch.rows)
        late = {
            r.seq
            for r in batch.requests
            if r.deadline is not None and not r.soft_deadline and r.deadline < finish
        }
        if not late:
            return batch
        kept = []
        for request in batch.requests:
            if request.seq in late:
                self._expire(request, "would end after its deadline: not run")
            else:
                kept.append(request)
        return Batch(kept, sum(r.rows for r in kept)) if kept else None

    def _expire(self, request: InferRequest, why: str = "passed") -> None:
        self.metrics.rejected.inc((*self.labels, "deadline"))
        waited = (time.monotonic() - request.arrival) * 1000
        error = DeadlineExceeded(f"deadline {why} after {waited:.1f} ms in the queue")
        if request.future is not None and not request.future.done():
            request.future.set_exception(error)

    # -- execution ---------------------------------------------------------------------
    async def _run(self, instance: Instance, batch: Batch) -> None:
        """Run a batch on the instance's thread and answer its requests."""
        start = self._begin(instance, batch)
        inputs: Arrays | None = None
        gathered = start
        result: Arrays | list[Answer]
        try:
            if instance.per_request:  # the model takes the requests as they are: no merging
                result = await instance.infer_requests(batch.requests)
            else:
                inputs = batch.inputs(self.config.batching)
                gathered = time.monotonic()
                result = await instance.infer(inputs)
        except BaseException as exc:
            self._end(instance, batch, start, exc)
            if isinstance(exc, Exception):
                return
            raise
        self._end(instance, batch, start, result, gathered - start)
        cheap = instance.inline_safe and instance.last_seconds <= self.inline_seconds
        if inputs is not None and cheap:  # timed on the thread: inputs this big may run inline
            size = batch_bytes(inputs)
            self.inline_bytes[batch.rows] = max(self.inline_bytes.get(batch.rows, 0), size)

    def _run_inline(self, instance: Instance, batch: Batch) -> None:
        """Run a cheap batch on the event loop: no thread handoff, no task."""
        start = self._begin(instance, batch)
        gathered = start
        result: Arrays | list[Answer]
        try:
            if instance.per_request:
                result = instance.infer_requests_sync(batch.requests)
            else:
                inputs = batch.inputs(self.config.batching)
                gathered = time.monotonic()
                result = instance.infer_sync(inputs)
        except Exception as exc:
            self._end(instance, batch, start, exc)
            return
        self._end(instance, batch, start, result, gathered - start)

    def _begin(self, instance: Instance, batch: Batch) -> float:
        start = time.monotonic()
        previous = self._back_to_back.pop(instance, None)
        if previous is not None:  # the instance went straight from that batch to this one
            previous_start, previous_rows = previous
            self.profile.observe(previous_rows, start - previous_start)
        batch.started = start
        self.running[instance] = batch
        self._refused = None  # the queue and the instances changed
        for request in batch.requests:
            request.batched = batch.formed
            self._queued_latency.observe(start - request.arrival)
        return start

    def _end(
        self,
        instance: Instance,
        batch: Batch,
        start: float,
        result: Arrays | list[Answer] | BaseException,
        gather: float = 0.0,
    ) -> None:
        """Release the instance, record the batch, split its outputs (or match a per-request
        model's answers) to its requests, or fail them."""
        self._release(instance)
        if isinstance(result, BaseException):
            if not self._retry_alone(batch, result):
                self._fail(batch, self._as_serving_error(batch, result))
            return
        split_start = time.monotonic()
        parts: list[Answer] | list[Arrays]
        try:
            if isinstance(result, list):  # a per-request model's: an answer each
                parts = batch.matched(result)
            else:
                parts = batch.split(result, self.config.batching)
        except ServingError as exc:
            self._fail(batch, exc)
            return
        compute = instance.last_seconds
        self.times.record(batch.rows, gather, compute, time.monotonic() - split_start)
        self.compute.observe(batch.rows, compute)
        if self.queued_rows >= self.cap_and_window(time.monotonic())[0]:
            # A full batch is waiting, so the next one leaves at once (no window): time this
            # batch from its start to the next one's on this instance, so the profile holds
            # the real cycle, event-loop gaps included.
            self._back_to_back[instance] = (start, batch.rows)
        else:
            self.profile.observe(batch.rows, time.monotonic() - start)
        self._computed_latency.observe(compute)
        self._batch_rows.observe(batch.rows)
        self._batches.count += 1
        log.debug(
            "model %s ran a batch of %d requests (%d rows) in %.3f ms",
            self,
            len(batch.requests),
            batch.rows,
            compute * 1000,
        )
        for request, part in zip(batch.requests, parts, strict=True):
            request.computed, request.compute_seconds = instance.last_finished, compute
            request.batch_rows = batch.rows
            if request.future is None or request.future.done():
                continue
            if isinstance(part, ServingError):  # the model's error for this request alone
                request.future.set_exception(part)
            else:
                request.future.set_result(part)

    def _as_serving_error(self, batch: Batch, exc: BaseException) -> ServingError:
        if isinstance(exc, ServingError):
            return exc
        if isinstance(exc, asyncio.CancelledError):
            return Unavailable("batch cancelled: the model is shutting down", retry_after=1)
        # the model raised on a lone request (or one that may not be retried)
        log.warning("model %s failed on a batch of %d rows: %r", self, batch.rows, exc)
        return BackendError(f"model '{self.config.name}' failed: {exc}")

    def _retry_alone(self, batch: Batch, exc: BaseException) -> bool:
        """The model raised on a batch of several requests (a token id past the vocabulary,
        text it refuses): put them back at the head of their queues, each to run in a batch of
        its own, so only the request the model cannot take fails. False when the batch had
        one request, or the failure was no model's (a hang, a shutdown): it fails as it is."""
        model_raised = isinstance(exc, BackendError | BadRequest) or (
            isinstance(exc, Exception) and not isinstance(exc, ServingError)
        )
        waiting = [r for r in batch.requests if r.future is not None and not r.future.done()]
        if not model_raised or len(batch.requests) < 2 or not waiting:
            return False
        log.warning(
            "model %s failed on a batch of %d requests (%r); running each alone",
            self,
            len(batch.requests),
            exc,
        )
        for request in reversed(waiting):
            request.alone = True
            self.queues[self.level_of(request) - 1].appendleft(request)
            self.queued_rows += request.rows
        self._wake.set()
        return True

    def _inline(self, instance: Instance, batch: Batch) -> bool:
        """Run on the event loop when the batch is cheaper than a thread handoff (~100 µs):
        only a batch no bigger, in rows and in bytes, than one already timed on the thread.
        Anything else runs on the thread, where the hang timeout applies (a one-row request
        with a huge dynamic dimension must not stall the loop)."""
        if not (
            instance.inline_safe
            and self.compute.known
            and self.compute.service_time(batch.rows) <= self.inline_seconds
        ):
            return False
        # no more rows and no more bytes than a batch timed cheap cost no more
        size = sum(batch_bytes(r.inputs) for r in batch.requests)
        return any(rows >= batch.rows and most >= size for rows, most in self.inline_bytes.items())

    def instance_ready(self, instance: Instance) -> None:
        """A restarted instance takes work again."""
        if instance not in self.free:
            self.free.append(instance)
        self._wake.set()

    def _release(self, instance: Instance) -> None:
        self._refused = None
        self.running.pop(instance, None)
        if instance.healthy:
            self.free.append(instance)
        self._wake.set()

    def _fail(self, batch: Batch, error: ServingError) -> None:
        for request in batch.requests:
            if request.future is not None and not request.future.done():
                request.future.set_exception(error)

    # -- shutdown ----------------------------------------------------------------------
    async def drain(self, timeout: float) -> bool:
        """Stop intake, wait up to `timeout` for admitted requests. True if all were answered."""
        self.accepting = False
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def close(self) -> None:
        self.accepting = False
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
            self._deadline_timer = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for queue in self.queues:
            while queue:
                request = queue.popleft()
                if request.future is not None and not request.future.done():
                    request.future.set_exception(Unavailable("model was unloaded", retry_after=1))
        self.queued_rows = 0
        for instance in self.instances:
            instance.close()
        self.metrics.queue_depth.remove_function(self.labels, self._depth_fn)
        self.metrics.inflight.remove_function(self.labels, self._inflight_fn)


def _answered(request: InferRequest) -> bool:
    return request.future is None or request.future.done()
