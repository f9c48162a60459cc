"""Pick the next token of every sequence in one pass of tensor ops over [N, V] logits.

Order of processing, per row: the repetition penalty (over the row's prompt and output
tokens), presence/frequency penalties (from the counts of the row's output tokens), then
temperature, top-k, top-p and min-p. Greedy rows (temperature 0) take
the argmax of the penalized logits and skip temperature and the filters.

Random rows sample by inverting the CDF: one uniform number per row, located in the row's
cumulative probabilities (one cumsum and a binary search; an exponential race or
`torch.multinomial` would draw V random numbers per row). Unseeded rows share the sampler's
generator. A seeded row draws its number from a generator seeded by (seed, index of the
token being generated), so its draws do not depend on which other requests share the batch,
nor on preemption and recompute. Its logits can: a quantized model runs a step of few rows
on the int4 kernel and a larger one on the dense copy (`quantized_linear`), whose sums round
differently, and where two tokens are nearly tied the same draw lands on either.

Top-p looks for the nucleus among each row's `TOP_P_WINDOW` largest logits and sorts the
whole row only when the nucleus is larger than that.

Rows under a grammar (guided decoding) have the tokens it does not allow next set to -inf,
after the logit biases and before temperature and the filters; a batch without such rows
computes no mask. vLLM's `allowed_token_ids` is a mask of the same kind, after the grammar's;
its `bad_words` set -inf, with the logit biases, on the last token of each word whose other
tokens the output ends with.

Logprobs are the model's own: the log_softmax of the raw logits, before penalties, biases,
the grammar's mask, temperature and filters (as OpenAI's, and vLLM's default
`raw_logprobs`), so they do not depend on how a token was drawn. Taken after the filters, a
request at the model's default temperature and top_p had nearly every chosen token at 0.0
and its other top tokens at -inf (null in JSON). A token the model gives no chance at all
is -9999.0, as in vLLM (JSON has no -inf).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lockgate.llm.guided import GrammarMatcher
from lockgate.llm.sequence import SamplingParams, TokenLogprobs

_SEED_MIX = 0x9E3779B97F4A7C15
_U_MAX = 1.0 - 2.0**-24  # uniforms stay below 1 so the search never runs off the end
TOP_P_WINDOW = 128


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # [N]
    logprobs: list[TokenLogprobs | None]  # [N]; None where the request asked for none

    def split(self, sizes: list[int]) -> list[SamplerOutput]:
        """Consecutive runs of `sizes` rows, which must add up to N."""
        if sum(sizes) != len(self.token_ids):
            raise ValueError(f"{len(self.token_ids)} sampled rows split into {sum(sizes)}")
        bounds = list(itertools.accumulate(sizes, initial=0))
        return [
            SamplerOutput(self.token_ids[a:b], self.logprobs[a:b])
            for a, b in itertools.pairwise(bounds)
        ]


@dataclass(slots=True)
class LogitBias:
    """Sparse additions to the logits: row i, token j, value b for every entry."""

    rows: torch.Tensor  # [E] int64
    tokens: torch.Tensor  # [E] int64
    values: torch.Tensor  # [E] float32

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        num_output_tokens: Sequence[int],
        output_token_ids: Sequence[list[int]] = (),
    ) -> LogitBias | None:
        """The requests' logit_bias, and -inf on the tokens a row short of its min_tokens
        may not take (it has generated `num_output_tokens[row]`) and on those its bad words
        block after `output_token_ids[row]`."""
        entries = [(row, t, b) for row, p in enumerate(params) for t, b in p.logit_bias]
        entries += [
            (row, t, -math.inf)
            for row, (p, n) in enumerate(zip(params, num_output_tokens, strict=True))
            if n < p.min_tokens
            for t in p.min_tokens_blocked
        ]
        entries += [
            (row, t, -math.inf)
            for row, (p, out) in enumerate(zip(params, output_token_ids, strict=False))
            if p.bad_words_token_ids
            for t in p.bad_words_blocked(out)
        ]
        if not entries:
            return None
        rows, tokens, values = zip(*entries, strict=True)
        return cls(
            torch.tensor(rows, dtype=torch.int64),
            torch.tensor(tokens, dtype=torch.int64),
            torch.tensor(values, dtype=torch.float32),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] with the biases added (a copy)."""
        return logits.index_put(
            (self.rows, self.tokens), self.values.to(logits.dtype), accumulate=True
        )


