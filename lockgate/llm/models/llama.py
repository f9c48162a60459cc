"""A Llama decoder over a paged KV cache: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The model sees only tensors and `AttentionMetadata`. Q/K/V and gate/up projections are fused
into one Linear each when the weights are loaded, so a decode step runs few, larger ops.
Weights come in Hugging Face naming (`model.layers.N.self_attn.q_proj.weight`, ...).
Projections given quantized become `QuantizedLinear`s, in a pass over the built model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from lockgate.errors import BadRequest, ConfigError
from lockgate.llm.attention import (
    AttentionMetadata,
    AttentionPlan,
    KVCache,
    paged_attention,
    plan_attention,
    write_kv,
)
from lockgate.llm.decode_kernel import DecodeKernel
from lockgate.llm.layer_ops import MAX_WIDTH, LayerOps
from lockgate.llm.model_config import LlamaConfig
from lockgate.llm.prefill_kernel import PrefillKernel
from lockgate.llm.quantized_linear import QuantizedLinear, QuantizedWeight, quantize_int8

SUPPORTED_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """`"float32"` / `"bfloat16"` (or the torch dtype itself) to a torch dtype."""
    if isinstance(name, torch.dtype) and name in SUPPORTED_DTYPES.values():
        return name
    if isinstance(name, str) and name in SUPPORTED_DTYPES:
        return SUPPORTED_DTYPES[name]
    raise ConfigError("<model>", "dtype", f"{name!r} is not one of {sorted(SUPPORTED_DTYPES)}")


def rope_inverse_frequencies(config: LlamaConfig) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies after the configured scaling."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = config.rope_scaling
    if scaling.kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.kind == "llama3":
        inv_freq = _llama3_scaled(inv_freq, config)
    if config.rope_freq_factors is not None:
        inv_freq = inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, config: LlamaConfig) -> torch.Tensor:
    s = config.rope_scaling
    old_context = s.original_max_position_embeddings
    low_freq_wavelen = old_context / s.low_freq_factor
    high_freq_wavelen = old_context / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are interpolated, short ones kept, the band between blended
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_context / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryTable:
    """cos/sin of every position, computed once: [max_positions, head_dim / 2] each."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype) -> None:
        positions = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, rope_inverse_frequencies(config))  # [P, d/2]
        self.cos = freqs.cos().to(dtype)
        self.sin = freqs.sin().to(dtype)
        self.max_positions = config.max_position_embeddings

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for the given positions, [T, 1, d/2], broadcastable over heads."""
        if positions.numel() and int(positions.max()) >= self.max_positions:
            raise BadRequest(f"position beyond the model's context of {self.max_positions} tokens")
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, d] in half-split layout (Hugging Face's rotate_half convention)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.ops: LayerOps | None = None  # set by `use_layer_ops`: RoPE, KV stores in one pass

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (nh + 2 kvh) d]
        k_cache, v_cache = kv_cache
        if self.ops is not None and qkv.stride(1) == 1:  # in place on qkv's Q and K
            self.ops.rope_write_kv(
                qkv, self.num_heads, cos[:, 0], sin[:, 0], slot_mapping, k_cache, v_cache
            )
            q = qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.num_kv_heads, -1)
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        else:
            qk = qkv[:, : self.q_size + self.kv_size].view(
                t, self.num_heads + self.num_kv_heads, -1
            )
            qk = apply_rope(qk, cos, sin)  # [T, nh + kvh, d]
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
            write_kv(k_cache, v_cache, k, v, slot_mapping)
        return self.o_proj(paged_attention(q, k, v, k_cache, v_cache, plan))


class LlamaMLP(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))  # in place: one [T, I] result fewer


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # accumulates in float32 for bfloat16 inputs
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)
        self.ops: LayerOps | None = None  # set by `use_layer_ops`: norms in one pass

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        plan: AttentionPlan,
    ) -> torch.Tensor:
        ops = self.ops
        if ops is None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, slot_mapping, plan)
            return x + self.mlp(self.post_attention_layernorm(x))
        first, second = self.input_layernorm, self.post_attention_layernorm
        attended = self.self_attn(
            ops.rms_norm(x, first.weight, first.eps), cos, sin, kv_cache, slot_mapping, plan
        )
        x, normed = ops.add_rms_norm(x, attended, second.weight, second.eps)
        return x + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    """Build with `build_llama`; call `forward` then `compute_logits` on the rows you need."""

    def __init__(self, config: LlamaConfig, rope: RotaryTable) -> None:
        super().__init__()
        self.config = config
        self.rope = rope
        # an explicit weight skips the random init (weights are assigned at load)
        embedding = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=embedding)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head: nn.Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None  # set by models/packing.py: [N, H] -> [N, V]
        self.decode_kernel: DecodeKernel | None = None  # attends decodes in place, when set
        self.prefill_kernel: PrefillKernel | None = None  # attends prompts in place, when set

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def takes_layer_ops(self) -> bool:
        """Whether `use_layer_ops` would take a helper: a bfloat16 model whose rows the helper
        sums as torch does (`MAX_WIDTH`)."""
        return self.dtype == torch.bfloat16 and self.config.hidden_size <= MAX_WIDTH

    def use_layer_ops(self, ops: LayerOps | None) -> bool:
        """Run each layer's RMSNorms (with the residual add before the second) and RoPE (with
        the KV cache stores after it) in `ops`' single passes (`layer_ops.py`), or torch's ops
        with None or where the model does not take them (`takes_layer_ops`); returns whether
        it did."""
        if not self.takes_layer_ops:
            ops = None
        for layer in self.layers:
            assert isinstance(layer, LlamaDecoderLayer)
            layer.ops = layer.self_attn.ops = ops
        return ops is not None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: KVCache,
    ) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden]."""
        if len(kv_caches) != len(self.layers):
            raise BadRequest(f"got {len(kv_caches)} KV cache layers, model has {len(self.layers)}")
        if input_ids.shape[0] != meta.num_tokens or positions.shape != input_ids.shape:
            raise BadRequest(
                f"{input_ids.shape[0]} input ids and {positions.shape[0]} positions"
                f" for {meta.num_tokens} query tokens"
            )
        plan = plan_attention(meta, self.decode_kernel, self.prefill_kernel)
        cos, sin = self.rope.lookup(positions)
        h = self.embed_tokens(input_ids)  # [T, H]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            h = layer(h, cos, sin, kv_cache, meta.slot_mapping, plan)
        return self.norm(h)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, H] -> float32 logits [N, vocab]."""
        if self.logits_head is not None:
            return self.logits_head(hidden).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()


# this module's projection -> the Hugging Face projections stacked into it, in order
FUSED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


@dataclass(slots=True)
class FusedWeights:
    """This module's names: the state dict (dense tensors) and the quantized projections
    (module name -> weight), which the state dict does not hold."""

    dense: dict[str, torch.Tensor] = field(default_factory=dict)
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)


def fuse_weights(
    config: LlamaConfig,
    weights: Mapping[str, torch.Tensor],
    dtype: torch.dtype,
    quantized: Mapping[str, QuantizedWeight] | None = None,
) -> FusedWeights:
    """Hugging Face LlamaForCausalLM names -> this module's names, Q/K/V and gate/up fused.

    A fused projection stays quantized when all its parts are, in one kind; otherwise the
    quantized parts are dequantized and it is dense."""
    quantized = quantized or {}
    out = FusedWeights()

    def take(name: str) -> torch.Tensor:
        if name in weights:
            return weights[name].to(dtype)
        if name in quantized:
            return quantized[name].dequantize().to(dtype)
        raise ConfigError(config.source, name, "tensor missing from the checkpoint")

    out.dense["embed_tokens.weight"] = take("model.embed_tokens.weight")
    out.dense["norm.weight"] = take("model.norm.weight")
    if not config.tie_word_embeddings:
        out.dense["lm_head.weight"] = take("lm_head.weight")
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        for target, parts in FUSED_PROJECTIONS.items():
            names = [f"{src}{part}.weight" for part in parts]
            found = [quantized.get(name) for name in names]
            kinds = {w.kind if w is not None else None for w in found}
            if len(kinds) == 1 and None not in kinds:
                out.quantized[f"{dst}{target}"] = QuantizedWeight.cat(
                    [w for w in found if w is not None]
                )
            else:
                out.dense[f"{dst}{target}.weight"] = torch.cat([take(n) for n in names], dim=0)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out.dense[f"{dst}{norm}.weight"] = take(f"{src}{norm}.weight")
    return out


def build_llama(
    config: LlamaConfig,
    weights: Mapping[str, torch.Tensor],
    dtype: str | torch.dtype = "float32",
    quantized: Mapping[str, QuantizedWeight] | None = None,
) -> LlamaForCausalLM:
    """A ready-to-run model from Hugging Face-named weights, cast to `dtype`; the projections
    in `quantized` (Hugging Face names too) run as `QuantizedLinear`s."""
    torch_dtype = resolve_dtype(dtype)
    fused = fuse_weights(config, weights, torch_dtype, quantized)
    rope = RotaryTable(config, torch_dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, rope)
    for name, weight in fused.quantized.items():
        parent, _, child = name.rpartition(".")
        plain = model.get_submodule(name)
        assert isinstance(plain, nn.Linear)
        shape = (weight.out_features, weight.in_features)
        if shape != (plain.out_features, plain.in_features):
            raise ConfigError(config.source, name, f"quantized weight {shape}, expected "
                              f"{(plain.out_features, plain.in_features)}")  # fmt: skip
        setattr(model.get_submodule(parent), child, QuantizedLinear(weight, torch_dtype))
    try:
        model.load_state_dict(fused.dense, strict=True, assign=True)
    except RuntimeError as exc:
        raise ConfigError(config.source, "weights", str(exc).splitlines()[0]) from exc
    if fused.quantized:
        model.logits_head = quantized_head(model)
    return model.eval().requires_grad_(False)


def quantized_head(model: LlamaForCausalLM) -> QuantizedLinear:
    """The logits head of a model whose projections run quantized: int8 with one scale per
    vocabulary row for steps that sample few rows, where reading the head is most of its cost
    (SmolLM2 in float32: 1.0 ms against 3.0 ms for one row, 2.0 against 6.5 for four); from
    its `dense_from` rows, the embedding (or lm_head) weight itself. The int8 kernel runs
    in bfloat16 (in float32 it is ten times slower), so those logits carry bfloat16's
    rounding, as the projections' outputs do."""
    head = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return QuantizedLinear(quantize_int8(head), head.dtype, dense=head)


def allocate_kv_cache(
    config: LlamaConfig, num_blocks: int, block_size: int, dtype: str | torch.dtype
) -> KVCache:
    """Zeroed per-layer (k_cache, v_cache), each [num_blocks, block_size, kvh, head_dim]."""
    if num_blocks <= 0 or block_size <= 0:
        raise ConfigError("<kv cache>", "num_blocks", "num_blocks and block_size must be > 0")
    shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
    torch_dtype = resolve_dtype(dtype)
    return [
        (torch.zeros(shape, dtype=torch_dtype), torch.zeros(shape, dtype=torch_dtype))
        for _ in range(config.num_hidden_layers)
    ]


def kv_bytes_per_block(config: LlamaConfig, block_size: int, dtype: str | torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    element = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
    per_layer = 2 * block_size * config.num_key_value_heads * config.head_dim * element
    return per_layer * config.num_hidden_layers
