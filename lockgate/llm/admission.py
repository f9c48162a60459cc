"""TTFT admission for language models: refuse at once what would wait too long for its
first token. Pure bookkeeping: no tensors, no clock of its own.

It predicts from the engine's measured step times (`llm/step_model.py`, the scheduler's
`StepModel`): a step that decodes `n` sequences costs `DecodeStep.seconds(n)`, and each prompt
token it prefills costs `1 / PrefillRate.rate` more, both following the load the server is
under now within about a second.

A new sequence's first token comes once these are done (`TTFTAdmission.predict`):

- the step running now ends: a new sequence can join only the next one;
- a sequence slot is free for it: when `max_num_seqs` sequences run, it waits until the ones
  ahead of it in the queue have taken the slots that free up first; a running sequence holds
  its slot for at most the tokens it has left (`max_tokens`; an EOS frees it sooner);
- every prompt token queued ahead of it (waiting sequences of its priority or higher, and what
  is left of prompts being prefilled) and its own prompt are prefilled;
- in steps that also decode the running sequences: each step's token budget
  (`max_num_batched_tokens`, or with `tpot_slo_ms` what `StepModel.step_budget` fits in
  it) is shared with one decode per running sequence.

So the modelled TTFT is `left of the step in flight + steps * DecodeStep.seconds(decodes) +
prefill tokens / rate`, where `steps` is the larger of the steps its prefill needs at
`budget - decodes` tokens per step and the steps until its slot frees plus its own prefill. The
prediction is that times a `Calibration` factor: how much later than modelled the first tokens
of recent requests came (a high quantile, at least 1).

With `step_policy: prefill_first` and a free slot, the prompts ahead and its own take whole
steps, decoding nothing: `steps` counts them at the full budget and each costs the decode
model's fixed overhead, plus one decode step of every running sequence per
`max_decode_stall_ms` of prefill (the stall bound makes the scheduler decode first then).

A request is refused with 503 and Retry-After when that prediction exceeds `slack` times its
budget: the model's TTFT SLO (`ttft_slo_ms`) or the time left before its deadline, whichever
is smaller. A request that waits for nobody (no prompt token ahead, a free slot) is held to its
deadline alone. An admitted request's first token is then due by its budget; a new request
whose last prefill chunk may share a step with earlier ones is also refused when it would make
that step end after one of their dues (chunked prefill batches every waiting prompt that fits,
so a later arrival can delay an earlier one). With neither budget, or before the first prefill
has been measured, nothing is refused.

A request of several sequences (the `n` choices or `best_of` candidates of an OpenAI request)
is admitted one sequence at a time, each behind those before it (`generate_choices` in
`llm/async_engine.py`): the last one's prediction counts the prompts and sequence slots of
them all, and when any is refused, none of them is queued.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from lockgate.errors import Unavailable
from lockgate.llm.metrics import RequestTimings
from lockgate.llm.step_model import StepModel

CALIBRATION_QUANTILE = 0.9  # of recent observed/modelled TTFT ratios
CALIBRATION_WINDOW = 64  # first tokens, at most
CALIBRATION_MAX_AGE_S = 10.0
CALIBRATION_MIN_SAMPLES = 8
CALIBRATION_MAX = 4.0


@dataclass(slots=True)
class Calibration:
    """How much later than modelled first tokens came lately: the `CALIBRATION_QUANTILE` of
    observed/modelled TTFT over the last `CALIBRATION_WINDOW` requests that waited for others
    (none older than `CALIBRATION_MAX_AGE_S`), between 1 and `CALIBRATION_MAX`; 1 with fewer
    than `CALIBRATION_MIN_SAMPLES`. It covers what the step model cannot see: step times that
    swing with other work on the machine, and arrivals that join a step after it was predicted."""

    factor: float = 1.0
    ratios: deque[tuple[float, float]] = field(default_factory=deque)  # (when, ratio)

    def observe(self, ttft: float, modelled: float, now: float) -> None:
        if modelled <= 0:
            return
        self.ratios.append((now, ttft / modelled))
        while len(self.ratios) > CALIBRATION_WINDOW or (
            self.ratios[0][0] < now - CALIBRATION_MAX_AGE_S
        ):
            self.ratios.popleft()
        if len(self.ratios) < CALIBRATION_MIN_SAMPLES:
            self.factor = 1.0
            return
        ordered = sorted(r for _, r in self.ratios)
        high = ordered[min(len(ordered) - 1, int(CALIBRATION_QUANTILE * len(ordered)))]
        self.factor = min(max(high, 1.0), CALIBRATION_MAX)


@dataclass(slots=True, frozen=True)
class QueuedPrefill:
    """A sequence ahead of a new one whose first token has not come yet."""

    tokens: int  # prompt tokens it has left to prefill after the step in flight
    due: float | None  # when admission promised its first token by (monotonic s), if it did


@dataclass(slots=True, frozen=True)
class StepInFlight:
    """The step the engine runs now: a new sequence can join only the next one."""

    prefill_tokens: int
    decodes: int
    started: float  # monotonic s


@dataclass(slots=True)
class LoadAhead:
    """What a new sequence waits behind, as the scheduler sees it when the sequence arrives."""

    prompt_tokens: int  # its own, to prefill
    ahead: list[QueuedPrefill]  # in the order the scheduler prefills them
    running: list[int]  # per running sequence: steps it holds its slot, at most
    waiting: list[int]  # per waiting sequence ahead of it, in order: likewise, once running
    in_flight: StepInFlight | None = None


@dataclass(slots=True, frozen=True)
class TTFTPrediction:
    seconds: float  # modelled, times the calibration factor
    modelled: float  # by the step model alone
    calibration: float
    tokens_ahead: int  # prompt tokens prefilled before its own (the step in flight included)
    in_flight_seconds: float  # left of the step running now
    slot_wait_steps: int  # decode steps until a sequence slot is free for it
    steps: int  # steps after the one in flight until its first token
    decodes: int  # sequences decoded in each of those steps, at most
    step_seconds: float  # the decode part of each step
    prefill_rate: float  # prompt tokens per second of prefill time
    due_sharing: float | None  # earliest first-token due of the sequences in its last step

    @property
    def waits(self) -> bool:
        """It waits for other sequences: prompt tokens ahead, or no free slot."""
        return self.tokens_ahead > 0 or self.slot_wait_steps > 0


def slot_wait_steps(running: list[int], waiting: list[int], max_num_seqs: int) -> int:
    """Decode steps until a slot is free for a sequence queued behind `waiting`: each waiting
    one takes the slot that frees first and holds it for its own steps."""
    frees_at = running + [0] * max(0, max_num_seqs - len(running))  # step each slot frees
    heapq.heapify(frees_at)
    for steps in waiting:
        heapq.heappush(frees_at, heapq.heappop(frees_at) + steps)
    return frees_at[0]


def due_sharing(ahead: list[QueuedPrefill], total: int, per_step: int) -> float | None:
    """The earliest due among the sequences whose prefill ends within `per_step` tokens of
    the end of `total` (they may share a step with the new sequence's last chunk, and wait
    for it)."""
    end, dues = 0, []
    for queued in ahead:
        end += queued.tokens
        if queued.due is not None and end > total - per_step:
            dues.append(queued.due)
    return min(dues, default=None)


@dataclass(slots=True)
class TTFTAdmission:
    ttft_slo: float | None = None  # seconds; None: only deadlines count
    slack: float = 0.8
    max_num_seqs: int = 64
    steps: StepModel = field(default_factory=StepModel)  # the scheduler's, shared
    prefill_first: bool = False  # step_policy prefill_first: prompts before decodes
    max_decode_stall: float = 1.0  # seconds: prefill_first decodes at least this often
    calibration: Calibration = field(default_factory=Calibration)

    def observe_first_token(self, timings: RequestTimings, now: float) -> None:
        """A sequence got its first token: calibrate on it if it waited for others."""
        if timings.modelled_ttft is not None and timings.ttft is not None:
            self.calibration.observe(timings.ttft, timings.modelled_ttft, now)

    def predict(self, load: LoadAhead, now: float) -> TTFTPrediction | None:
        """Seconds until the first token of a sequence arriving behind `load` at `now`; None
        until a prefill has been measured."""
        model = self.steps
        rate = model.prefill.rate
        if rate <= 0:
            return None
        in_flight, in_flight_tokens = 0.0, 0
        if load.in_flight is not None:
            f = load.in_flight
            in_flight = max(
                0.0, model.step_seconds(f.prefill_tokens, f.decodes) - (now - f.started)
            )
            in_flight_tokens = f.prefill_tokens
        slot_wait = slot_wait_steps(load.running, load.waiting, self.max_num_seqs)
        decodes = min(self.max_num_seqs, len(load.running) + len(load.waiting))
        prompts_first = self.prefill_first and slot_wait == 0
        in_step = 0 if prompts_first else decodes  # decodes sharing each step with prompts
        per_step = max(1, model.step_budget(in_step) - in_step)
        prefill = sum(q.tokens for q in load.ahead) + load.prompt_tokens
        own_steps = math.ceil(load.prompt_tokens / per_step)
        steps = max(math.ceil(prefill / per_step), slot_wait + own_steps)
        step_seconds = model.decode.seconds(in_step)
        modelled = in_flight + steps * step_seconds + prefill / rate
        if prompts_first and load.running:  # the stall bound's decode steps
            modelled += math.floor(modelled / self.max_decode_stall) * model.decode.seconds(
                len(load.running)
            )
        factor = self.calibration.factor
        return TTFTPrediction(
            seconds=modelled * factor,
            modelled=modelled,
            calibration=factor,
            tokens_ahead=in_flight_tokens + prefill - load.prompt_tokens,
            in_flight_seconds=in_flight,
            slot_wait_steps=slot_wait,
            steps=steps,
            decodes=in_step,
            step_seconds=step_seconds,
            prefill_rate=rate,
            due_sharing=due_sharing(load.ahead, prefill, per_step),
        )

    def budget(self, prediction: TTFTPrediction, deadline: float | None, now: float) -> float:
        """Seconds it may wait for its first token; inf when nothing bounds it. A request
        that waits for nobody is bounded by the model alone: only its own deadline counts
        (and serving it measures the step times anew)."""
        slo = self.ttft_slo if prediction.waits else None
        budgets = [b for b in (slo, None if deadline is None else deadline - now) if b]
        return min(budgets) * self.slack if budgets else math.inf

    def refusal(
        self, prediction: TTFTPrediction | None, deadline: float | None, now: float
    ) -> Unavailable | None:
        """None to admit, or the refusal to raise."""
        if prediction is None:
            return None
        p, allowed = prediction, self.budget(prediction, deadline, now)
        if p.seconds > allowed:
            why = f"budget {allowed / self.slack * 1000:.0f} ms"
        elif p.due_sharing is not None and now + p.seconds > p.due_sharing:
            allowed = p.due_sharing - now
            why = "it would delay the first token of requests admitted before it past their budget"
        else:
            return None
        return Unavailable(
            f"request would miss its time to first token: predicted {p.seconds * 1000:.0f} ms "
            f"({p.in_flight_seconds * 1000:.0f} ms left of the step running, then "
            f"{p.tokens_ahead} prompt tokens queued ahead and its own at {p.prefill_rate:.0f} "
            f"tokens/s; {p.steps} steps decoding {p.decodes} sequences at "
            f"{p.step_seconds * 1000:.0f} ms, {p.slot_wait_steps} of them until a sequence "
            f"slot frees; times {p.calibration:.2f} for recent misses); {why}",
            retry_after=max(1.0, p.seconds - allowed),
        )

    def due(
        self, prediction: TTFTPrediction | None, deadline: float | None, now: float
    ) -> float | None:
        """When the first token of an admitted request is due: by its budget, or by its
        prediction if that is later (a request that waits for nobody); None if unbounded."""
        if prediction is None:
            return None
        allowed = self.budget(prediction, deadline, now)
        return None if math.isinf(allowed) else now + max(allowed, prediction.seconds)
