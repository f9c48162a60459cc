"""The service-time profile T(B) of a model and the batching rule that uses it. Pure math.

The rule, for a model with a latency SLO (all times in seconds):

- T(B) is measured at warmup for B = 1, 2, 4, ... max_batch_size (see `core/warmup.py` and
  `ModelManager._profile`), then kept current with an
  exponentially weighted average of every batch the model runs. Between measured sizes,
  T(B) = a + b·B from a least-squares fit.
- What the CPU does now: the average moves slowly (one stall must not move it), so a second,
  fast term follows the current load. Every batch gives the ratio of its measured time to
  the profile's prediction for it; the scale moves by the median of the last three ratios
  (one stall does not count, two slow batches in a row do), averaged over time with a time
  constant of `scale_tau` seconds (0.3 s: a lasting change is followed within about a
  second). The profile answers scale · T(B), and the slow average learns the shape of T(B)
  from samples divided by the scale, when they are within `band` of the prediction. Batches
  are timed by the wall clock, so whatever slows them (the event loop's own CPU on a shared
  core, another process, longer inputs) is in the scale.
- Warmup's T(B) is provisional. Warmup runs synthetic inputs (for text, a few words), and a
  model whose cost grows with its inputs (a text encoder on sentences ten times longer) can
  cost ten times the warmup's figure at B = 8 and only three times at B = 1: a shape the scale
  cannot fix. Once warmup ends (`seal`), traffic's first batches at a size replace warmup's
  figure for it (the median of its first `settle` batches), and while traffic has measured
  any size, sizes it has not measured are predicted from those it has: between two of them
  by a straight line, above the largest, B* by B, as rows·(its time per row). That
  overestimates a batch that amortises a fixed cost, so the cap grows only as batches of the
  larger size are measured, never past what traffic has shown. Traffic's very first batch
  is not counted at all: it runs cold (a worker thread started, caches filled, first-time
  code paths), at several times its size's real cost (4.6 ms for one row of a scikit-learn
  model whose batches under the same load took 1 to 2 ms), and taken as the figure for its
  size, then per row for every size above it, it had perf_analyzer's first requests at 16
  concurrent refused as certain to miss a 50 ms SLO.
- Batches of one size vary with their inputs. The ratios of the last 64 batches' times to
  their predictions give `tail`, their 90th percentile over their median (1 to 3), each
  batch weighed by its time: how much longer a slow batch runs. Admission plans with it
  (see `admission`).
- The batch cap B* is the largest B ≤ max_batch_size with 2·T(B)·tail ≤ the budget: the SLO,
  or with admission on, the share of it admission admits within (`slack`, 0.8). A request
  that arrives just as a batch of B* starts waits at most T(B*) for it and then T(B*) for its
  own batch, so a full batch still meets the budget, slow batches included, and admission
  admits it. (With the whole SLO as the budget, such a request was predicted at nearly the
  whole SLO and refused: a closed loop of 8 on a text encoder, whose batches of 8 answer in
  200 ms against 500, was refused a third of its requests.) Below the smallest size traffic
  has measured, T(B) falls from that size's time as warmup's T(B) fell, and never below its
  time per row: taken whole, one batch of 11 sentences made every smaller batch as slow and
  the cap 1.
- The window: with arrival rate λ, a batch of B forms in about (B−1)/λ, so the expected
  latency is L ≈ (B−1)/(2λ) + T(B). The batcher holds an idle instance for a window
  w = min(budget − 2·T(B*), √(T(1)/λ)) only when λ·T(1) ≥ 1, that is, when batch-1 service
  could not keep up with the arrivals. Below that load, waiting cannot raise throughput,
  and an idle instance takes the queue at once (a work-conserving batcher: batches still
  grow by themselves while an instance is busy).
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

from lockgate.service_time import fit_line


@dataclass(slots=True)
class ServiceProfile:
    """Measured service time per batch size, in seconds."""

    max_batch_size: int
    alpha: float = 0.1  # weight of a new observation in the running average
    outlier: float = 2.0  # samples are clamped to this multiple of the running average
    refit_every: int = 64  # observations between refits of a + b·B
    scale_tau: float = 0.3  # time constant of the scale, seconds
    band: float = 1.2  # samples this far off the prediction move the scale alone
    observations: int = 0
    times: dict[int, float] = field(default_factory=dict)  # the slow average, unscaled
    fit_a: float = 0.0
    fit_b: float = 0.0
    scale: float = 1.0  # current service time / the slow average
    scaled_at: float | None = None  # when the scale last moved
    ratios: deque[float] = field(default_factory=lambda: deque([1.0, 1.0], maxlen=3))
    settle: int = 3  # traffic's first batches at a size whose median replaces warmup's figure
    sealed: bool = False  # warmup ended: traffic's figures replace warmup's
    cold: bool = True  # traffic's first batch, which is not counted, is still to come
    traffic: set[int] = field(default_factory=set)  # sizes traffic has measured
    measured: list[int] = field(default_factory=list)  # the same, ascending
    first: dict[int, list[float]] = field(default_factory=dict)  # traffic's first, unscaled
    reshaped: float = 0.0  # when a figure of traffic's first batches last moved past `band`
    warm: dict[int, float] = field(default_factory=dict)  # warmup's figures, kept at seal
    warm_sizes: list[int] = field(default_factory=list)  # their sizes, ascending
    tail_quantile: float = 0.9  # of recent batches' ratios, for `tail`
    # recent batches' (ratio, seconds): the tail weighs each by its time
    spread: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=64))
    tail: float = 1.0  # that quantile over their median: how much slower a slow batch runs
    _spread_since: int = 0
    # Bumped by every change of what the profile answers (`observe`, `seal`, `refit`): what is
    # derived from it is asked for every request but changes only with a batch, and a memo of
    # it holds while the version does.
    version: int = 0
    # batch_cap's last answer: (slo, version) -> cap
    _cap_key: tuple[float, int] = (math.nan, -1)
    _cap: int = 1

    def observe(self, batch_size: int, seconds: float, now: float | None = None) -> None:
        """Fold one measured batch into the profile (see the module docstring).

        The slow average: a sample more than `outlier` times the average (a preempted thread,
        a page fault) counts as `outlier` times the average, so one stall cannot move it far.
        The scale follows a lasting change within about a second."""
        try:
            self._observe(batch_size, seconds, time.monotonic() if now is None else now)
        finally:
            self.version += 1  # once the change is made: a memo taken during it is dropped

    def _observe(self, batch_size: int, seconds: float, now: float) -> None:
        if self.sealed and self.cold:
            self.cold = False  # traffic's first batch ran cold: not its size's cost
            return
        if self.sealed and (batch_size not in self.traffic or batch_size in self.first):
            self._settle(batch_size, seconds, now)
            return
        old = self.times.get(batch_size)
        if old is None:
            self.times[batch_size] = seconds / self.scale
            self.refit()
            return
        ratio = seconds / (self.scale * old) if old > 0 else 1.0
        self._spread(ratio, seconds)
        self._rescale(ratio, now)
        if not 1 / self.band <= ratio <= self.band:
            return  # a stall or a change of load: the scale's to follow, not the shape's
        seconds = min(seconds / self.scale, self.outlier * old)  # the shape, without the load
        self.times[batch_size] = old + self.alpha * (seconds - old)
        self.observations += 1
        if self.observations % self.refit_every == 0:
            self.refit()

    def seal(self) -> None:
        """Warmup ended: what it measured is provisional until traffic measures it, but its
        shape still says how T(B) falls below the smallest size traffic has measured."""
        self.sealed = True
        self.warm = dict(self.times)
        self.warm_sizes = sorted(self.warm)
        self.version += 1

    def _settle(self, batch_size: int, seconds: float, now: float) -> None:
        """One of traffic's first batches at a size: the median of them so far is its figure.
        The scale holds (the gap from warmup's figure is the shape, not the load). A figure
        that moves outside `band` reshapes the profile: predictions made before are void."""
        before = self.service_time(batch_size) / self.scale
        samples = self.first.setdefault(batch_size, [])
        samples.append(seconds / self.scale)
        self.times[batch_size] = after = statistics.median(samples)
        if before > 0 and not 1 / self.band <= after / before <= self.band:
            self.reshaped = now
        if batch_size not in self.traffic:
            self.traffic.add(batch_size)
            self.measured = sorted(self.traffic)
        if len(samples) >= self.settle:
            del self.first[batch_size]
        self.observations += 1
        self.refit()

    def _spread(self, ratio: float, seconds: float) -> None:
        """Keep the tail current: the time-weighted `tail_quantile` of recent batches' ratios
        over their time-weighted median. Weighed by time, the jitter of sub-millisecond
        batches (a loop turn's work in the measured cycle) does not count as the spread of the
        batches that hold the queue's time."""
        self.spread.append((ratio, seconds))
        self._spread_since += 1
        if self._spread_since < 8 or len(self.spread) < 16:
            return
        self._spread_since = 0
        ordered = sorted(self.spread)
        total = sum(seconds for _, seconds in ordered)
        if total <= 0:
            return
        median: float | None = None
        high, seen = ordered[-1][0], 0.0
        for ratio_i, seconds_i in ordered:
            seen += seconds_i
            if median is None and seen >= 0.5 * total:
                median = ratio_i
            if seen >= self.tail_quantile * total:
                high = ratio_i
                break
        if median:
            self.tail = min(3.0, max(1.0, high / median))

    def _rescale(self, ratio: float, now: float) -> None:
        """`ratio`: a batch's measured time over what the profile predicted for it."""
        self.ratios.append(ratio)
        median = sorted(self.ratios)[len(self.ratios) // 2]
        weight = 1.0
        if self.scaled_at is not None:
            weight = 1.0 - math.exp(-max(0.0, now - self.scaled_at) / self.scale_tau)
        target = self.scale * median
        self.scale = min(50.0, max(0.02, self.scale + weight * (target - self.scale)))
        self.scaled_at = now

    def refit(self) -> None:
        if not self.times:
            return
        sizes = sorted(self.times)  # [n]
        self.fit_a, self.fit_b = fit_line(sizes, [self.times[b] for b in sizes])
        self.version += 1

    @property
    def known(self) -> bool:
        return bool(self.times)

    def service_time(self, batch_size: int) -> float:
        """T(B) under the current load: the scale times the average (or the fit)."""
        if self.traffic and batch_size not in self.traffic:
            return self.scale * self._from_traffic(batch_size)
        measured = self.times.get(batch_size)
        if measured is not None:
            return self.scale * measured
        return self.scale * (self.fit_a + self.fit_b * batch_size)

    def _from_traffic(self, batch_size: int) -> float:
        """Unscaled T(B) at a size traffic has not measured, from the sizes it has."""
        sizes, times = self.measured, self.times
        i = bisect.bisect_left(sizes, batch_size)  # sizes[i]: the smallest measured above it
        if i == len(sizes):
            top = sizes[-1]
            return times[top] * batch_size / top  # its time per row: never less
        above = sizes[i]
        if i == 0:
            return self._below(batch_size)
        low = sizes[i - 1]
        share = (batch_size - low) / (above - low)
        return times[low] + share * (times[above] - times[low])

    def _below(self, batch_size: int) -> float:
        """Unscaled T(B) below the smallest size traffic has measured: that size's time, cut
        as warmup's T(B) falls from it to B, and never below its time per row (warmup's short
        inputs overstate the share of a batch's fixed cost, so this errs long, not short)."""
        lowest = self.measured[0]
        top = self.times[lowest]
        if batch_size >= lowest:
            return top
        warm = self._warm(lowest)
        share = self._warm(batch_size) / warm if warm > 0 else 1.0
        return top * min(1.0, max(batch_size / lowest, share))

    def _warm(self, batch_size: int) -> float:
        """Warmup's T(B): between the sizes it measured, on the straight line joining them."""
        warm = self.warm
        measured = warm.get(batch_size)
        if measured is not None or not warm:
            return measured or 0.0
        sizes = self.warm_sizes
        i = bisect.bisect_left(sizes, batch_size)
        if i == 0:
            return warm[sizes[0]]
        if i == len(sizes):
            return warm[sizes[-1]] * batch_size / sizes[-1]
        low, above = sizes[i - 1], sizes[i]
        return warm[low] + (batch_size - low) / (above - low) * (warm[above] - warm[low])

    def batch_cap(self, slo: float) -> int:
        """The largest B with 2·T(B)·tail ≤ `slo`, the budget (at least 1)."""
        key = (slo, self.version)
        if key != self._cap_key:
            self._cap_key = key
            self._cap = self._batch_cap(slo)
        return self._cap

    def _batch_cap(self, slo: float) -> int:
        if self.traffic:
            return self._cap_from_traffic(slo)
        # service_time(b) for every b, inlined: this runs after every batch. From the largest
        # size down, the first that fits is the cap: a model that fits its largest batch (the
        # common case) is asked about one size, not all of them.
        scale, a, b, times = self.scale * self.tail, self.fit_a, self.fit_b, self.times
        for size in range(self.max_batch_size, 1, -1):
            measured = times.get(size)
            base = a + b * size if measured is None else measured
            if 2 * (scale * base) <= slo:
                return size
        return 1

    def _cap_from_traffic(self, slo: float) -> int:
        # _from_traffic(b) for every b, inlined, from the largest size down (as `_batch_cap`)
        sizes, times = self.measured, self.times
        limit = slo / (2 * self.scale * self.tail)
        top = sizes[-1]
        i = len(sizes) - 1  # sizes[i]: the smallest measured size >= size
        for size in range(self.max_batch_size, 1, -1):
            if size > top:
                base = times[top] * size / top
            else:
                while i > 0 and sizes[i - 1] >= size:
                    i -= 1
                above = sizes[i]
                if above == size:
                    base = times[above]
                elif i == 0:
                    base = self._below(size)
                else:
                    low = sizes[i - 1]
                    base = times[low] + (size - low) / (above - low) * (times[above] - times[low])
            if base <= limit:
                return size
        return 1

    def window(self, slo: float, arrival_rate: float, cap: int | None = None) -> float:
        """How long an idle instance may hold a partial batch (0: dispatch at once). `cap`:
        `batch_cap(slo)`, when the caller has it."""
        t1 = self.service_time(1)
        if arrival_rate <= 0 or arrival_rate * t1 < 1.0:
            return 0.0
        if cap is None:
            cap = self.batch_cap(slo)
        return batch_window(t1, slo - 2 * self.service_time(cap), arrival_rate)

    def throughput(self, batch_size: int) -> float:
        """Rows per second one instance serves at this batch size."""
        t = self.service_time(batch_size)
        return batch_size / t if t > 0 else math.inf


def batch_window(t1: float, room: float, arrival_rate: float) -> float:
    """How long an idle instance may hold a partial batch: sqrt(T(1) / rate) within `room`
    (the budget less 2·T(B*)), and 0 (dispatch at once) while a row arrives less often than
    T(1). `arrival_rate` in rows per second."""
    if arrival_rate <= 0 or arrival_rate * t1 < 1.0:
        return 0.0
    return max(0.0, min(room, math.sqrt(t1 / arrival_rate)))


@dataclass(slots=True)
class RateMeter:
    """Arrival rate as an exponentially decaying count (time constant `tau` seconds)."""

    tau: float = 1.0
    rate: float = 0.0
    last: float = field(default_factory=time.monotonic)

    def add(self, count: int = 1, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        self._decay(now)
        self.rate += count / self.tau

    def current(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._decay(now)
        return self.rate

    def _decay(self, now: float) -> None:
        dt = now - self.last
        if dt > 0:
            self.rate *= math.exp(-dt / self.tau)
            self.last = now
