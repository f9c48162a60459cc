"""Continuous batching: which sequences compute how many tokens in the next step.

Each step spends a token budget (`max_num_batched_tokens`) over at most `max_num_seqs`
sequences: running decodes first (one token each), then prompts already being prefilled,
then waiting sequences in priority order (1 first), in arrival order within a priority.
Long prompts are cut into chunks that fit the remaining budget (chunked prefill). When KV
blocks run out, the newest running sequence is preempted: its blocks are freed and it is
recomputed later from the front of the queue.

With `tpot_slo_ms`, a step that decodes takes only the prompt tokens that the measured prefill
rate fits in the time the SLO leaves after its decodes (`StepModel.step_budget`, at least
`block_size`), so prefill chunks shrink as decodes grow and streams keep their pace.

With `step_policy: prefill_first`, while prompts are queued the prompts take the budget first
and the decodes what is left (their KV room is still made first, so a prompt never takes the
block a running sequence needs): a burst of prompts reaches its first tokens sooner, and the
running sequences pause meanwhile, for at most `max_decode_stall_ms`; past that, a step
decodes first again.

With speculative decoding on (`speculative: ngram`), the budget left after the decodes gives
decoding sequences draft tokens (`llm/speculative.py`) to verify after their last token, as far
as free KV blocks allow without preempting anyone; prompts get what remains. After the step,
the accepted drafts count as computed and the blocks that held only rejected ones are freed.

Admission (`llm/admission.py`) refuses a new sequence at once when its predicted time to first
token misses its budget (the scheduler tells it what the sequence would wait behind: prompt
tokens ahead, and the steps each running or waiting sequence ahead holds its slot); a full
waiting queue sheds its newest sequence of the lowest priority for a new one of higher
priority, else refuses the new one (429).

Pure bookkeeping: no tensors here.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from lockgate.errors import BadRequest, TooManyRequests
from lockgate.llm.admission import LoadAhead, QueuedPrefill, StepInFlight, TTFTAdmission
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.kv_cache import BlockManager
from lockgate.llm.sequence import FinishReason, Sequence, SequenceStatus
from lockgate.llm.speculative import NgramProposer
from lockgate.llm.step_model import StepModel


class QueueFull(TooManyRequests):
    """The waiting queue is at `max_waiting`: the request is refused before it queues."""


@dataclass(slots=True)
class ScheduledSequence:
    seq: Sequence
    start: int  # position of the first token computed this step
    num_tokens: int  # tokens computed this step, drafts included
    needs_logits: bool  # this step reaches the sequence's last token: sample the next one
    draft_token_ids: list[int] = field(default_factory=list)  # verified after the last token

    @property
    def input_token_ids(self) -> list[int]:
        """The tokens this step computes: the sequence's, then the drafts."""
        end = self.start + self.num_tokens - len(self.draft_token_ids)
        return self.seq.token_ids[self.start : end] + self.draft_token_ids

    @property
    def num_logits(self) -> int:
        """Positions to sample at: the last token's, then one per draft."""
        return 1 + len(self.draft_token_ids) if self.needs_logits else 0

    @property
    def prompt_logprob_rows(self) -> range:
        """Positions computed this step whose hidden state gives a prompt token's logprob
        still to record (its sequence asked for them)."""
        return self.seq.prompt_logprob_rows(self.start, self.num_tokens)

    @property
    def is_decode(self) -> bool:
        """Computes one output token (and its drafts) to sample its successor."""
        return (
            self.num_tokens - len(self.draft_token_ids) == 1
            and self.start >= self.seq.num_prompt_tokens
        )


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    expired: list[Sequence] = field(default_factory=list)  # finished by deadline this step
    started: float = 0.0  # when it was scheduled

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def num_decodes(self) -> int:
        """Sequences that compute one output token's successor (the rest is prefill)."""
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if not s.is_decode)

    def in_flight(self) -> StepInFlight:
        return StepInFlight(self.num_prefill_tokens, self.num_decodes, self.started)


