"""Loading a served language model: checkpoint, model, KV cache, engine, warmup.

A model folder whose config says `backend: llm` holds the weights in its version folder (a
`.gguf` file or a Hugging Face folder) and the engine settings in `parameters`:

| parameter | meaning | default |
|---|---|---|
| model_file | file or folder inside the version folder | the only `.gguf` there |
| served_model_name | the name clients use in the OpenAI API | the model folder's name |
| dtype | auto, float32 or bfloat16 (auto: bfloat16 on a CPU with native bfloat16) | auto |
| kv_cache_gib / kv_cache_blocks | KV cache size | 1.0 GiB |
| block_size | tokens per KV block | 16 |
| max_model_len | prompt + output tokens of one sequence | 2048 |
| max_num_seqs | sequences in one step | 64 |
| max_num_batched_tokens | tokens in one step (prefill chunks + decodes) | 1536 |
| max_waiting | waiting requests before 429 | 256 |
| enable_prefix_caching | share KV blocks of common prefixes | true |
| enable_chunked_prefill | split long prompts across steps | true |
| num_threads | torch intra-op threads | torch's default |
| pack_weights | bfloat16: reorder the weights for oneDNN once, at load | true |
| quantization | weight-only projections: auto, none, int8, int4 | auto |
| ttft_slo_ms | refuse (503) a request predicted to wait longer for its first token | none |
| tpot_slo_ms | while sequences decode, cut prefill chunks to keep steps within this | none |
| speculative | none, or ngram: speculative decoding by prompt lookup | none |
| num_speculative_tokens | ngram: draft tokens verified per sequence and step, at most | 4 |
| prompt_lookup_min / _max | ngram: shortest / longest suffix looked up, in tokens | 2 / 4 |
| decode_attention | auto, kernel or sdpa: how decodes attend (`llm/decode_kernel.py`) | auto |
| prefill_attention | auto, kernel or sdpa: how prompts attend (`llm/prefill_kernel.py`) | auto |
| activation_quantization | none, or int8: prefill and large batches multiply in int8 | none |
| step_policy | decode_first, or prefill_first: queued prompts take a step first | decode_first |
| max_decode_stall_ms | prefill_first: the longest decodes wait for queued prompts | 1000 |
| generation_config | sampling defaults: auto, generation_config.json by the weights; none | auto |
"""

from __future__ import annotations

import ctypes
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lockgate.config import ModelConfig
from lockgate.errors import ConfigError
from lockgate.llm.async_engine import AsyncLLMEngine
from lockgate.llm.cpu import native_bfloat16
from lockgate.llm.decode_kernel import KernelUnavailable, decode_kernel
from lockgate.llm.engine import LLMEngine
from lockgate.llm.engine_config import EngineConfig
from lockgate.llm.generation_config import GenerationDefaults, read_generation_defaults
from lockgate.llm.layer_ops import LayerOps
from lockgate.llm.loader import load_checkpoint
from lockgate.llm.models.int8_activations import quantize_activations
from lockgate.llm.models.llama import allocate_kv_cache, build_llama, kv_bytes_per_block
from lockgate.llm.models.packing import pack_linear_weights
from lockgate.llm.prefill_kernel import prefill_kernel
from lockgate.llm.service import LLMService
from lockgate.llm.tokenizer import ChatTokenizer, IncrementalDetokenizer

log = logging.getLogger("lockgate.llm")

