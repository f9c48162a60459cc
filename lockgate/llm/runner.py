"""The tensor boundary: scheduled sequences become flat tensors, the model runs, tokens come back.

The model sees only `input_ids`, `positions`, `AttentionMetadata` and its KV cache; the
scheduler's types end here.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from lockgate.llm.attention import AttentionMetadata, KVCache
from lockgate.llm.guided import GrammarMatcher
from lockgate.llm.sampling import LOGPROB_FLOOR, Sampler, SamplerOutput, SamplingBatch
from lockgate.llm.scheduler import ScheduledSequence, SchedulerOutput
from lockgate.llm.sequence import SamplingParams, TokenLogprobs

PROMPT_LOGITS_ROWS = 256  # prompt rows whose logits are computed at once (bounds their memory)


class CausalLM(Protocol):
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: KVCache,
    ) -> torch.Tensor: ...  # hidden [T, H]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...  # [N, H] -> [N, V] fp32


@dataclass(slots=True)
class PromptRows:
    """The rows of T whose logits give prompt tokens' logprobs: row i predicts `targets[i]`,
    reported with the `top[i]` most likely tokens; `counts[j]` rows belong to scheduled
    sequence j (in order)."""

    rows: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    top: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    prompt_rows: PromptRows = field(default_factory=PromptRows)


@dataclass(slots=True)
class RunnerOutput:
    sampled: SamplerOutput  # per scheduled sequence with needs_logits, in order: num_logits
    # rows (its last token's, then one per draft token)
    prepare_time: float
    forward_time: float  # model forward + logits
    sample_time: float
    # per scheduled sequence, in order: the prompt tokens' logprobs this step computed
    prompt_logprobs: list[list[TokenLogprobs]] = field(default_factory=list)


class ModelRunner:
    """Owns the model and its KV cache; one `run` per engine step."""

    def __init__(self, model: CausalLM, kv_caches: KVCache, block_size: int, sampler: Sampler):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        """Lay the scheduled tokens end to end and map each to its KV slot."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        tables: list[list[int]] = []
        prompt = PromptRows()
        for s in out.scheduled:
            start, end, table = s.start, s.start + s.num_tokens, s.seq.block_table
            input_ids += s.input_token_ids
            positions += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            query_start.append(query_start[-1] + s.num_tokens)
            seq_lens.append(end)
            tables.append(table)
            logits_indices += range(query_start[-1] - s.num_logits, query_start[-1])
            rows = s.prompt_logprob_rows
            prompt.rows += (query_start[-2] + t - start for t in rows)
            prompt.targets += s.seq.token_ids[rows.start + 1 : rows.stop + 1]
            prompt.top += [s.seq.params.prompt_logprobs or 0] * len(rows)
            prompt.counts.append(len(rows))
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(query_start, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=torch.tensor(
                [t + [0] * (width - len(t)) for t in tables], dtype=torch.int64
            ),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64),
            max_query_len=max(s.num_tokens for s in out.scheduled),
            max_seq_len=max(seq_lens),
            block_size=bs,
            query_lens_list=[s.num_tokens for s in out.scheduled],
            seq_lens_list=seq_lens,
        )
        return ModelInput(
            torch.tensor(input_ids, dtype=torch.int64),
            torch.tensor(positions, dtype=torch.int64),
            meta,
            prompt,
        )

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> RunnerOutput:
        """Compute the scheduled tokens and sample for the rows that need logits."""
        t0 = time.perf_counter()
        inp = self.prepare(out)
        t1 = time.perf_counter()
        rows = [s for s in out.scheduled if s.needs_logits]
        hidden = self.model.forward(
            inp.input_ids, inp.positions, inp.meta, self.kv_caches
        )  # [T, H]
        prompt = self.prompt_logprobs(hidden, inp.prompt_rows) if inp.prompt_rows.rows else []
        if not rows:
            empty = SamplerOutput([], [])
            return RunnerOutput(empty, t1 - t0, time.perf_counter() - t1, 0.0, prompt)
        logits = self.model.compute_logits(hidden[inp.meta.logits_indices])  # [N, V] fp32
        t2 = time.perf_counter()
        sampled = self.sampler(logits, sampling_batch(rows, vocab_size=logits.shape[1]))
        return RunnerOutput(sampled, t1 - t0, t2 - t1, time.perf_counter() - t2, prompt)

    def prompt_logprobs(
        self, hidden: torch.Tensor, prompt: PromptRows
    ) -> list[list[TokenLogprobs]]:
        """The logprob of each prompt row's target and its top tokens, as the sampler reports
        a sampled token's (the raw model's), per scheduled sequence; the logits are computed
        `PROMPT_LOGITS_ROWS` rows at a time, to bound their memory."""
        entries: list[TokenLogprobs] = []
        k = max(prompt.top)
        for a in range(0, len(prompt.rows), PROMPT_LOGITS_ROWS):
            rows = torch.tensor(prompt.rows[a : a + PROMPT_LOGITS_ROWS], dtype=torch.int64)
            targets = torch.tensor(prompt.targets[a : a + PROMPT_LOGITS_ROWS], dtype=torch.int64)
            logprobs = self.model.compute_logits(hidden[rows]).log_softmax(dim=-1)
            logprobs = logprobs.clamp_(min=LOGPROB_FLOOR)  # [R, V]
            picked = logprobs.gather(1, targets.unsqueeze(1))  # [R, 1]
            ranks: list[int] = ((logprobs > picked).sum(dim=-1) + 1).tolist()
            chosen: list[float] = picked.squeeze(1).tolist()
            top = logprobs.topk(k, dim=-1) if k else None
            ids: list[list[int]] = top.indices.tolist() if top is not None else []
            values: list[list[float]] = top.values.tolist() if top is not None else []
            for i, logprob in enumerate(chosen):
                n = prompt.top[a + i]
                top_ids = ids[i][:n] if top is not None else []
                top_lps = values[i][:n] if top is not None else []
                target = prompt.targets[a + i]
                entries.append(TokenLogprobs(target, logprob, top_ids, top_lps, ranks[i]))
        per_sequence, at = [], 0
        for count in prompt.counts:
            per_sequence.append(entries[at : at + count])
            at += count
        return per_sequence


def sampling_batch(rows: list[ScheduledSequence], vocab_size: int) -> SamplingBatch:
    """One sampling row per logits row. A draft's row samples the token after it as if the
    drafts up to it had been generated: its penalties count them and its seed is that
    token's. Sequences under a grammar have no drafts (the scheduler gives them none)."""
    params: list[SamplingParams] = []
    outputs: list[list[int]] = []
    seen: list[list[int]] = []  # prompt and output, where a row has a repetition penalty
    counts: list[int] = []
    matchers: list[GrammarMatcher | None] = []
    for s in rows:
        seq = s.seq
        for i in range(s.num_logits):
            params.append(seq.params)
            drafts = s.draft_token_ids[:i]
            outputs.append(seq.output_token_ids + drafts if seq.params.reads_output else [])
            seen.append(seq.token_ids + drafts if seq.params.has_repetition_penalty else [])
            counts.append(seq.num_output_tokens + i)
            matchers.append(seq.matcher)
    return SamplingBatch.build(params, outputs, counts, vocab_size, matchers, seen)