@dataclass(slots=True)
class _Budget:
    tokens: int
    now: float


class Scheduler:
    """Owns the waiting queue and the running set; the only writer of `Sequence.status`."""

    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.sequences: dict[str, Sequence] = {}  # unfinished, by id
        self.num_preemptions = 0
        slo = config.ttft_slo_ms / 1000 if config.ttft_slo_ms else None
        tpot_slo = config.tpot_slo_ms / 1000 if config.tpot_slo_ms else None
        self.steps = StepModel(config.max_num_batched_tokens, tpot_slo, config.block_size)
        self.admission = TTFTAdmission(
            slo,
            config.admission_slack,
            config.max_num_seqs,
            self.steps,
            prefill_first=config.prefill_first,
            max_decode_stall=config.max_decode_stall_ms / 1000,
        )
        self.shed: list[Sequence] = []  # shed since the last step, to be answered 503
        self.in_flight: SchedulerOutput | None = None  # scheduled, not yet updated
        self.stalled_since: float | None = None  # prefill_first: decodes left out since then
        self.proposer = (
            NgramProposer(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
            if config.speculative == "ngram"
            else None
        )

    @property
    def has_unfinished(self) -> bool:
        return bool(self.sequences)

    def add(self, seq: Sequence, now: float | None = None) -> None:
        """Queue a new sequence in priority order. Raises BadRequest for a bad prompt,
        Unavailable when it would miss its TTFT budget, and QueueFull when `max_waiting`
        sequences of its priority or higher wait."""
        if seq.seq_id in self.sequences:
            raise BadRequest(f"request id {seq.seq_id!r} is already in use")
        if not 0 < seq.num_tokens < self.config.max_model_len:
            raise BadRequest(
                f"prompt has {seq.num_tokens} tokens; it must have between 1 and "
                f"{self.config.max_model_len - 1} (max_model_len {self.config.max_model_len})"
            )
        now = seq.arrival if now is None else now
        prediction = self.admission.predict(self.load_ahead(seq), now)
        refusal = self.admission.refusal(prediction, seq.deadline, now)
        if refusal is not None:
            raise refusal
        if prediction is not None:
            seq.timings.predicted_ttft = prediction.seconds
            seq.timings.modelled_ttft = prediction.modelled if prediction.waits else None
        seq.timings.first_token_due = self.admission.due(prediction, seq.deadline, now)
        if len(self.waiting) >= self.config.max_waiting:
            victim = self._lowest_below(seq.priority)
            if victim is None:
                raise QueueFull(
                    f"{len(self.waiting)} requests are waiting (max_waiting)", retry_after=1.0
                )
            self.finish(victim, FinishReason.SHED)
            self.shed.append(victim)
        self._enqueue(seq)
        self.sequences[seq.seq_id] = seq

    def tokens_ahead(self, priority: int) -> int:
        """Prompt tokens to prefill before a new sequence of `priority` starts its own."""
        waiting = sum(s.num_uncomputed_tokens for s in self.waiting if s.priority <= priority)
        return waiting + sum(s.num_uncomputed_tokens for s in self.running if s.is_prefill)

    def load_ahead(self, seq: Sequence) -> LoadAhead:
        """What a new `seq` would wait behind if it were queued now."""
        waiting = [s for s in self.waiting if s.priority <= seq.priority]
        return LoadAhead(
            prompt_tokens=seq.num_tokens,
            ahead=self._prefills_ahead(waiting),
            running=[self._steps_left(s) for s in self.running],
            waiting=[self._steps_left(s) for s in waiting],
            in_flight=None if self.in_flight is None else self.in_flight.in_flight(),
        )

    def _prefills_ahead(self, waiting: list[Sequence]) -> list[QueuedPrefill]:
        """Prompts to prefill after the step in flight, in the order the scheduler takes them."""
        flight = self.in_flight.scheduled if self.in_flight is not None else []
        in_step = {s.seq.seq_id: s.num_tokens for s in flight}
        ahead = []
        for s in [*(r for r in self.running if r.is_prefill), *waiting]:
            left = s.num_uncomputed_tokens - in_step.get(s.seq_id, 0)
            due = s.timings.first_token_due if s.timings.first_token is None else None
            if left > 0:
                ahead.append(QueuedPrefill(left, due))
        return ahead

    def _steps_left(self, seq: Sequence) -> int:
        """Steps `seq` holds its slot at most: one per output token it may still produce."""
        tokens = min(
            seq.params.max_tokens - seq.num_output_tokens,
            self.config.max_model_len - seq.num_tokens,
        )
        return max(1, tokens)

    def _enqueue(self, seq: Sequence) -> None:
        """After the last waiting sequence of its priority or higher."""
        index = len(self.waiting)
        while index > 0 and self.waiting[index - 1].priority > seq.priority:
            index -= 1
        self.waiting.insert(index, seq)

    def _lowest_below(self, priority: int) -> Sequence | None:
        """The newest waiting sequence of the lowest priority below `priority`, if any."""
        if self.waiting and self.waiting[-1].priority > priority:
            return self.waiting[-1]
        return None

    def take_shed(self) -> list[Sequence]:
        shed, self.shed = self.shed, []
        return shed

    def abort(self, seq_id: str) -> Sequence | None:
        """Finish a sequence at once and free its blocks; None if it is unknown or done."""
        seq = self.sequences.get(seq_id)
        if seq is not None:
            self.finish(seq, FinishReason.ABORT)
        return seq

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self.sequences.pop(seq.seq_id, None)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput(started=now)
        self._expire(now, out)
        may_admit = self.config.continuous_batching or not self.running
        decodes = self._decodes_with_room(out)
        prompts_first = self._prompts_first(may_admit, now)
        tokens = self.steps.step_budget(0 if prompts_first else len(decodes))
        budget = _Budget(tokens, now)
        if prompts_first:
            self._schedule_prompts(may_admit, budget, out)
        self._schedule_decodes(decodes, budget, out)
        if self.proposer is not None:
            self._schedule_drafts(self.proposer, budget, out)
        if not prompts_first:
            self._schedule_prompts(may_admit, budget, out)
        self._note_stall(decodes, out, now)
        self.in_flight = out
        return out

    def _prompts_first(self, may_admit: bool, now: float) -> bool:
        """prefill_first, prompts queued, and no decode stalled past `max_decode_stall_ms`."""
        if not self.config.prefill_first:
            return False
        queued = (may_admit and bool(self.waiting)) or any(s.is_prefill for s in self.running)
        stall = self.config.max_decode_stall_ms / 1000
        return queued and (self.stalled_since is None or now - self.stalled_since < stall)

    def _note_stall(self, decodes: list[Sequence], out: SchedulerOutput, now: float) -> None:
        """Since when running sequences have been left out of steps (prefill_first)."""
        if len(decodes) > sum(1 for s in out.scheduled if s.is_decode):
            if self.stalled_since is None:
                self.stalled_since = now
        else:
            self.stalled_since = None

    def update(self, out: SchedulerOutput) -> None:
        """After the step ran: advance progress and publish newly full blocks (drafts count
        once verified: `accept_drafts`)."""
        self.in_flight = None
        for s in out.scheduled:
            if not s.seq.is_finished:  # not aborted while the step ran
                s.seq.num_computed_tokens += s.num_tokens - len(s.draft_token_ids)
                self.block_manager.cache_blocks(s.seq)

    def accept_drafts(self, seq: Sequence, num_accepted: int) -> None:
        """After the engine appended a sequence's accepted drafts and the token after them:
        the drafts' K/V are computed; the blocks past them held rejected drafts only."""
        seq.num_computed_tokens += num_accepted
        self.block_manager.trim(seq, seq.num_computed_tokens)
        self.block_manager.cache_blocks(seq)

    def _expire(self, now: float, out: SchedulerOutput) -> None:
        for seq in [*self.running, *self.waiting]:
            if seq.expired(now):
                self.finish(seq, FinishReason.DEADLINE)
                out.expired.append(seq)

    def _decodes_with_room(self, out: SchedulerOutput) -> list[Sequence]:
        """The running sequences that decode, each with a KV block for its next token (the
        newest running sequences are preempted for them when blocks run out)."""
        ready = []
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or seq.is_prefill:
                continue  # preempted by an older sequence, or still prefilling
            if self._make_room(seq, out):
                self.block_manager.may_append(seq)
                ready.append(seq)
        return ready

    def _schedule_decodes(
        self, decodes: list[Sequence], budget: _Budget, out: SchedulerOutput
    ) -> None:
        for seq in decodes:
            if budget.tokens == 0:
                return
            self._schedule(seq, 1, budget, out)

    def _schedule_prompts(self, may_admit: bool, budget: _Budget, out: SchedulerOutput) -> None:
        """Prompts being prefilled, then waiting sequences, within the budget."""
        self._schedule_partial_prefills(budget, out)
        if may_admit:
            self._admit(budget, out)

    def _schedule_drafts(
        self, proposer: NgramProposer, budget: _Budget, out: SchedulerOutput
    ) -> None:
        """Drafts for the decodes scheduled so far, within the budget and the free blocks."""
        for s in out.scheduled:
            if budget.tokens == 0:
                return
            drafts = proposer.propose(s.seq.token_ids, self._max_drafts(s.seq, budget.tokens))
            if drafts and self.block_manager.can_append(s.seq, len(drafts)):
                self.block_manager.may_append(s.seq, len(drafts))
                s.draft_token_ids = drafts
                s.num_tokens += len(drafts)
                budget.tokens -= len(drafts)

    def _max_drafts(self, seq: Sequence, budget_tokens: int) -> int:
        """Drafts that fit the budget, max_tokens and max_model_len with the token after them;
        none under a grammar (its matcher follows accepted tokens only)."""
        if seq.matcher is not None:
            return 0
        return min(
            budget_tokens,
            seq.params.max_tokens - seq.num_output_tokens - 1,
            self.config.max_model_len - seq.num_tokens - 1,
        )

    def _schedule_partial_prefills(self, budget: _Budget, out: SchedulerOutput) -> None:
        for seq in self.running:
            if seq.is_prefill and budget.tokens > 0:
                self._schedule(seq, self._chunk(seq, budget.tokens), budget, out)

    def _admit(self, budget: _Budget, out: SchedulerOutput) -> None:
        bm, continuous = self.block_manager, self.config.continuous_batching
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if continuous and budget.tokens == 0:
                return
            uncomputed = seq.num_tokens - bm.num_cached_prefix_tokens(seq)
            if continuous and self._chunk_size(uncomputed, budget.tokens) == 0:
                return  # chunked prefill off and the prompt does not fit whole
            if not bm.can_allocate(seq):
                return
            self.waiting.popleft()
            bm.allocate(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._schedule(seq, self._chunk(seq, budget.tokens), budget, out)

    def _make_room(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Preempt the newest running sequences until `seq` can append; False if it was one."""
        while not self.block_manager.can_append(seq):
            victim = self.running[-1]
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status, seq.num_computed_tokens = SequenceStatus.WAITING, 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        seq.timings.num_preemptions += 1
        out.preempted.append(seq.seq_id)

    def _chunk(self, seq: Sequence, budget_tokens: int) -> int:
        return self._chunk_size(seq.num_uncomputed_tokens, budget_tokens)

    def _chunk_size(self, uncomputed: int, budget_tokens: int) -> int:
        if uncomputed <= budget_tokens:
            return uncomputed
        return budget_tokens if self.config.enable_chunked_prefill else 0

    def _schedule(self, seq: Sequence, n: int, budget: _Budget, out: SchedulerOutput) -> None:
        if n == 0:
            return
        end = seq.num_computed_tokens + n
        out.scheduled.append(
            ScheduledSequence(seq, seq.num_computed_tokens, n, end == seq.num_tokens)
        )
        budget.tokens -= n
        seq.timings.record_scheduled(budget.now)