_BOOL = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def engine_config_from(config: ModelConfig) -> EngineConfig:
    p = config.parameters
    source = config.source or config.name

    def number(key: str, kind: type, default: object) -> object:
        if key not in p:
            return default
        try:
            return kind(p[key])
        except ValueError:
            raise ConfigError(
                source, f"parameters.{key}", f"not a {kind.__name__}: {p[key]!r}"
            ) from None

    def flag(key: str, default: bool) -> bool:
        if key not in p:
            return default
        value = _BOOL.get(str(p[key]).lower())
        if value is None:
            raise ConfigError(source, f"parameters.{key}", "must be true or false")
        return value

    blocks = number("kv_cache_blocks", int, None)
    return EngineConfig(
        max_model_len=number("max_model_len", int, 2048),  # type: ignore[arg-type]
        block_size=number("block_size", int, 16),  # type: ignore[arg-type]
        kv_cache_blocks=blocks,  # type: ignore[arg-type]
        kv_cache_gib=None if blocks is not None else number("kv_cache_gib", float, 1.0),  # type: ignore[arg-type]
        max_num_seqs=number("max_num_seqs", int, 64),  # type: ignore[arg-type]
        max_num_batched_tokens=number("max_num_batched_tokens", int, 1536),  # type: ignore[arg-type]
        max_waiting=number("max_waiting", int, 256),  # type: ignore[arg-type]
        enable_prefix_caching=flag("enable_prefix_caching", True),
        enable_chunked_prefill=flag("enable_chunked_prefill", True),
        continuous_batching=flag("continuous_batching", True),
        dtype=resolve_auto_dtype(str(p.get("dtype", "auto"))),
        num_threads=number("num_threads", int, None),  # type: ignore[arg-type]
        pack_weights=flag("pack_weights", True),
        quantization=str(p.get("quantization", "auto")),
        ttft_slo_ms=number("ttft_slo_ms", float, None),  # type: ignore[arg-type]
        tpot_slo_ms=number("tpot_slo_ms", float, None),  # type: ignore[arg-type]
        speculative=str(p.get("speculative", "none")),
        num_speculative_tokens=number("num_speculative_tokens", int, 4),  # type: ignore[arg-type]
        prompt_lookup_min=number("prompt_lookup_min", int, 2),  # type: ignore[arg-type]
        prompt_lookup_max=number("prompt_lookup_max", int, 4),  # type: ignore[arg-type]
        decode_attention=str(p.get("decode_attention", "auto")),
        prefill_attention=str(p.get("prefill_attention", "auto")),
        activation_quantization=str(p.get("activation_quantization", "none")),
        step_policy=str(p.get("step_policy", "decode_first")),
        max_decode_stall_ms=number("max_decode_stall_ms", float, 1000.0),  # type: ignore[arg-type]
    )


