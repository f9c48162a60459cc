"""The service-time profile T(B) of a model and the batching rule that uses it. Pure math.

The rule, for a model with a latency SLO (all times in seconds):

- T(B) is measured at warmup for B = 1, 2, 4, ... max_batch_size, then kept current with an
  exponentially weighted average of every batch the model runs. Between measured sizes,
  T(B) = a + b·B from a least-squares fit.
- The batch cap B* is the largest B ≤ max_batch_size with 2·T(B) ≤ SLO. A request that
  arrives just as a batch of B* starts waits at most T(B*) for it and then T(B*) for its
  own batch, so a full batch still meets the SLO.
- The window: with arrival rate λ, a batch of B forms in about (B−1)/λ, so the expected
  latency is L ≈ (B−1)/(2λ) + T(B). The batcher holds an idle instance for a window
  w = min(SLO − 2·T(B*), √(T(1)/λ)) only when λ·T(1) ≥ 1, that is, when batch-1 service
  could not keep up with the arrivals. Below that load, waiting cannot raise throughput,
  and an idle instance takes the queue at once (a work-conserving batcher: batches still
  grow by themselves while an instance is busy).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class ServiceProfile:
    """Measured service time per batch size, in seconds."""

    max_batch_size: int
    alpha: float = 0.1  # weight of a new observation in the running average
    outlier: float = 2.0  # samples are clamped to this multiple of the running average
    refit_every: int = 64  # observations between refits of a + b·B
    observations: int = 0
    times: dict[int, float] = field(default_factory=dict)
    fit_a: float = 0.0
    fit_b: float = 0.0

    def observe(self, batch_size: int, seconds: float) -> None:
        """Fold one measured batch into the average. A sample more than `outlier` times the
        average (a preempted thread, a page fault) counts as `outlier` times the average, so
        one stall cannot move the profile far; a lasting change still moves it within a few
        dozen batches."""
        old = self.times.get(batch_size)
        if old is None:
            self.times[batch_size] = seconds
            self.refit()
            return
        seconds = min(seconds, self.outlier * old)
        self.times[batch_size] = old + self.alpha * (seconds - old)
        self.observations += 1
        if self.observations % self.refit_every == 0:
            self.refit()

    def refit(self) -> None:
        if not self.times:
            return
        sizes = np.array(sorted(self.times), dtype=np.float64)
        values = np.array([self.times[int(b)] for b in sizes])
        if len(sizes) == 1:
            self.fit_a, self.fit_b = float(values[0]), 0.0
            return
        b, a = np.polyfit(sizes, values, 1)
        self.fit_a, self.fit_b = max(float(a), 0.0), max(float(b), 0.0)

    @property
    def known(self) -> bool:
        return bool(self.times)

    def service_time(self, batch_size: int) -> float:
        measured = self.times.get(batch_size)
        if measured is not None:
            return measured
        return self.fit_a + self.fit_b * batch_size

    def batch_cap(self, slo: float) -> int:
        """The largest B with 2·T(B) ≤ SLO (at least 1)."""
        cap = 1
        for b in range(1, self.max_batch_size + 1):
            if 2 * self.service_time(b) <= slo:
                cap = b
        return cap

    def window(self, slo: float, arrival_rate: float) -> float:
        """How long an idle instance may hold a partial batch (0: dispatch at once)."""
        t1 = self.service_time(1)
        if arrival_rate <= 0 or arrival_rate * t1 < 1.0:
            return 0.0
        cap = self.batch_cap(slo)
        budget = slo - 2 * self.service_time(cap)
        return max(0.0, min(budget, math.sqrt(t1 / arrival_rate)))

    def throughput(self, batch_size: int) -> float:
        """Rows per second one instance serves at this batch size."""
        t = self.service_time(batch_size)
        return batch_size / t if t > 0 else math.inf


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
