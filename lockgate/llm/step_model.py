"""What an engine step costs, measured as the engine runs. Pure bookkeeping: no tensors, no
clock of its own.

A step's time is modelled as `decode part + prefill part`: a step that decodes `n` sequences
costs `DecodeStep.seconds(n)` (a fixed overhead plus a cost per sequence, fitted on recent
decode-only steps), and each prompt token it prefills costs `1 / PrefillRate.rate` more
(fitted on the rest of the time of recent steps that prefilled). Both are measured on the wall
clock of the engine thread, gaps between busy steps included, and weighted by recency (time
constant `tau`, 0.5 s), so they follow the load the server is under now: a busy event loop or a
busy machine slows them within about a second.

The scheduler owns one `StepModel` per engine. TTFT admission (`llm/admission.py`) predicts
first tokens from it, and with a TPOT SLO (`tpot_slo_ms`) it sizes each step's prefill chunk
(`StepModel.step_budget`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TAU_S = 0.5  # time constant of the step-time estimates
SLOPE_SPREAD = 0.1  # batch sizes must spread this share of their mean to refit the slope
MIN_PREFILL_SHARE = 0.5  # of a mixed step's token-proportional prefill share, at least


def _decay(at: float | None, now: float, tau: float) -> float:
    """Weight left to what was observed at `at`; 0 for nothing observed yet."""
    return 0.0 if at is None else math.exp(-max(0.0, now - at) / tau)


@dataclass(slots=True)
class PrefillRate:
    """Prompt tokens prefilled per second of prefill time: recent steps' tokens over their
    seconds, both weighted by exp(-age / tau)."""

    tau: float = TAU_S
    tokens: float = 0.0
    seconds: float = 0.0
    at: float | None = None

    @property
    def rate(self) -> float:
        """Tokens per second; 0 until measured."""
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def observe(self, prompt_tokens: int, seconds: float, now: float) -> None:
        if prompt_tokens <= 0 or seconds <= 0:
            return
        keep = _decay(self.at, now, self.tau)
        self.tokens = keep * self.tokens + prompt_tokens
        self.seconds = keep * self.seconds + seconds
        self.at = now


@dataclass(slots=True)
class DecodeStep:
    """Seconds of a step that decodes `n` sequences and prefills nothing, as
    `overhead + per_seq * n`: a line through the recent steps' mean (weights exp(-age / tau)).
    Its slope is refitted when the recent batch sizes spread, else kept in proportion, and
    stays between flat (all overhead) and proportional (no overhead)."""

    tau: float = TAU_S
    overhead: float = 0.0
    per_seq: float = 0.0
    at: float | None = None
    # sums over recent steps, weighted: 1, n, t, n*n, n*t
    _weight: float = field(default=0.0, init=False, repr=False)
    _n: float = field(default=0.0, init=False, repr=False)
    _t: float = field(default=0.0, init=False, repr=False)
    _nn: float = field(default=0.0, init=False, repr=False)
    _nt: float = field(default=0.0, init=False, repr=False)

    @property
    def measured(self) -> bool:
        return self.at is not None

    def seconds(self, num_seqs: float) -> float:
        """Predicted seconds of a step decoding `num_seqs` sequences; 0 until measured."""
        return self.overhead + self.per_seq * num_seqs

    def observe(self, num_seqs: int, seconds: float, now: float) -> None:
        if num_seqs <= 0 or seconds <= 0:
            return
        keep = _decay(self.at, now, self.tau)
        self._weight = keep * self._weight + 1.0
        self._n = keep * self._n + num_seqs
        self._t = keep * self._t + seconds
        self._nn = keep * self._nn + num_seqs * num_seqs
        self._nt = keep * self._nt + num_seqs * seconds
        n, t = self._n / self._weight, self._t / self._weight
        spread = self._nn / self._weight - n * n
        if spread >= (SLOPE_SPREAD * n) ** 2:  # sizes vary: fit the slope
            slope = (self._nt / self._weight - n * t) / spread
        elif self.measured:  # keep the line's shape, scaled to the mean
            slope = self.per_seq * t / max(self.seconds(n), 1e-9)
        else:
            slope = 0.0  # one size seen: nothing says how it grows
        self.per_seq = min(max(slope, 0.0), t / n)
        self.overhead = t - self.per_seq * n
        self.at = now


@dataclass(slots=True)
class StepModel:
    """The step-time model of one engine, and the token budget of its next step."""

    max_num_batched_tokens: int = 512
    tpot_slo: float | None = None  # seconds: decoding steps' prefill is cut to keep to it
    min_chunk: int = 16  # prompt tokens a decoding step may take, at least
    prefill: PrefillRate = field(default_factory=PrefillRate)
    decode: DecodeStep = field(default_factory=DecodeStep)

    def observe(self, prefill_tokens: int, decodes: int, seconds: float, now: float) -> None:
        """One engine step: `prefill_tokens` prompt (or recomputed) tokens and `decodes`
        sequences decoded in `seconds` of the engine thread's time."""
        if prefill_tokens <= 0:
            self.decode.observe(decodes, seconds, now)
            return
        decode_part = self.decode.seconds(decodes) if self.decode.measured else 0.0
        floor = MIN_PREFILL_SHARE * seconds * prefill_tokens / (prefill_tokens + decodes)
        self.prefill.observe(prefill_tokens, max(seconds - decode_part, floor), now)

    def step_budget(self, decodes: int) -> int:
        """Tokens of a step that decodes `decodes` sequences: `max_num_batched_tokens`, or
        with a TPOT SLO (and the step times measured), the decodes plus the prompt tokens the
        measured prefill rate fits in what the SLO leaves after them (at least `min_chunk`)."""
        cap = self.max_num_batched_tokens
        rate = self.prefill.rate
        if self.tpot_slo is None or decodes <= 0 or rate <= 0 or not self.decode.measured:
            return cap
        room = self.tpot_slo - self.decode.seconds(decodes)
        return min(cap, decodes + max(self.min_chunk, int(room * rate)))

    def step_seconds(self, prefill_tokens: int, decodes: int) -> float:
        """Predicted seconds of one step; call only once the prefill rate is measured."""
        return self.decode.seconds(decodes) + prefill_tokens / self.prefill.rate
