"""The in-place prefill attention kernel: against SDPA in float32 over the same blocks, for
whole prompts and chunks after a context, in bfloat16 and float32 caches, at head sizes 64
and 128 (AVX-512 tiles, where the CPU has them) and 40 (the portable loop); a step that
mixes it with decodes; how it is chosen; and the demo SmolLM2's greedy output through the
engine with it and with SDPA."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lockgate.config import ModelConfig
from lockgate.errors import ConfigError
from lockgate.llm import native, prefill_kernel
from lockgate.llm.attention import AttentionMetadata, paged_attention, plan_attention
from lockgate.llm.decode_kernel import load_kernel as load_decode_kernel
from lockgate.llm.engine import LLMEngine
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.loader import Checkpoint
from lockgate.llm.models import LlamaForCausalLM, allocate_kv_cache, build_llama
from lockgate.llm.prefill_kernel import KernelUnavailable, PrefillSegments, load_kernel
from lockgate.llm.sequence import SamplingParams
from lockgate.llm.startup import engine_config_from
from lockgate.llm.tokenizer import ChatTokenizer, IncrementalDetokenizer

needs_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None, reason="no C compiler (apt-get install gcc)"
)

# a model's query heads and one layer's caches: 9 heads over 3 KV heads of 64, bfloat16
MODEL = (9, torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16), torch.zeros(4, 16, 3, 64).bfloat16())
LENGTHS = [1, 15, 16, 17, 145, 300]


def random_step(
    query_lens: list[int],
    contexts: list[int],
    nh: int,
    kvh: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """q [T, nh, d] (a strided view, as the model's fused projection gives it), caches
    filled at random, each sequence's blocks scattered: (q, k_cache, v_cache, tables,
    starts)."""
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-(c + q) // block_size) for q, c in zip(query_lens, contexts, strict=True)]
    blocks = sum(needs) + 2
    k_cache = torch.randn(blocks, block_size, kvh, d, generator=gen).to(dtype)
    v_cache = torch.randn(blocks, block_size, kvh, d, generator=gen).to(dtype)
    order = torch.randperm(blocks, generator=gen).tolist()
    width = max(needs)
    tables = torch.zeros(len(needs), width, dtype=torch.long)
    for i, n in enumerate(needs):
        tables[i, :n] = torch.tensor([order.pop() for _ in range(n)])
    rows = sum(query_lens)
    fused = torch.randn(rows, (nh + 2 * kvh) * d, generator=gen).to(dtype)
    q = fused[:, : nh * d].view(rows, nh, d)
    starts = [sum(query_lens[:i]) for i in range(len(query_lens))]
    return q, k_cache, v_cache, tables, starts


def reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    table: torch.Tensor,
    context: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One segment's rows through SDPA over its gathered blocks, offset-causal, in `dtype`."""
    n, nh, d = q.shape
    kvh, seen = k_cache.shape[2], context + n
    keys = k_cache[table].reshape(-1, kvh, d)[:seen].to(dtype).transpose(0, 1)[None]
    values = v_cache[table].reshape(-1, kvh, d)[:seen].to(dtype).transpose(0, 1)[None]
    mask = torch.arange(seen)[None, :] <= (torch.arange(n) + context)[:, None]
    query = q.to(dtype).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(query, keys, values, mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(n, nh * d).float()


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("nh", "kvh", "d"), [(9, 3, 64), (8, 2, 128), (4, 1, 40)])
@pytest.mark.parametrize("block_size", [16, 5])
def test_the_kernel_agrees_with_sdpa_in_float32(
    dtype: torch.dtype, nh: int, kvh: int, d: int, block_size: int
) -> None:
    """Whole prompts and chunks after a context of every length, in one call. bfloat16: the
    output's rounding dominates (as SDPA's in bfloat16); its mean error is no larger than
    SDPA's in bfloat16."""
    query_lens = LENGTHS * 2
    contexts = [0] * len(LENGTHS) + [33, 100, 16, 7, 200, 60]
    q, k_cache, v_cache, tables, starts = random_step(
        query_lens, contexts, nh, kvh, d, block_size, dtype, seed=nh * d + block_size
    )
    out = torch.full((q.shape[0], nh * d), float("nan"), dtype=dtype)
    load_kernel()(q, k_cache, v_cache, PrefillSegments.of(starts, query_lens, contexts, tables),
                  out)  # fmt: skip
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    ours, sdpas = [], []
    for i, (start, n) in enumerate(zip(starts, query_lens, strict=True)):
        rows = slice(start, start + n)
        expected = reference(q[rows], k_cache, v_cache, tables[i], contexts[i])
        torch.testing.assert_close(out[rows].float(), expected, atol=tolerance, rtol=tolerance)
        ours.append((out[rows].float() - expected).abs().mean())
        sdpa = reference(q[rows], k_cache, v_cache, tables[i], contexts[i], dtype)
        sdpas.append((sdpa - expected).abs().mean())
    if dtype == torch.bfloat16:
        assert sum(ours) <= 1.1 * sum(sdpas)


