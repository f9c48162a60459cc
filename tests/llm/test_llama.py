from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from lockgate.errors import BadRequest, ConfigError
from lockgate.llm.attention import AttentionMetadata
from lockgate.llm.loader import Checkpoint
from lockgate.llm.model_config import LlamaConfig, RopeScaling
from lockgate.llm.models import (
    LlamaForCausalLM,
    allocate_kv_cache,
    build_llama,
    kv_bytes_per_block,
)
from lockgate.llm.models.llama import rope_inverse_frequencies
from lockgate.llm.tokenizer import ChatTokenizer
from tests.llm.conftest import PagedLoop, hf_greedy

NEW_TOKENS = 16
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old "
    "clockmaker who repaired every clock in the valley. One winter morning a stranger knocked",
]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: ChatTokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(hf_model: Any, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Greedy continuations from transformers' generate, the oracle."""
    return hf_greedy(hf_model, prompt_ids, NEW_TOKENS)


# The three comparisons with transformers' tokens run on one torch thread, as the engine's
# do (`one_thread`): two spinning threads on a loaded 2-core machine made them several times
# slower. The threads only share out the kernels' rows (their own tests cover that), and the
# bfloat16 and chat tests below run on torch's default.


def greedy(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


@pytest.mark.usefixtures("one_thread")
def test_greedy_matches_transformers_one_sequence_at_a_time(
    model: LlamaForCausalLM, prompt_ids: list[list[int]], reference: list[list[int]]
) -> None:
    for ids, expected in zip(prompt_ids, reference, strict=True):
        loop = PagedLoop(model)
        tokens = greedy(loop.step([(0, ids)]))
        while len(tokens) < len(expected):
            tokens += greedy(loop.step([(0, tokens[-1:])]))
        assert tokens == expected


@pytest.mark.usefixtures("one_thread")
def test_batched_prefill_and_decode_match(
    model: LlamaForCausalLM, prompt_ids: list[list[int]], reference: list[list[int]]
) -> None:
    loop = PagedLoop(model, seed=1)
    outs = [[t] for t in greedy(loop.step(list(enumerate(prompt_ids))))]
    for _ in range(NEW_TOKENS - 1):
        step = greedy(loop.step([(i, out[-1:]) for i, out in enumerate(outs)]))
        for out, token in zip(outs, step, strict=True):
            out.append(token)
    for out, expected in zip(outs, reference, strict=True):
        assert out[: len(expected)] == expected


@pytest.mark.usefixtures("one_thread")
def test_chunked_prefill_mixed_with_decodes_matches(
    model: LlamaForCausalLM, prompt_ids: list[list[int]], reference: list[list[int]]
) -> None:
    loop = PagedLoop(model, seed=2)
    short, long = prompt_ids[0], prompt_ids[2]
    out_short = greedy(loop.step([(0, short)]))
    cuts = [0, len(long) // 3, 2 * len(long) // 3, len(long)]
    for a, b in itertools.pairwise(cuts):
        # the long prompt arrives in chunks while the short sequence decodes beside it
        logits = loop.step([(1, long[a:b]), (0, out_short[-1:])])
        out_short.append(greedy(logits)[1])
    out_long = [greedy(logits)[0]]
    while len(out_long) < NEW_TOKENS:
        step = greedy(loop.step([(0, out_short[-1:]), (1, out_long[-1:])]))
        out_short.append(step[0])
        out_long.append(step[1])
    assert out_short[:NEW_TOKENS] == reference[0]
    assert out_long == reference[2]


def test_bfloat16_logits_close_to_float32(
    checkpoint: Checkpoint, model: LlamaForCausalLM, prompt_ids: list[list[int]]
) -> None:
    bf16 = build_llama(checkpoint.config, checkpoint.weights, "bfloat16")
    ids = prompt_ids[2]
    ref = _all_position_logits(model, ids)
    low = _all_position_logits(bf16, ids)
    assert low.dtype == torch.float32
    agree = int((ref.argmax(-1) == low.argmax(-1)).sum())
    assert agree >= 0.8 * len(ids)
    assert torch.nn.functional.cosine_similarity(ref, low, dim=-1).min() > 0.95


def _all_position_logits(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    loop = PagedLoop(model)
    n = len(ids)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]),
        block_tables=torch.arange(-(-n // 16))[None],
        logits_indices=torch.arange(n),
        max_query_len=n,
        max_seq_len=n,
        block_size=16,
        query_lens_list=[n],
        seq_lens_list=[n],
    )
    return model.compute_logits(model(torch.tensor(ids), torch.arange(n), meta, loop.cache))


def test_chat_answer_is_sensible(model: LlamaForCausalLM, tokenizer: ChatTokenizer) -> None:
    # the oracle above shares our dequantized weights; this catches a wrong GGUF conversion
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    loop = PagedLoop(model)
    tokens = greedy(loop.step([(0, tokenizer.encode(tokenizer.apply_chat_template(messages)))]))
    while len(tokens) < 8 and tokens[-1] not in tokenizer.eos_token_ids:
        tokens += greedy(loop.step([(0, tokens[-1:])]))
    assert "Paris" in tokenizer.decode(tokens)


def test_bad_metadata_is_a_clear_error(model: LlamaForCausalLM) -> None:
    cache = allocate_kv_cache(model.config, 4, 16, "float32")
    meta = AttentionMetadata(
        slot_mapping=torch.arange(3),
        query_start_loc=torch.tensor([0, 3]),
        seq_lens=torch.tensor([40]),
        block_tables=torch.tensor([[0, 1]]),
        logits_indices=torch.tensor([2]),
        max_query_len=3,
        max_seq_len=40,
        block_size=16,
        query_lens_list=[3],
        seq_lens_list=[40],
    )
    with pytest.raises(BadRequest, match="exceeds its block table"):
        model(torch.tensor([1, 2, 3]), torch.arange(37, 40), meta, cache)
    with pytest.raises(BadRequest, match="KV cache layers"):
        model(torch.tensor([1, 2, 3]), torch.arange(3), meta, cache[:2])


def test_position_beyond_context_is_rejected(model: LlamaForCausalLM) -> None:
    cache = allocate_kv_cache(model.config, 2, 16, "float32")
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([0]),
        query_start_loc=torch.tensor([0, 1]),
        seq_lens=torch.tensor([1]),
        block_tables=torch.tensor([[0]]),
        logits_indices=torch.tensor([0]),
        max_query_len=1,
        max_seq_len=1,
        block_size=16,
        query_lens_list=[1],
        seq_lens_list=[1],
    )
    with pytest.raises(BadRequest, match="context"):
        model(torch.tensor([1]), torch.tensor([model.config.max_position_embeddings]), meta, cache)


def test_kv_cache_allocation_and_size(checkpoint: Checkpoint) -> None:
    config = checkpoint.config
    cache = allocate_kv_cache(config, 8, 16, "bfloat16")
    assert len(cache) == config.num_hidden_layers
    k, v = cache[0]
    assert k.shape == v.shape == (8, 16, config.num_key_value_heads, config.head_dim)
    assert k.dtype == torch.bfloat16
    per_block = kv_bytes_per_block(config, 16, "bfloat16")
    assert per_block == sum(t.nbytes for pair in cache for t in pair) // 8
    assert kv_bytes_per_block(config, 16, "float32") == 2 * per_block
    with pytest.raises(ConfigError):
        allocate_kv_cache(config, 0, 16, "float32")
    with pytest.raises(ConfigError, match="dtype"):
        kv_bytes_per_block(config, 16, "float16")


def _tiny_config(scaling: RopeScaling) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32,
        hidden_size=256,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        rope_theta=500000.0,
        rope_scaling=scaling,
        max_position_embeddings=131072,
    )


@pytest.mark.parametrize(
    "raw",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
)
def test_rope_scaling_matches_transformers(raw: dict[str, Any]) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = _tiny_config(RopeScaling.from_hf(raw))
    hf_config = transformers.LlamaConfig(
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=131072,
        rope_parameters={"rope_theta": 500000.0, **raw},
    )
    expected, _ = ROPE_INIT_FUNCTIONS[raw["rope_type"]](hf_config, "cpu")
    torch.testing.assert_close(rope_inverse_frequencies(config), expected.float())


def test_unknown_rope_scaling_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="rope_scaling"):
        _tiny_config(RopeScaling.from_hf({"rope_type": "yarn", "factor": 2.0}))
