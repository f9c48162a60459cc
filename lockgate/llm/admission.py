"""TTFT admission for language models: refuse at once what would wait too long for its
first token. Pure bookkeeping: no tensors, no clock of its own.

A new request's first token comes once every prompt token queued ahead of it is prefilled
(waiting sequences of its priority or higher, and what is left of prompts being prefilled
now), and then its own prompt. The engine measures its prefill rate as prompt tokens per
second of step time, over the steps that prefilled anything, averaged over time (time
constant `tau`, 0.5 s): decodes that share those steps slow the rate as they slow the
prefills. The predicted TTFT is (tokens ahead + its own prompt tokens) / rate.

A request is refused with 503 and Retry-After when that prediction exceeds `slack` times its
budget: the model's TTFT SLO (`ttft_slo_ms`) or the time left before its deadline, whichever
is smaller; a request with nothing queued ahead is held to its deadline alone. With neither,
or before the first prefill has been measured, nothing is refused.
The prediction leaves out the wait for a free place when `max_num_seqs` sequences run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from lockgate.errors import Unavailable


@dataclass(slots=True)
class PrefillRate:
    """Prompt tokens prefilled per second of engine step time, averaged over time."""

    tau: float = 0.5
    rate: float = 0.0  # tokens per second; 0: not measured yet
    at: float | None = None

    def observe(self, prompt_tokens: int, step_seconds: float, now: float) -> None:
        if prompt_tokens <= 0 or step_seconds <= 0:
            return
        sample = prompt_tokens / step_seconds
        weight = 1.0 if self.at is None else 1.0 - math.exp(-max(0.0, now - self.at) / self.tau)
        self.rate += weight * (sample - self.rate)
        self.at = now


@dataclass(slots=True)
class TTFTAdmission:
    ttft_slo: float | None = None  # seconds; None: only deadlines count
    slack: float = 0.8
    prefill: PrefillRate | None = None

    def __post_init__(self) -> None:
        if self.prefill is None:
            self.prefill = PrefillRate()

    def predicted_ttft(self, tokens_ahead: int, prompt_tokens: int) -> float | None:
        assert self.prefill is not None
        if self.prefill.rate <= 0:
            return None
        return (tokens_ahead + prompt_tokens) / self.prefill.rate

    def check(
        self, tokens_ahead: int, prompt_tokens: int, deadline: float | None, now: float
    ) -> Unavailable | None:
        """None to admit, or the refusal to raise."""
        # alone in the engine, a request waits for nobody: the SLO bounds waiting, so only
        # its own deadline can refuse it (and serving it measures the prefill rate anew)
        slo = self.ttft_slo if tokens_ahead else None
        budgets = [b for b in (slo, None if deadline is None else deadline - now) if b]
        if not budgets:
            return None
        predicted = self.predicted_ttft(tokens_ahead, prompt_tokens)
        budget = min(budgets)
        if predicted is None or predicted <= budget * self.slack:
            return None
        assert self.prefill is not None
        return Unavailable(
            f"request would miss its time to first token: predicted {predicted * 1000:.0f} ms "
            f"for {tokens_ahead} prompt tokens queued ahead and {prompt_tokens} of its own at "
            f"{self.prefill.rate:.0f} tokens/s, budget {budget * 1000:.0f} ms",
            retry_after=max(1.0, tokens_ahead / self.prefill.rate),
        )