@needs_compiler
def test_a_bfloat16_cache_without_avx512_bf16_takes_the_float32_tiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built as for a CPU with AVX-512 but no AVX512-BF16 (as Ice Lake): a bfloat16 cache is
    widened to float32 as it is read and multiplied in FMAs, as precise as SDPA's."""
    if load_kernel().vectorised < 2:
        pytest.skip("this CPU has no AVX512-BF16 to build without")
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-mno-avx512bf16"))
    load_kernel.cache_clear()
    try:
        kernel = load_kernel()
    finally:
        load_kernel.cache_clear()
    assert kernel.vectorised == 1
    query_lens, contexts = [145, 17], [0, 40]
    q, k_cache, v_cache, tables, starts = random_step(
        query_lens, contexts, 9, 3, 64, 16, torch.bfloat16
    )
    out = torch.empty(q.shape[0], 9 * 64, dtype=torch.bfloat16)
    kernel(q, k_cache, v_cache, PrefillSegments.of(starts, query_lens, contexts, tables), out)
    for i, (start, n) in enumerate(zip(starts, query_lens, strict=True)):
        expected = reference(q[start : start + n], k_cache, v_cache, tables[i], contexts[i])
        torch.testing.assert_close(
            out[start : start + n].float(), expected, atol=1.6e-2, rtol=1.6e-2
        )


