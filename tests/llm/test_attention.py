"""Paged attention against a dense reference: decode batches (split by context length or
not), whole prompts and chunks with context, mixed in one step; each through SDPA over
gathered blocks and through the in-place decode kernel (`llm/decode_kernel.py`); steps with
prompts also through the in-place prefill kernel (`llm/prefill_kernel.py`, its portable loop
at these shapes)."""

from __future__ import annotations

import math
import os
import shutil

import pytest
import torch

from lockgate.llm.attention import (
    MIN_PADDING_SAVED,
    AttentionMetadata,
    paged_attention,
    plan_attention,
    write_kv,
)
from lockgate.llm.decode_kernel import DecodeKernel, load_kernel
from lockgate.llm.prefill_kernel import PrefillKernel
from lockgate.llm.prefill_kernel import load_kernel as load_prefill_kernel

BLOCK = 4
NH, KVH, D = 6, 2, 8


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    # q: [n, nh, d] at the last n positions of keys/values [s, kvh, d]; causal
    n, s = q.shape[0], keys.shape[0]
    k = keys.repeat_interleave(NH // KVH, dim=1).transpose(0, 1)  # [nh, s, d]
    v = values.repeat_interleave(NH // KVH, dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(D)  # [nh, n, s]
    visible = torch.arange(s)[None, :] <= torch.arange(s - n, s)[:, None]  # [n, s]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, NH * D)


@pytest.fixture(params=["sdpa", "kernel"])
def kernel(request: pytest.FixtureRequest) -> DecodeKernel | None:
    if request.param == "sdpa":
        return None
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler to build the kernel (apt-get install gcc)")
    return load_kernel()


@pytest.fixture(params=["sdpa", "kernel"])
def prefill(request: pytest.FixtureRequest) -> PrefillKernel | None:
    if request.param == "sdpa":
        return None
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler to build the kernel (apt-get install gcc)")
    return load_prefill_kernel()


def run_step(
    seq_lens: list[int],
    query_lens: list[int],
    seed: int = 0,
    kernel: DecodeKernel | None = None,
    prefill: PrefillKernel | None = None,
) -> None:
    """Fill each sequence's context at random, attend its last query_lens tokens, compare."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 3
    k_cache = torch.zeros(num_blocks, BLOCK, KVH, D)
    v_cache = torch.zeros_like(k_cache)
    free = torch.randperm(num_blocks - 1, generator=gen).add(1).tolist()  # scattered blocks
    tables, contexts, new_k, new_v, slots, queries = [], [], [], [], [], []
    for s, n in zip(seq_lens, query_lens, strict=True):
        table = [free.pop() for _ in range(-(-s // BLOCK))]
        keys, values = torch.randn(s, KVH, D, generator=gen), torch.randn(s, KVH, D, generator=gen)
        cached = torch.tensor(
            [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(s - n)], dtype=torch.long
        )
        write_kv(k_cache, v_cache, keys[: s - n], values[: s - n], cached)
        tables.append(table)
        contexts.append((keys, values))
        new_k.append(keys[s - n :])
        new_v.append(values[s - n :])
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(s - n, s)]
        queries.append(torch.randn(n, NH, D, generator=gen))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        logits_indices=torch.tensor([], dtype=torch.long),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=BLOCK,
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
    )
    q, k, v = torch.cat(queries), torch.cat(new_k), torch.cat(new_v)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    out = paged_attention(q, k, v, k_cache, v_cache, plan_attention(meta, kernel, prefill))
    expected = torch.cat([reference(qi, *ctx) for qi, ctx in zip(queries, contexts, strict=True)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_decode_batch_of_equal_contexts_needs_no_mask(kernel: DecodeKernel | None) -> None:
    run_step([9, 9, 9], [1, 1, 1], kernel=kernel)
    plan = plan_attention(_meta_for([9, 9, 9]))
    assert len(plan.decodes) == 1 and plan.decodes[0].mask is None


def test_decode_batch_of_mixed_contexts(kernel: DecodeKernel | None) -> None:
    run_step([3, 17, 8, 1], [1, 1, 1, 1], kernel=kernel)


def test_decodes_far_apart_in_length_are_split_and_stay_exact(kernel: DecodeKernel | None) -> None:
    long = MIN_PADDING_SAVED + 40
    seq_lens = [long, 5, long - 3, 7, 6, long + 2]
    # the kernel reads each context as long as it is: one batch, nothing to split
    assert len(plan_attention(_meta_for(seq_lens), kernel).decodes) == (1 if kernel else 2)
    run_step(seq_lens, [1] * len(seq_lens), kernel=kernel)


def test_prefills_with_and_without_context_mixed_with_decodes(
    kernel: DecodeKernel | None, prefill: PrefillKernel | None
) -> None:
    run_step([12, 5, 30, 9, 2], [12, 1, 7, 1, 2], seed=3, kernel=kernel, prefill=prefill)


@pytest.mark.parametrize("seed", range(3))
def test_random_steps(
    seed: int, kernel: DecodeKernel | None, prefill: PrefillKernel | None
) -> None:
    gen = torch.Generator().manual_seed(100 + seed)
    seq_lens = torch.randint(1, 60, (6,), generator=gen).tolist()
    query_lens = [1 if i % 2 else int(torch.randint(1, s + 1, (1,), generator=gen)) for i, s in
                  enumerate(seq_lens)]  # fmt: skip
    run_step(seq_lens, query_lens, seed=seed, kernel=kernel, prefill=prefill)


def _meta_for(seq_lens: list[int]) -> AttentionMetadata:
    """Decode-only metadata with dummy block tables wide enough for every context."""
    width = -(-max(seq_lens) // BLOCK)
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.long),
        query_start_loc=torch.arange(n + 1),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.zeros(n, width, dtype=torch.long),
        logits_indices=torch.arange(n),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_size=BLOCK,
        query_lens_list=[1] * n,
        seq_lens_list=seq_lens,
    )