@dataclass(slots=True)
class TokenMask:
    """The tokens each grammar-constrained row may take next; other rows are left alone."""

    rows: torch.Tensor  # [R] int64, the constrained rows
    bits: torch.Tensor  # [R, W] int32; bit j of word w allows token 32w + j

    @classmethod
    def build(cls, matchers: Sequence[GrammarMatcher | None]) -> TokenMask | None:
        constrained = [(row, m) for row, m in enumerate(matchers) if m is not None]
        if not constrained:
            return None
        bits = torch.empty((len(constrained), constrained[0][1].mask_words), dtype=torch.int32)
        for i, (_, matcher) in enumerate(constrained):
            matcher.fill_mask(bits[i].data_ptr())
        return cls(torch.tensor([row for row, _ in constrained], dtype=torch.int64), bits)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] with the tokens a constrained row may not take at -inf (a copy)."""
        v = logits.shape[1]
        # each byte of the (little-endian) words holds 8 tokens: looked up, not shifted
        data = self.bits.view(torch.uint8).long()  # [R, 4W]
        blocked = torch.nn.functional.embedding(data, _BYTE_PENALTY).flatten(1)  # [R, 32W]
        if blocked.shape[1] < v:  # logits past the tokenizer's vocabulary: never allowed
            blocked = torch.nn.functional.pad(blocked, (0, v - blocked.shape[1]), value=-math.inf)
        return logits.index_add(0, self.rows, blocked[:, :v].to(logits.dtype))


@dataclass(slots=True)
class AllowedTokens:
    """vLLM's allowed_token_ids: the only tokens each such row may take; other rows are left
    alone."""

    rows: torch.Tensor  # [R] int64
    allowed: torch.Tensor  # [R, V] bool

    @classmethod
    def build(cls, params: Sequence[SamplingParams], vocab_size: int) -> AllowedTokens | None:
        limited = [
            (row, p.allowed_token_ids)
            for row, p in enumerate(params)
            if p.allowed_token_ids is not None
        ]
        if not limited:
            return None
        ids = _padded([list(ids or ()) for _, ids in limited], vocab_size)  # [R, A], padded with V
        allowed = torch.zeros(len(limited), vocab_size + 1, dtype=torch.bool)
        allowed.scatter_(1, ids, True)
        rows = torch.tensor([row for row, _ in limited], dtype=torch.int64)
        return cls(rows, allowed[:, :vocab_size])

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [N, V] with the tokens a limited row may not take at -inf (a copy)."""
        v = min(logits.shape[1], self.allowed.shape[1])
        limited = torch.full((len(self.rows), logits.shape[1]), -math.inf, dtype=logits.dtype)
        limited[:, :v] = logits[self.rows, :v].masked_fill(~self.allowed[:, :v], -math.inf)
        return logits.index_copy(0, self.rows, limited)


