"""One generation request as the engine tracks it: tokens, progress, blocks and limits.

Only the scheduler changes a sequence's status. Everything here is plain Python.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from lockgate.errors import BadRequest
from lockgate.llm.guided import Grammar, GrammarMatcher
from lockgate.llm.metrics import RequestTimings


class InvalidSamplingParams(BadRequest, ValueError):
    """A sampling parameter is out of range (HTTP 400)."""


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"  # EOS, a stop token, a stop string or the end of the grammar
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled or client disconnected
    DEADLINE = "deadline"  # deadline passed before the request finished
    SHED = "shed"  # refused while waiting, for a request of higher priority


@dataclass(slots=True)
class TokenLogprobs:
    """A token's logprob, and the `top` most likely tokens at its position with theirs."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]
    rank: int = 0  # of the token among all at its position, 1 the most likely (0: not known)


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Validated on construction."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    # no stop (EOS, stop token or stop string) before this many output tokens: the tokens
    # that would stop it are masked (`min_tokens_blocked`, EOS and stop tokens, which the
    # engine fills in as it takes the request)
    min_tokens: int = 0
    min_tokens_blocked: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # a stop string ends the text, and is kept
    skip_special_tokens: bool = True  # special tokens' text left out of the output text
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM's (as in CTRL): the logits of tokens in the prompt or the output are divided by it
    # when positive, multiplied when negative; 1: off
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # number of top alternatives to report per token
    # the same for each prompt token after the first (its logprob given the tokens before it;
    # the completions API's `echo` with `logprobs`); None: none computed
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # vLLM's: the only tokens the output may take (None: any), in increasing order
    allowed_token_ids: tuple[int, ...] | None = None
    # vLLM's bad_words as token ids: the output never ends with one of these sequences (the
    # last token of each is blocked where the output ends with the ones before it)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    grammar: Grammar | None = None  # what the output must match (guided decoding)
    # vLLM's cache_salt: the prefix cache is shared only among sequences of the same salt
    # (not sampling, but the request's, carried with it to the sequence's blocks)
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple(self.logit_bias))
        object.__setattr__(self, "min_tokens_blocked", tuple(self.min_tokens_blocked))
        if self.allowed_token_ids is not None:
            object.__setattr__(
                self, "allowed_token_ids", tuple(sorted(set(self.allowed_token_ids)))
            )
        words = tuple(tuple(word) for word in self.bad_words_token_ids)
        object.__setattr__(self, "bad_words_token_ids", words)
        problems = self._problems()
        if problems:  # each names its field first
            raise InvalidSamplingParams(
                "invalid sampling parameters: " + "; ".join(problems),
                param=problems[0].split()[0],
            )

    def _problems(self) -> list[str]:
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature must be >= 0"),
            (self.top_k >= -1, "top_k must be -1, 0 (off) or a positive count"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.max_tokens >= 1, "max_tokens must be >= 1"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens must be in [0, max_tokens]"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]"),
            (0.0 < self.repetition_penalty <= 10.0, "repetition_penalty must be in (0, 10]"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             "prompt_logprobs must be in [0, 20]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed must be in [0, 2**63)"),
            (all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings"),
            (all(t >= 0 for t in self.stop_token_ids), "stop_token_ids must be >= 0"),
            (all(t >= 0 and -100.0 <= b <= 100.0 for t, b in self.logit_bias),
             "logit_bias maps token ids to values in [-100, 100]"),
            (self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0 and all(
                t >= 0 for t in self.allowed_token_ids)),
             "allowed_token_ids must be a non-empty list of token ids"),
            (all(word and all(t >= 0 for t in word) for word in self.bad_words_token_ids),
             "bad_words_token_ids must be non-empty lists of token ids"),
            (self.cache_salt is None or self.cache_salt != "",
             "cache_salt must be a non-empty string"),
        ]  # fmt: skip
        return [message for ok, message in checks if not ok]

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def has_repetition_penalty(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def reads_output(self) -> bool:
        """Whether sampling reads the tokens output so far (penalties, bad words)."""
        return self.has_penalties or bool(self.bad_words_token_ids)

    def bad_words_blocked(self, output_token_ids: list[int]) -> list[int]:
        """The tokens the bad words block next, after `output_token_ids` (vLLM's: a word's
        last token, where the output ends with the tokens before it; a one-token word,
        always)."""
        blocked = []
        for word in self.bad_words_token_ids:
            prefix = len(word) - 1
            if prefix > len(output_token_ids):
                continue
            if not prefix or tuple(output_token_ids[-prefix:]) == word[:-1]:
                blocked.append(word[-1])
        return blocked


@dataclass(slots=True, eq=False)
class Sequence:
    """A request's tokens (prompt then output), its progress and its KV blocks."""

    seq_id: str
    token_ids: list[int]  # prompt followed by output
    num_prompt_tokens: int
    params: SamplingParams
    arrival: float
    deadline: float | None = None  # time.monotonic() seconds
    priority: int = 1  # 1 is the highest; waiting sequences are taken in priority order
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of the prompt, tokens served by the prefix cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    num_hashed_blocks: int = 0  # leading blocks already offered to the prefix cache
    output_text: str = ""
    num_emitted_chars: int = 0  # of output_text, already returned to the client
    timings: RequestTimings = field(init=False)
    matcher: GrammarMatcher | None = field(init=False)  # where the output is in its grammar
    # with params.prompt_logprobs: entry p is prompt token p's (None for the first), filled as
    # the prompt's chunks are computed
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.timings = RequestTimings(
            arrival=self.arrival, num_prompt_tokens=self.num_prompt_tokens
        )
        grammar = self.params.grammar
        self.matcher = None if grammar is None else grammar.matcher()

    @classmethod
    def from_prompt(
        cls,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival: float,
        deadline: float | None = None,
        priority: int = 1,
    ) -> Sequence:
        prompt = list(prompt_token_ids)
        return cls(seq_id, prompt, len(prompt), params, arrival, deadline, priority)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """More than the last token still needs computing (a prompt or a recompute)."""
        return len(self.token_ids) - self.num_computed_tokens > 1

    @property
    def reads_prefix_cache(self) -> bool:
        """Whether its prompt may start from cached blocks: not when its prompt's logprobs
        are asked for, which need every prompt position computed."""
        return self.params.prompt_logprobs is None

    def prompt_logprob_rows(self, start: int, num_tokens: int) -> range:
        """The positions among `start`..`start + num_tokens` whose hidden state gives a
        prompt token's logprob not yet recorded (position t gives token t + 1's)."""
        if self.params.prompt_logprobs is None:
            return range(0)
        first = max(start, len(self.prompt_logprobs) - 1 if self.prompt_logprobs else 0)
        return range(first, min(start + num_tokens, self.num_prompt_tokens - 1))

    def record_prompt_logprobs(self, entries: list[TokenLogprobs]) -> None:
        """The logprobs of the next prompt tokens, in order."""
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)  # the first token has none
        self.prompt_logprobs.extend(entries)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def grammar_finish(self) -> FinishReason | None:
        """STOP once the output matches its grammar whole (no further token fits); LENGTH
        once the grammar's masks went over their budget (cut short, as by max_tokens)."""
        matcher = self.matcher
        if matcher is None:
            return None
        if matcher.is_complete:
            return FinishReason.STOP
        return FinishReason.LENGTH if matcher.over_budget else None

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.matcher is not None:
            self.matcher.advance(token_id)

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline
