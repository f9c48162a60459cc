"""Settings of the LLM engine: KV cache size, batch budgets and scheduling policy."""

from __future__ import annotations

from dataclasses import dataclass

from lockgate.errors import ConfigError

DTYPES = ("float32", "bfloat16")
QUANTIZATIONS = ("auto", "none", "int8", "int4")  # weight-only, of the linear projections
DECODE_ATTENTION = ("auto", "kernel", "sdpa")  # `llm/decode_kernel.py`
PREFILL_ATTENTION = ("auto", "kernel", "sdpa")  # `llm/prefill_kernel.py`
ACTIVATION_QUANTIZATIONS = ("none", "int8")  # `llm/models/int8_activations.py`
SPECULATIVE_METHODS = ("none", "ngram")  # ngram: prompt lookup (`llm/speculative.py`)
STEP_POLICIES = ("decode_first", "prefill_first")  # who gets a step's token budget first
_SOURCE = "EngineConfig"


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Validated on construction; a wrong value raises ConfigError naming the field.

    The KV cache size is given either as a block count (`kv_cache_blocks`) or as memory
    (`kv_cache_gib`, turned into blocks by `num_kv_blocks` once the model's bytes per block
    are known).

    `tpot_slo_ms` sizes prefill chunks from measurements: while sequences decode, a step takes
    only the prompt tokens that the measured prefill rate fits in the time the SLO leaves after
    the decodes (at least `block_size`), so streams keep their time per output token while
    prompts are prefilled beside them; with nothing decoding, prompts get the whole
    `max_num_batched_tokens`.

    `step_policy` says who gets a step's token budget first: `decode_first` (the default)
    gives each running sequence its decode token and prompts what is left; `prefill_first`
    gives queued prompts the budget first while any wait, and decodes what they leave, so
    first tokens come sooner and decodes pause, for at most `max_decode_stall_ms` at a time.

    `max_num_batched_tokens` (1536): a larger step multiplies larger matrices, which this
    CPU runs faster per token, so a burst of prompts is prefilled sooner. SmolLM2 at 32
    concurrent streams of the shared 64-request workload gave 270 to 289 output tokens/s and
    a TTFT p99 of 3.42 to 3.47 s in four runs with 1536, against 234 to 264 tokens/s and 4.2
    to 5.2 s in three with 512 (1024: 259 to 292 tokens/s, 3.5 to 4.2 s; 2048: 282 to 295,
    3.6 s); at 8 streams 180 against 189 tokens/s, and a TTFT p99 of 1.0 against 1.9 s.

    Speculative decoding (`speculative: ngram`, off by default) drafts up to
    `num_speculative_tokens` tokens per decoding sequence and step by looking up its last
    `prompt_lookup_max` down to `prompt_lookup_min` tokens earlier in its prompt and output,
    and verifies them in the same forward pass as its last token.
    """

    max_model_len: int = 2048  # prompt + output tokens of one sequence
    block_size: int = 16
    kv_cache_blocks: int | None = None
    kv_cache_gib: float | None = 1.0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1536  # see the docstring
    max_waiting: int = 1024
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    continuous_batching: bool = True
    dtype: str = "float32"
    num_threads: int | None = None  # torch intra-op threads; None: leave torch's default
    pack_weights: bool = True  # bfloat16: reorder weights for oneDNN once, at load
    quantization: str = "auto"  # auto: keep a GGUF's Q4_0/Q4_1 (int4) and Q8_0 (int8)
    ttft_slo_ms: float | None = None  # refuse what would wait longer for its first token
    tpot_slo_ms: float | None = None  # cut prefill chunks so decoding steps keep to this
    admission_slack: float = 0.8  # admit when the predicted TTFT is within this share
    speculative: str = "none"  # none, or ngram: draft tokens by prompt lookup
    num_speculative_tokens: int = 4  # drafts verified per sequence and step, at most
    prompt_lookup_min: int = 2  # shortest suffix of a sequence looked up in it, in tokens
    prompt_lookup_max: int = 4  # longest
    decode_attention: str = "auto"  # auto, kernel or sdpa (`llm/decode_kernel.py`)
    prefill_attention: str = "auto"  # auto, kernel or sdpa (`llm/prefill_kernel.py`)
    activation_quantization: str = "none"  # int8: large steps multiply in int8
    step_policy: str = "decode_first"  # or prefill_first: queued prompts before decodes
    max_decode_stall_ms: float = 1000.0  # prefill_first: decodes wait at most this long

    def __post_init__(self) -> None:
        for fld, ok, problem in self._checks():
            if not ok:
                raise ConfigError(_SOURCE, fld, problem)

    def _checks(self) -> list[tuple[str, bool, str]]:
        gib = self.kv_cache_gib
        return [
            ("max_model_len", self.max_model_len >= 2, "must be >= 2"),
            ("block_size", 1 <= self.block_size <= 1024, "must be in [1, 1024]"),
            ("kv_cache_blocks", self.kv_cache_blocks is None or self.kv_cache_blocks >= 1,
             "must be >= 1"),
            ("kv_cache_gib", gib is None or gib > 0, "must be > 0"),
            ("kv_cache_gib", gib is not None or self.kv_cache_blocks is not None,
             "give kv_cache_blocks or kv_cache_gib"),
            ("max_num_seqs", self.max_num_seqs >= 1, "must be >= 1"),
            ("max_num_batched_tokens", self.max_num_batched_tokens >= self.max_num_seqs,
             "must be >= max_num_seqs (each running sequence decodes one token per step)"),
            ("max_num_batched_tokens",
             self.enable_chunked_prefill or self.max_num_batched_tokens >= self.max_model_len,
             "must be >= max_model_len when chunked prefill is off (a prompt runs whole)"),
            ("max_waiting", self.max_waiting >= 1, "must be >= 1"),
            ("dtype", self.dtype in DTYPES, f"must be one of {', '.join(DTYPES)}"),
            ("quantization", self.quantization in QUANTIZATIONS,
             f"{self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}"),
            ("num_threads", self.num_threads is None or self.num_threads >= 1, "must be >= 1"),
            ("ttft_slo_ms", self.ttft_slo_ms is None or self.ttft_slo_ms > 0, "must be > 0"),
            ("tpot_slo_ms", self.tpot_slo_ms is None or self.tpot_slo_ms > 0, "must be > 0"),
            ("admission_slack", 0 < self.admission_slack <= 10, "must be in (0, 10]"),
            ("speculative", self.speculative in SPECULATIVE_METHODS,
             f"{self.speculative!r} is not one of {', '.join(SPECULATIVE_METHODS)}"),
            ("num_speculative_tokens", self.num_speculative_tokens >= 1, "must be >= 1"),
            ("prompt_lookup_min", self.prompt_lookup_min >= 1, "must be >= 1"),
            ("prompt_lookup_max", self.prompt_lookup_max >= self.prompt_lookup_min,
             "must be >= prompt_lookup_min"),
            ("decode_attention", self.decode_attention in DECODE_ATTENTION,
             f"{self.decode_attention!r} is not one of {', '.join(DECODE_ATTENTION)}"),
            ("prefill_attention", self.prefill_attention in PREFILL_ATTENTION,
             f"{self.prefill_attention!r} is not one of {', '.join(PREFILL_ATTENTION)}"),
            ("activation_quantization",
             self.activation_quantization in ACTIVATION_QUANTIZATIONS,
             f"{self.activation_quantization!r} is not one of "
             f"{', '.join(ACTIVATION_QUANTIZATIONS)}"),
            ("activation_quantization",
             self.activation_quantization == "none" or self.quantization != "none",
             "int8 needs quantized weights (quantization auto, int8 or int4), not none"),
            ("step_policy", self.step_policy in STEP_POLICIES,
             f"{self.step_policy!r} is not one of {', '.join(STEP_POLICIES)}"),
            ("max_decode_stall_ms", self.max_decode_stall_ms > 0, "must be > 0"),
        ]  # fmt: skip

    @property
    def prefill_first(self) -> bool:
        return self.step_policy == "prefill_first"

    @property
    def weight_quantization(self) -> str:
        """`quantization` as the loader applies it (the int8/int4 kernels run in bfloat16 in
        a model of either dtype: `QuantizedLinear`)."""
        return self.quantization

    def num_kv_blocks(self, bytes_per_block: int) -> int:
        """Blocks in the cache: `kv_cache_blocks`, else as many as fit in `kv_cache_gib`."""
        if self.kv_cache_blocks is not None:
            blocks = self.kv_cache_blocks
        else:
            assert self.kv_cache_gib is not None  # checked in __post_init__
            blocks = int(self.kv_cache_gib * 2**30 // bytes_per_block)
        if blocks * self.block_size < self.max_model_len:
            raise ConfigError(
                _SOURCE,
                "kv_cache_blocks" if self.kv_cache_blocks is not None else "kv_cache_gib",
                f"{blocks} blocks of {self.block_size} tokens cannot hold one sequence of "
                f"max_model_len {self.max_model_len}",
            )
        return blocks
