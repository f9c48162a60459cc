"""Model implementations behind one builder: weights in Hugging Face naming in, module out."""

from __future__ import annotations

from lockgate.llm.models.llama import (
    LlamaForCausalLM,
    allocate_kv_cache,
    build_llama,
    kv_bytes_per_block,
    resolve_dtype,
)

__all__ = [
    "LlamaForCausalLM",
    "allocate_kv_cache",
    "build_llama",
    "kv_bytes_per_block",
    "resolve_dtype",
]