# byte value -> what its 8 tokens add to their logits: 0 where the bit is set, else -inf
_BYTE_PENALTY = torch.where(
    (torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1 == 1, 0.0, -math.inf
)  # [256, 8] float32


@dataclass(slots=True)
class SamplingBatch:
    """Per-row parameters as tensors; None for a process that no row uses."""

    temperature: torch.Tensor  # [N] float32, 1.0 on greedy rows
    is_greedy: torch.Tensor  # [N] bool
    all_greedy: bool
    top_k: torch.Tensor | None  # [N] int64, V where off
    top_p: torch.Tensor | None  # [N] float32, 1.0 where off
    min_p: torch.Tensor | None  # [N] float32
    presence_penalty: torch.Tensor | None  # [N] float32
    frequency_penalty: torch.Tensor | None  # [N] float32
    output_token_ids: torch.Tensor | None  # [N, L] int64, padded with V
    repetition_penalty: torch.Tensor | None  # [N] float32, 1.0 where off
    seen_token_ids: torch.Tensor | None  # [N, S] int64, prompt and output, padded with V
    bias: LogitBias | None  # additions to chosen logits; None when no row has any
    mask: TokenMask | None  # tokens allowed by grammars; None when no row has one
    allowed: AllowedTokens | None  # tokens allowed by allowed_token_ids; None: no row has any
    seeds: dict[int, int]  # row -> seed for this token
    num_logprobs: list[int | None]  # [N]

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        output_token_ids: Sequence[list[int]],
        num_output_tokens: Sequence[int],
        vocab_size: int,
        matchers: Sequence[GrammarMatcher | None] = (),
        seen_token_ids: Sequence[list[int]] = (),
    ) -> SamplingBatch:
        """Row i has generated `num_output_tokens[i]` tokens so far (seeds count them);
        `output_token_ids[i]` lists them where the row has penalties or bad words (elsewhere
        unused);
        `matchers[i]` is its grammar's matcher, if any (none given: no row has one);
        `seen_token_ids[i]`, its prompt and output where it has a repetition penalty (none
        given: no row has one)."""
        repeats = any(p.has_repetition_penalty for p in params)
        greedy = [p.is_greedy for p in params]
        sampled = [p for p in params if not p.is_greedy]
        return cls(
            temperature=torch.tensor([1.0 if p.is_greedy else p.temperature for p in params]),
            is_greedy=torch.tensor(greedy, dtype=torch.bool),
            all_greedy=all(greedy),
            top_k=_row_param([_top_k(p, vocab_size) for p in params], any(
                0 < p.top_k < vocab_size for p in sampled), torch.int64),
            top_p=_row_param([1.0 if p.is_greedy else p.top_p for p in params], any(
                p.top_p < 1.0 for p in sampled), torch.float32),
            min_p=_row_param([0.0 if p.is_greedy else p.min_p for p in params], any(
                p.min_p > 0.0 for p in sampled), torch.float32),
            presence_penalty=_row_param([p.presence_penalty for p in params], any(
                p.has_penalties for p in params), torch.float32),
            frequency_penalty=_row_param([p.frequency_penalty for p in params], any(
                p.has_penalties for p in params), torch.float32),
            output_token_ids=_padded(output_token_ids, vocab_size) if any(
                p.has_penalties for p in params) else None,
            repetition_penalty=_row_param([p.repetition_penalty for p in params], repeats,
                torch.float32),
            seen_token_ids=_padded(seen_token_ids, vocab_size) if repeats else None,
            bias=LogitBias.build(params, num_output_tokens, output_token_ids),
            mask=TokenMask.build(matchers),
            allowed=AllowedTokens.build(params, vocab_size),
            seeds={i: _row_seed(p.seed, n) for i, (p, n) in enumerate(
                zip(params, num_output_tokens, strict=True)) if p.seed is not None
                and not p.is_greedy},
            num_logprobs=[p.logprobs for p in params],
        )  # fmt: skip


def _top_k(p: SamplingParams, vocab_size: int) -> int:
    return p.top_k if 0 < p.top_k < vocab_size and not p.is_greedy else vocab_size


def _row_param(
    values: list[float] | list[int], used: bool, dtype: torch.dtype
) -> torch.Tensor | None:
    return torch.tensor(values, dtype=dtype) if used else None


def _row_seed(seed: int, token_index: int) -> int:
    return (seed * _SEED_MIX + token_index) % (2**63)


def _padded(rows: Sequence[list[int]], vocab_size: int) -> torch.Tensor:
    """Token ids [N, L], each row padded with V (a token past the vocabulary)."""
    width = max(1, max(len(o) for o in rows))
    return torch.tensor([o + [vocab_size] * (width - len(o)) for o in rows], dtype=torch.int64)


