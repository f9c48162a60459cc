"""The whole engine against the oracle: concurrent requests through continuous batching,
chunked prefill, prefix-cache hits and a forced preemption give exactly transformers'
greedy tokens."""

from __future__ import annotations

from typing import Any

import pytest

from lockgate.llm.engine import LLMEngine
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.loader import Checkpoint
from lockgate.llm.models.llama import LlamaForCausalLM, allocate_kv_cache
from lockgate.llm.sequence import SamplingParams
from lockgate.llm.tokenizer import ChatTokenizer
from tests.llm.conftest import hf_greedy

NEW_TOKENS = 12
SHARED = (
    "You are a careful assistant. Answer in one short sentence and do not add anything else. "
    "The question follows."
)
PROMPTS = [
    "The capital of France is",
    SHARED + " What colour is the sky on a clear day?",
    SHARED + " How many legs does a spider have?",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning a stranger knocked",
]


@pytest.fixture(scope="module")
def prompts(tokenizer: ChatTokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def oracle(hf_model: Any, prompts: list[list[int]]) -> list[list[int]]:
    return hf_greedy(hf_model, prompts, NEW_TOKENS)


def engine(
    checkpoint: Checkpoint, model: LlamaForCausalLM, tokenizer: ChatTokenizer, blocks: int
) -> LLMEngine:
    config = EngineConfig(
        block_size=8,
        kv_cache_blocks=blocks,
        max_model_len=64,
        max_num_batched_tokens=24,  # long prompts run in chunks beside the decodes
        max_num_seqs=8,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
    )
    kv = allocate_kv_cache(checkpoint.config, blocks, 8, "float32")
    return LLMEngine(model, kv, config, eos_token_ids=tokenizer.eos_token_ids)


@pytest.mark.usefixtures("one_thread")
def test_engine_greedy_equals_transformers(
    checkpoint: Checkpoint,
    model: LlamaForCausalLM,
    tokenizer: ChatTokenizer,
    prompts: list[list[int]],
    oracle: list[list[int]],
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)  # stops at EOS, as HF does
    # 9 blocks of 8 tokens cannot hold the five sequences together: one is preempted
    llm = engine(checkpoint, model, tokenizer, blocks=9)
    ids = [llm.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    steps = 0
    while llm.has_unfinished:
        for out in llm.step():
            tokens[out.request_id].extend(out.new_token_ids)
        llm.check_invariants()
        steps += 1
    assert [tokens[i] for i in ids] == oracle
    stats = llm.stats()
    assert stats.num_preemptions > 0, "the test must force a preemption"
    assert stats.prefix_cache_hits > 0, "the shared system prompt must hit the prefix cache"
    assert stats.num_free_blocks == stats.num_total_blocks
    # chunked prefill: the longest prompt needs more than one step of 24 tokens
    assert max(len(p) for p in prompts) > 24 and steps > NEW_TOKENS
