"""The shape of a Llama-family model: what the loader reads and the model builds from."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from lockgate.errors import ConfigError

ROPE_SCALING_KINDS = ("none", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """How the inverse frequencies of RoPE are stretched for long contexts.

    - none: plain RoPE
    - linear: every inverse frequency divided by `factor` (position interpolation)
    - llama3: low frequencies divided by `factor`, high ones kept, a smooth ramp between
    """

    kind: str = "none"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def validate(self, source: str) -> None:
        if self.kind not in ROPE_SCALING_KINDS:
            raise ConfigError(source, "rope_scaling.rope_type", f"unsupported {self.kind!r}")
        if self.factor <= 0:
            raise ConfigError(source, "rope_scaling.factor", "must be > 0")
        if self.kind == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                source, "rope_scaling.high_freq_factor", "must exceed low_freq_factor"
            )

    @classmethod
    def from_hf(cls, raw: dict[str, Any] | None) -> RopeScaling:
        """From the `rope_scaling` object of a Hugging Face config.json (None means plain)."""
        if not raw:
            return cls()
        kind = str(raw.get("rope_type", raw.get("type", "none")))
        kind = "none" if kind == "default" else kind
        return cls(
            kind=kind,
            factor=float(raw.get("factor", 1.0)),
            low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
            high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
        )


@dataclass(frozen=True, slots=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # Per-frequency divisors stored by some GGUF files instead of a rope_scaling block.
    rope_freq_factors: tuple[float, ...] | None = None
    tie_word_embeddings: bool = False
    source: str = "<config>"

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(
                self, "head_dim", self.hidden_size // max(1, self.num_attention_heads)
            )
        self._validate()

    def _validate(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        for name in (*positive, "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(self.source, name, f"must be > 0, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(self.source, "num_key_value_heads", "must divide num_attention_heads")
        if self.head_dim % 2:
            raise ConfigError(self.source, "head_dim", "must be even for rotary embeddings")
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 0:
            raise ConfigError(self.source, "rope_theta", "must be a positive number")
        factors = self.rope_freq_factors
        if factors is not None and len(factors) != self.head_dim // 2:
            raise ConfigError(self.source, "rope_freqs", f"needs {self.head_dim // 2} values")
        self.rope_scaling.validate(self.source)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> LlamaConfig:
        """Inverse of `to_dict` (used by the conversion cache)."""
        fields = dict(raw)
        fields["rope_scaling"] = RopeScaling(**fields.get("rope_scaling", {}))
        factors = fields.get("rope_freq_factors")
        fields["rope_freq_factors"] = tuple(factors) if factors is not None else None
        return cls(**fields)

    @classmethod
    def from_hf(cls, raw: dict[str, Any], source: str) -> LlamaConfig:
        """From a Hugging Face config.json of a LlamaForCausalLM."""
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        for name in (*required, "num_attention_heads"):
            if not isinstance(raw.get(name), int):
                raise ConfigError(source, name, "missing or not an integer")
        heads = raw["num_attention_heads"]
        rope_params = raw.get("rope_parameters") or {}
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or 0),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            rope_theta=float(raw.get("rope_theta", rope_params.get("rope_theta", 10000.0))),
            rope_scaling=RopeScaling.from_hf(raw.get("rope_scaling") or rope_params),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            source=source,
        )