@needs_compiler
def test_rows_of_no_segment_are_left_alone_and_bad_segments_are_refused() -> None:
    kernel = load_kernel()
    q, k_cache, v_cache, tables, _ = random_step([20], [0], 4, 2, 64, 16, torch.bfloat16)
    out = torch.zeros(24, 4 * 64, dtype=torch.bfloat16)
    segments = PrefillSegments.of([2], [20], [0], tables)
    kernel(torch.cat([q, q[:4]]), k_cache, v_cache, segments, out)
    assert not out[:2].any() and not out[22:].any() and out[2:22].abs().sum() > 0
    blocks = k_cache.shape[0]
    for bad in (
        PrefillSegments.of([0], [20], [0], torch.tensor([[0, blocks]])),  # a block past the end
        PrefillSegments.of([0], [20], [20], tables),  # 40 positions, a table of 32
        PrefillSegments.of([10], [20], [0], tables),  # rows past q's
    ):
        with pytest.raises(RuntimeError, match="refused the step"):
            kernel(q, k_cache, v_cache, bad, out[:20])


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_step_of_decodes_and_prefill_segments_attends_as_sdpa(dtype: torch.dtype) -> None:
    """Through `paged_attention`: decodes (the decode kernel), whole prompts and chunks
    after a context (the prefill kernel, one call), against the SDPA plan in float32."""
    nh, kvh, d, block_size = 9, 3, 64, 16
    query_lens = [1, 37, 1, 16, 145, 1]
    seq_lens = [40, 37, 9, 50, 145, 300]
    contexts = [s - n for s, n in zip(seq_lens, query_lens, strict=True)]
    q, k_cache, v_cache, tables, starts = random_step(
        query_lens, contexts, nh, kvh, d, block_size, dtype
    )
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.long),  # (not read by attention)
        query_start_loc=torch.tensor([*starts, sum(query_lens)]),
        seq_lens=torch.tensor(seq_lens),
        block_tables=tables,
        logits_indices=torch.tensor([], dtype=torch.long),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_lens_list=query_lens,
        seq_lens_list=seq_lens,
    )
    plan = plan_attention(meta, load_decode_kernel(), load_kernel())
    assert plan.segments is not None and all(seg.mask is None for seg in plan.prefills)
    # this step's keys and values, as the cache holds them (SDPA reads a whole prompt's here)
    positions = [(i, p) for i, s in enumerate(seq_lens) for p in range(contexts[i], s)]
    slots = torch.tensor([int(tables[i, p // block_size]) * block_size + p % block_size
                          for i, p in positions])  # fmt: skip
    k = k_cache.view(-1, kvh, d)[slots]
    v = v_cache.view(-1, kvh, d)[slots]
    out = paged_attention(q, k, v, k_cache, v_cache, plan)
    expected = paged_attention(
        q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), plan_attention(meta)
    )
    tolerance = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@needs_compiler
def test_auto_takes_the_kernel_where_it_vectorises_and_kernel_takes_it_anywhere(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Decided once, at load: the portable loop (head size 40, a CPU without AVX-512) is
    slower than SDPA, so `auto` leaves those to SDPA."""
    kernel = load_kernel()
    f32 = torch.zeros(4, 16, 3, 64)
    vectorised = kernel if kernel.vectorised else None
    assert prefill_kernel.prefill_kernel("auto", *MODEL) is vectorised
    assert prefill_kernel.prefill_kernel("auto", 9, f32, f32) is vectorised
    narrow = torch.zeros(4, 16, 3, 40)
    assert prefill_kernel.prefill_kernel("auto", 9, narrow, narrow) is None
    assert prefill_kernel.prefill_kernel("kernel", 9, narrow, narrow) is kernel
    odd = torch.zeros(4, 16, 1, 64)
    with caplog.at_level(logging.WARNING, logger="lockgate.llm"):
        assert prefill_kernel.prefill_kernel("auto", 40, odd, odd) is None
    assert "not the kernel's" in caplog.text
    with pytest.raises(KernelUnavailable, match="40 query heads over 1 KV heads"):
        prefill_kernel.prefill_kernel("kernel", 40, odd, odd)


def test_without_a_compiler_auto_leaves_sdpa_and_kernel_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    load_kernel.cache_clear()
    try:
        assert prefill_kernel.prefill_kernel("auto", *MODEL) is None
        with pytest.raises(KernelUnavailable, match="no C compiler"):
            prefill_kernel.prefill_kernel("kernel", *MODEL)
        assert prefill_kernel.prefill_kernel("sdpa", *MODEL) is None
    finally:
        load_kernel.cache_clear()
    assert not (tmp_path / "kernels").exists()
    with pytest.raises(ConfigError, match=r"prefill_attention.*'fast' is not one of auto"):
        engine_config_from(
            ModelConfig(name="m", backend="llm", parameters={"prefill_attention": "fast"})
        )


# -- the demo SmolLM2 through the engine ---------------------------------------------------

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "went out every morning before dawn. One day, far from the shore, his net caught",
    "def fibonacci(n):\n    # return the n-th Fibonacci number, iteratively\n",
]


@pytest.fixture(scope="module")
def bf16_model(checkpoint: Checkpoint) -> LlamaForCausalLM:
    return build_llama(checkpoint.config, checkpoint.weights, "bfloat16")


def greedy(
    checkpoint: Checkpoint,
    model: LlamaForCausalLM,
    tokenizer: ChatTokenizer,
    prompts: list[list[int]],
) -> list[list[int]]:
    """Greedy continuations through the engine, prompts prefilled in chunks of up to 24
    tokens (so most chunks attend a context) beside the decodes of the others."""
    config = EngineConfig(
        kv_cache_blocks=64, block_size=16, max_num_batched_tokens=24, max_num_seqs=4,
        max_model_len=1024,
        dtype="bfloat16", enable_prefix_caching=False,
    )  # fmt: skip
    engine = LLMEngine(
        model,
        allocate_kv_cache(checkpoint.config, 64, 16, "bfloat16"),
        config,
        eos_token_ids=tokenizer.eos_token_ids,
        decoder_factory=lambda _prompt, skip: IncrementalDetokenizer(tokenizer, skip),
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    return engine.generate(prompts, params)


@needs_compiler
@pytest.mark.usefixtures("one_thread")
def test_greedy_output_of_smollm2_is_sdpas(
    checkpoint: Checkpoint, bf16_model: LlamaForCausalLM, tokenizer: ChatTokenizer
) -> None:
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    kernel = prefill_kernel.prefill_kernel("kernel", *_shapes(bf16_model, checkpoint))
    bf16_model.prefill_kernel = None
    sdpa = greedy(checkpoint, bf16_model, tokenizer, prompts)
    bf16_model.prefill_kernel = kernel
    try:
        ours = greedy(checkpoint, bf16_model, tokenizer, prompts)
    finally:
        bf16_model.prefill_kernel = None
    assert ours == sdpa


def _shapes(
    model: LlamaForCausalLM, checkpoint: Checkpoint
) -> tuple[int, torch.Tensor, torch.Tensor]:
    k, v = allocate_kv_cache(checkpoint.config, 1, 16, model.dtype)[0]
    return model.config.num_attention_heads, k, v
