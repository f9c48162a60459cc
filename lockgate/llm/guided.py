"""Guided decoding: a request's output held to a JSON schema, a regular expression or a Lark
grammar, through llguidance.

llguidance rather than xgrammar: it needs neither torch nor transformers, computes each
token mask on the CPU in microseconds, and takes JSON schemas, regular expressions and Lark
grammars alike.

    GrammarCompiler   one model's vocabulary; compiles a request's grammar before admission
                      (BadRequest naming what is wrong)
    Grammar           the compiled grammar, in the request's SamplingParams; plain data for
                      equality and the response cache's key
    GrammarMatcher    one sequence's place in its grammar: the tokens allowed next, advanced
                      by each token the sequence takes

The runner turns the matchers of a batch into a mask over the logits (`sampling.TokenMask`);
nothing here touches a tensor.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from lockgate.errors import BadRequest
from lockgate.extras import MissingExtra, import_for

log = logging.getLogger("lockgate.llm.guided")

GrammarKind = Literal["json_schema", "regex", "lark"]


@dataclass(frozen=True, slots=True)
class Grammar:
    """A compiled constraint on a request's output. Equal, hashed and shown by its kind and
    source; the compiled matcher is never advanced, only copied for each sequence."""

    kind: GrammarKind
    source: str  # the JSON schema (as JSON text), the regular expression or the Lark grammar
    compiled: Any = field(repr=False, compare=False)  # llguidance.LLMatcher at the start
    mask_words: int = field(repr=False, compare=False)  # 32-bit words of one token mask
    mask_budget: float = field(default=0.0, repr=False, compare=False)  # CPU s; 0: none

    def matcher(self) -> GrammarMatcher:
        """A matcher of its own for one sequence, at the start of the grammar."""
        return GrammarMatcher(self.compiled.deep_copy(), self.mask_words, self.mask_budget)


class GrammarMatcher:
    """One sequence's place in its grammar. A grammar whose masks cost more than its budget
    (a schema of many ambiguous alternatives can take seconds a token, whatever its size)
    is over: its sequence ends, as max_tokens ends one."""

    __slots__ = ("_matcher", "mask_budget", "mask_words", "over_budget")

    def __init__(self, matcher: Any, mask_words: int, mask_budget: float = 0.0) -> None:
        self._matcher = matcher  # llguidance.LLMatcher
        self.mask_words = mask_words
        self.mask_budget = mask_budget  # CPU seconds of one mask; 0: no bound
        self.over_budget = False

    def fill_mask(self, address: int) -> None:
        """Write the tokens allowed next as `mask_words` 32-bit words at `address` (bit j of
        word w allows token 32w + j). Only the end-of-sequence tokens are allowed once the
        grammar is complete."""
        start = time.thread_time()  # CPU time: a busy machine does not count against it
        self._matcher.unsafe_compute_mask_ptr(address, 4 * self.mask_words)
        spent = time.thread_time() - start
        if self.mask_budget and spent > self.mask_budget and not self.over_budget:
            self.over_budget = True
            log.warning(
                "guided decoding: a token mask took %.0f ms of CPU, more than the limit of "
                "%.0f ms: the sequence ends",
                1e3 * spent,
                1e3 * self.mask_budget,
            )

    def advance(self, token_id: int) -> None:
        """Follow the token the sequence took. A token the grammar refuses (none is, when the
        mask was applied) leaves the matcher complete, allowing only end-of-sequence."""
        if not self._matcher.consume_token(token_id):
            log.warning("guided decoding: token %d refused: %s", token_id, self.error)

    @property
    def is_complete(self) -> bool:
        """No further token fits the grammar: the output is whole (or the matcher failed)."""
        return bool(self._matcher.is_stopped())

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


class GrammarCompiler:
    """Compiles grammars against one model's vocabulary. The llguidance form of the model's
    tokenizer is built once, here (about 0.3 s and 18 MiB for SmolLM2's 49,152 tokens); a
    model without it (llguidance not installed, or a tokenizer it cannot read) refuses
    guided requests with the reason."""

    def __init__(self, tokenizer_json: str, eos_token_ids: Iterable[int]) -> None:
        self.problem: str | None = None  # why this model cannot be guided
        self._llg: Any = None
        self._tokenizer: Any = None
        try:
            self._llg = import_for("llguidance", "llm", "guided decoding")
            eos = sorted(eos_token_ids)
            self._tokenizer = self._llg.LLTokenizer(tokenizer_json, eos_token=eos or None)
        except MissingExtra as exc:
            self.problem = str(exc)
        except Exception as exc:  # llguidance refuses the tokenizer
            self.problem = f"llguidance cannot read this model's tokenizer: {exc}"
        self.mask_words = 0 if self._tokenizer is None else (self._tokenizer.vocab_size + 31) // 32

    def compile(
        self,
        kind: GrammarKind,
        source: str,
        *,
        strict: bool = True,
        where: str = "grammar",
        mask_budget: float = 0.0,
    ) -> Grammar:
        """`source` compiled for this model; BadRequest naming `where` (the request field it
        came from) and what is wrong. A JSON schema that is not `strict` may hold keywords
        llguidance does not enforce (they are ignored); a strict one is refused for them.
        `mask_budget` bounds the CPU seconds of one token mask (0: no bound)."""
        if self.problem is not None:
            raise BadRequest(f"{where}: guided decoding is not available: {self.problem}")
        llg = self._llg
        if kind == "json_schema":
            try:
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    source, overrides={"lenient": not strict}
                )
            except ValueError as exc:
                raise BadRequest(f"{where}: not a JSON schema: {exc}") from None
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(source)
        else:
            grammar = llg.LLMatcher.grammar_from_lark(source)
        matcher = llg.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise BadRequest(f"{where}: {_first_lines(matcher.get_error())}")
        return Grammar(kind, source, matcher, self.mask_words, mask_budget)


def _first_lines(message: str, most: int = 12) -> str:
    """An llguidance error, without the parser state it may append."""
    lines = message.strip().splitlines()
    kept = lines[: lines.index("<state>")] if "<state>" in lines else lines
    return "\n".join(kept[:most])