class Sampler:
    """Turns fp32 logits [N, V] into one token per row (plus logprobs where asked)."""

    def __init__(self, seed: int | None = None) -> None:
        self.generator = torch.Generator()
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        raw = logits.float()  # [N, V]
        logits = apply_penalties(raw, batch)
        if batch.bias is not None:
            logits = batch.bias.apply(logits)
        if batch.mask is not None:
            logits = batch.mask.apply(logits)
        if batch.allowed is not None:
            logits = batch.allowed.apply(logits)
        if batch.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            processed = self._filter(logits / batch.temperature.unsqueeze(1), batch)
            tokens = self._draw(processed, batch)
            if bool(batch.is_greedy.any()):
                tokens = torch.where(batch.is_greedy, processed.argmax(dim=-1), tokens)
        token_list: list[int] = tokens.tolist()
        return SamplerOutput(token_list, _logprobs(raw, tokens, batch.num_logprobs))

    def _filter(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.top_p is not None:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        elif batch.top_k is not None:
            logits = apply_top_k(logits, batch.top_k)
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        return logits

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        cdf = logits.softmax(dim=-1).cumsum_(dim=-1)  # [N, V]
        u = torch.rand(logits.shape[0], generator=self.generator)  # [N]
        for row, seed in batch.seeds.items():
            u[row] = torch.rand(1, generator=torch.Generator().manual_seed(seed))
        target = u.clamp_(max=_U_MAX).mul_(cdf[:, -1])  # [N]
        tokens = torch.searchsorted(cdf, target.unsqueeze(1), right=True).squeeze(1)  # [N]
        return tokens.clamp_(max=logits.shape[1] - 1)


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The repetition penalty (a seen token's logit divided by it when positive, multiplied
    when not), then logits -= frequency * count + presence * (count > 0), counts over output
    tokens."""
    if batch.seen_token_ids is not None:
        assert batch.repetition_penalty is not None
        n, v = logits.shape
        seen = torch.zeros(n, v + 1, dtype=torch.bool)
        seen = seen.scatter_(1, batch.seen_token_ids, True)[:, :v]  # [N, V]
        penalty = torch.where(seen, batch.repetition_penalty.unsqueeze(1), 1.0)  # [N, V]
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if batch.output_token_ids is None:
        return logits
    assert batch.presence_penalty is not None and batch.frequency_penalty is not None
    n, v = logits.shape
    ids = batch.output_token_ids  # [N, L], padded with V
    counts = torch.zeros(n, v + 1, dtype=logits.dtype).scatter_add_(
        1, ids, torch.ones_like(ids, dtype=logits.dtype)
    )[:, :v]  # [N, V]
    penalty = batch.frequency_penalty.unsqueeze(1) * counts
    penalty += batch.presence_penalty.unsqueeze(1) * (counts > 0).to(logits.dtype)
    return logits - penalty


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep each row's k largest logits (ties at the k-th value are kept)."""
    active = (top_k < logits.shape[1]).unsqueeze(1)  # [N, 1]
    k_max = int(top_k.masked_fill(~active.squeeze(1), 1).max())
    top_values = logits.topk(k_max, dim=-1).values  # [N, k_max]
    threshold = top_values.gather(1, (top_k.clamp(max=k_max) - 1).unsqueeze(1))  # [N, 1]
    threshold = threshold.masked_fill(~active, float("-inf"))
    return logits.masked_fill(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    """Top-k, then the smallest set of tokens whose probability reaches top_p."""
    n, v = logits.shape
    k = top_k if top_k is not None else torch.full((n,), v, dtype=torch.int64)
    window = min(v, max(TOP_P_WINDOW, int(k.masked_fill(k >= v, 0).max())))
    values, indices = logits.topk(window, dim=-1)  # [N, W] descending
    rank = torch.arange(window).unsqueeze(0)  # [1, W]
    values = values.masked_fill(rank >= k.unsqueeze(1), float("-inf"))  # top-k
    # normalizer of the top-k distribution: in the window when k fits, else the whole row
    k_fits = (k <= window).unsqueeze(1)  # [N, 1]
    lse = torch.where(
        k_fits, values.logsumexp(-1, keepdim=True), logits.logsumexp(-1, keepdim=True)
    )
    cumulative = (values - lse).exp().cumsum(dim=-1)  # [N, W]
    mass_before = cumulative - (values - lse).exp()  # exclusive cumsum
    keep = mass_before < top_p.unsqueeze(1)  # [N, W], the nucleus
    resolved = k_fits.squeeze(1) | (cumulative[:, -1] >= top_p)  # [N]
    out = torch.full_like(logits, float("-inf")).scatter_(
        1, indices, values.masked_fill(~keep, float("-inf"))
    )
    if not bool(resolved.all()):  # a nucleus wider than the window: sort those rows
        rows = (~resolved).nonzero().squeeze(1)
        out[rows] = _top_k_top_p_sorted(logits[rows], k[rows], top_p[rows])
    return out


def _top_k_top_p_sorted(logits: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=False)  # [R, V] ascending
    cut = (logits.shape[1] - k.clamp(max=logits.shape[1])).unsqueeze(1)  # k-th largest
    sorted_logits.masked_fill_(sorted_logits < sorted_logits.gather(1, cut), float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)  # [N, V]
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)  # [N, 1]
    return logits.masked_fill(probs < threshold, float("-inf"))


LOGPROB_FLOOR = -9999.0  # what a token of probability 0 reports


def _logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]
) -> list[TokenLogprobs | None]:
    if all(n is None for n in wanted):
        return [None] * len(wanted)
    logprobs = raw.log_softmax(dim=-1).clamp_(min=LOGPROB_FLOOR)  # [N, V]
    chosen: list[float] = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    k = max(n or 0 for n in wanted)
    top = logprobs.topk(k, dim=-1) if k else None
    top_ids: list[list[int]] = top.indices.tolist() if top is not None else [[]] * len(wanted)
    top_lps: list[list[float]] = top.values.tolist() if top is not None else [[]] * len(wanted)
    token_list: list[int] = tokens.tolist()
    return [
        None
        if n is None
        else TokenLogprobs(token_list[i], chosen[i], top_ids[i][:n], top_lps[i][:n])
        for i, n in enumerate(wanted)
    ]