def _weights_path(config: ModelConfig, version_dir: Path) -> Path:
    name = config.parameters.get("model_file", "")
    if name:
        path = (version_dir / name).resolve()
        if not path.is_relative_to(version_dir.resolve()):
            raise ConfigError(
                config.source, "parameters.model_file", "must stay inside the version folder"
            )
        return path
    ggufs = sorted(version_dir.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    if (version_dir / "config.json").is_file():
        return version_dir
    raise ConfigError(
        config.source,
        "parameters.model_file",
        f"no single .gguf file or config.json in {version_dir}",
    )


def _generation_defaults(config: ModelConfig, weights: Path) -> GenerationDefaults:
    """From generation_config.json in the weights' folder (a Hugging Face folder, or the
    folder that holds the .gguf), unless `parameters.generation_config` is none."""
    choice = config.parameters.get("generation_config", "auto")
    if choice == "none":
        return GenerationDefaults()
    if choice != "auto":
        raise ConfigError(
            config.source or config.name,
            "parameters.generation_config",
            f"must be auto or none, got {choice!r}",
        )
    return read_generation_defaults(weights if weights.is_dir() else weights.parent)


@dataclass(slots=True)
class _Built:
    """What loading gives besides the engine."""

    tokenizer: ChatTokenizer
    vocab_size: int
    blocks: int
    block_bytes: int
    source: str


def load_service(config: ModelConfig, version_dir: Path) -> LLMService:
    """Load, build and warm up the language model of one version folder. All of it runs on
    the engine's own thread, the one thread that ever computes on the model's tensors
    (`AsyncLLMEngine`: a second thread's OpenMP team slows every step)."""
    start = time.monotonic()
    engine_config = engine_config_from(config)
    weights = _weights_path(config, version_dir)
    generation = _generation_defaults(config, weights)
    built: list[_Built] = []

    def build() -> LLMEngine:
        engine, parts = _build(engine_config, weights)
        built.append(parts)
        return engine

    engine = AsyncLLMEngine.build(build)
    parts = built[0]
    name = config.parameters.get("served_model_name", config.name)
    elapsed = time.monotonic() - start
    log.info(
        "language model %s ready in %.2f s: %s, %s, quantization %s, KV cache %d blocks x %d "
        "tokens = %.2f GiB",
        name,
        elapsed,
        parts.source,
        engine_config.dtype,
        engine_config.weight_quantization,
        parts.blocks,
        engine_config.block_size,
        parts.blocks * parts.block_bytes / 2**30,
    )
    if generation.source:
        defaults, source = generation.to_dict(), generation.source
        log.info("language model %s: sampling defaults %s from %s", name, defaults, source)
    return LLMService(
        name=name,
        config=config,
        engine_config=engine_config,
        tokenizer=parts.tokenizer,
        engine=engine,
        vocab_size=parts.vocab_size,
        load_seconds=elapsed,
        created=int(time.time()),
        generation=generation,
    )


def _build(engine_config: EngineConfig, weights: Path) -> tuple[LLMEngine, _Built]:
    checkpoint = load_checkpoint(weights, quantization=engine_config.weight_quantization)
    model = build_llama(
        checkpoint.config, checkpoint.weights, engine_config.dtype, checkpoint.quantized
    )
    if engine_config.activation_quantization == "int8":
        try:
            quantize_activations(model)
        except ConfigError as exc:  # the weights' projections are not quantized
            raise ConfigError(str(weights), exc.field, exc.problem) from exc
        except KernelUnavailable as exc:  # no compiler for its helper
            raise ConfigError(str(weights), "parameters.activation_quantization", str(exc)) from exc
    if engine_config.pack_weights:
        pack_linear_weights(model)
    if model.takes_layer_ops:  # (no helper built or checked for a model that would not)
        model.use_layer_ops(LayerOps.load())
    per_block = kv_bytes_per_block(checkpoint.config, engine_config.block_size, engine_config.dtype)
    blocks = engine_config.num_kv_blocks(per_block)
    kv = allocate_kv_cache(checkpoint.config, blocks, engine_config.block_size, engine_config.dtype)
    heads = checkpoint.config.num_attention_heads
    try:
        model.decode_kernel = decode_kernel(engine_config.decode_attention, heads, *kv[0])
    except KernelUnavailable as exc:  # decode_attention: kernel, and it cannot be had here
        raise ConfigError(str(weights), "parameters.decode_attention", str(exc)) from exc
    try:
        model.prefill_kernel = prefill_kernel(engine_config.prefill_attention, heads, *kv[0])
    except KernelUnavailable as exc:  # prefill_attention: kernel, and it cannot be had here
        raise ConfigError(str(weights), "parameters.prefill_attention", str(exc)) from exc
    tokenizer = ChatTokenizer(checkpoint.tokenizer)
    engine = LLMEngine(
        model,
        kv,
        engine_config,
        eos_token_ids=tokenizer.eos_token_ids,
        decoder_factory=lambda _prompt, skip: IncrementalDetokenizer(tokenizer, skip),
    )
    _warmup(engine, checkpoint.config.vocab_size)
    _return_freed_memory()
    vocab_size = checkpoint.config.vocab_size
    return engine, _Built(tokenizer, vocab_size, blocks, per_block, checkpoint.source)


def _return_freed_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`; elsewhere
    nothing). A load makes and frees float32 copies of every weight (dequantized, packed,
    rounded to int8), which the heap otherwise keeps: measured on the demo SmolLM2, the
    process's RSS after load fell by 100 MiB with `activation_quantization: none` and by 860
    MiB with int8."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc
        return
    trim(0)


def _warmup(engine: LLMEngine, vocab_size: int) -> None:
    """Run the shapes the first clients will: a short prompt with a few decodes, then a full
    prefill budget. The prefill rate that TTFT admission predicts from is measured on a
    second full-budget prefill only, so one-off costs of the first runs do not leave it
    low (which would refuse the first burst of traffic)."""
    from lockgate.llm.sequence import SamplingParams
    from lockgate.llm.step_model import PrefillRate

    config = engine.config
    budget = max(8, min(config.max_num_batched_tokens, config.max_model_len - 1))

    def full(offset: int) -> list[list[int]]:  # distinct prompts: no prefix-cache hit
        return [[1 + (offset + i) % (vocab_size - 1) for i in range(budget)]]

    once = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    with torch.inference_mode():
        engine.generate(
            [[1, 2, 3, 4, 5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        )
        engine.generate(full(0), once)
        engine.scheduler.steps.prefill = PrefillRate()
        engine.generate(full(vocab_size // 2), once)


def resolve_auto_dtype(dtype: str) -> str:
    """`dtype: auto` as this machine runs it best: bfloat16 where the CPU multiplies it
    natively, float32 where torch would emulate it (two to three times slower)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if native_bfloat16() else "float32"
