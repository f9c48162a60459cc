"""A token bucket: `rate` tokens a second flow in, up to `capacity` (the burst). Pure
bookkeeping: the caller says what time it is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TokenBucket:
    rate: float  # tokens added per second
    capacity: float  # the most it holds
    tokens: float  # may be below zero: a debt (a settled answer used more than was charged)
    stamp: float  # when `tokens` was last brought up to date

    @classmethod
    def full(cls, rate: float, capacity: float, now: float) -> TokenBucket:
        return cls(rate, capacity, capacity, now)

    def wait(self, amount: float, now: float) -> float:
        """Seconds until `amount` tokens (at most the capacity) are in the bucket; 0: now."""
        self._refill(now)
        need = min(amount, self.capacity)
        return 0.0 if self.tokens >= need else (need - self.tokens) / self.rate

    def take(self, amount: float, now: float) -> None:
        self._refill(now)
        self.tokens -= amount

    def give(self, amount: float) -> None:
        """Settle: `amount` back (or, when negative, more taken)."""
        self.tokens = min(self.capacity, self.tokens + amount)

    def _refill(self, now: float) -> None:
        if now > self.stamp:
            self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
            self.stamp = now
