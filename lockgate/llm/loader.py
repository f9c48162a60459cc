"""Checkpoints to (config, weights, tokenizer): GGUF files and Hugging Face folders.

Weights come out in Hugging Face naming and layout, whatever the source. With a
`quantization` other than none, the attention and MLP projections come out as
`QuantizedWeight`s instead (`Checkpoint.quantized`):

- auto: a GGUF's Q4_0 / Q4_1 projections become int4 exactly (same values, scales and
  zeros; groups of 32), Q8_0 ones int8 (requantized per output row); other types, and
  Hugging Face folders, stay dense;
- int8: every projection, per output row, from any source;
- int4: every projection, in groups of 32: exactly from Q4_0 / Q4_1, otherwise by
  round-to-nearest from the dense weight.

A GGUF file is converted once and the converted copy (dense tensors, and quantized ones as
values + scales + zeros) is cached (safetensors + JSON) under `$LOCKGATE_CACHE_DIR` or
`~/.cache/lockgate/llm/`, one entry per file content and quantization, so later loads skip
the slow parse.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lockgate.errors import ConfigError
from lockgate.llm.engine_config import QUANTIZATIONS
from lockgate.llm.model_config import LlamaConfig, RopeScaling
from lockgate.llm.quantized_linear import (
    KINDS,
    QuantizedWeight,
    can_quantize_int4,
    quantize_int4,
    quantize_int8,
)
from lockgate.llm.tokenizer import TokenizerSpec, spec_from_gguf_metadata, spec_from_hf_folder

logger = logging.getLogger("lockgate.llm")

CACHE_FORMAT = 1  # bump when the cached layout or the conversion changes
_WEIGHTS_FILE = "model.safetensors"
_META_FILE = "lockgate.json"
_TOKENIZER_FILE = "tokenizer.json"


@dataclass(slots=True)
class Checkpoint:
    config: LlamaConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names, [out, in] layout: the dense ones
    tokenizer: TokenizerSpec
    source: str
    quantized: dict[str, QuantizedWeight] = field(default_factory=dict)  # projections, HF names


def load_checkpoint(
    path: str | Path, cache_dir: Path | None = None, quantization: str = "none"
) -> Checkpoint:
    """A `.gguf` file or a Hugging Face folder (config.json + *.safetensors + tokenizer.json),
    its projections quantized as `quantization` says (auto, none, int8, int4)."""
    p = Path(path).expanduser()
    if quantization not in QUANTIZATIONS:
        raise ConfigError(
            str(p), "quantization", f"{quantization!r} is not one of {', '.join(QUANTIZATIONS)}"
        )
    if p.is_dir():
        return load_hf_folder(p, quantization)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p, cache_dir=cache_dir, quantization=quantization)
    raise ConfigError(str(p), "model_path", "expected a .gguf file or a Hugging Face model folder")


def default_cache_dir() -> Path:
    env = os.environ.get("LOCKGATE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lockgate" / "llm"


# Hugging Face folder ------------------------------------------------------------------------


def load_hf_folder(folder: Path, quantization: str = "none") -> Checkpoint:
    """auto and none keep the weights dense; int8 and int4 quantize the projections."""
    start = time.perf_counter()
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(str(folder), "config.json", "file not found")
    raw = json.loads(config_file.read_text(encoding="utf-8"))
    if raw.get("model_type", "llama") not in ("llama", "mistral"):
        raise ConfigError(str(config_file), "model_type", f"unsupported {raw.get('model_type')!r}")
    config = LlamaConfig.from_hf(raw, source=str(config_file))
    weights = _read_safetensors(sorted(folder.glob("*.safetensors")), folder)
    quantized: dict[str, QuantizedWeight] = {}
    if quantization in KINDS:
        for name in [n for n in weights if _is_projection(n)]:
            weight = _quantize(weights[name], quantization)
            if weight is not None:
                quantized[name] = weight
                del weights[name]
    tokenizer = spec_from_hf_folder(folder)
    checkpoint = Checkpoint(config, weights, tokenizer, str(folder), quantized)
    logger.info("loaded %s in %.2f s", folder, time.perf_counter() - start)
    return checkpoint


def _read_safetensors(files: list[Path], folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not files:
        raise ConfigError(str(folder), "*.safetensors", "no weight files found")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        weights.update(load_file(str(file)))
    return weights


# GGUF ---------------------------------------------------------------------------------------

_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_PROJECTION = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj\.weight$"
)
# GGUF block types that map onto a kernel's format as they are (auto keeps them)
_INT4_BLOCKS = {"Q4_0": 18, "Q4_1": 20}  # bytes per block of 32
_AUTO_KINDS = {"Q4_0": "int4", "Q4_1": "int4", "Q8_0": "int8"}


def load_gguf(
    path: Path, cache_dir: Path | None = None, use_cache: bool = True, quantization: str = "none"
) -> Checkpoint:
    """Convert a llama GGUF file, or read its converted copy from the cache."""
    start = time.perf_counter()
    root = cache_dir or default_cache_dir()
    entry = root / _cache_key(path, root, quantization)
    if use_cache and (entry / _META_FILE).is_file():
        try:
            checkpoint = _read_cache(entry, str(path))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            logger.warning("ignoring unreadable cache %s: %s", entry, exc)
            shutil.rmtree(entry, ignore_errors=True)
        else:
            elapsed = time.perf_counter() - start
            logger.info("loaded %s from cache %s in %.2f s", path, entry, elapsed)
            return checkpoint
    checkpoint = parse_gguf(path, quantization)
    kinds = sorted({w.kind for w in checkpoint.quantized.values()})
    note = f", {len(checkpoint.quantized)} projections {'/'.join(kinds)}" if kinds else ""
    logger.info("parsed and dequantized %s in %.2f s%s", path, time.perf_counter() - start, note)
    if use_cache:
        _write_cache(entry, checkpoint)
    return checkpoint


def parse_gguf(path: Path, quantization: str = "none") -> Checkpoint:
    """Read metadata and convert every tensor of a GGUF file (slow: seconds)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ConfigError(str(path), "<file>", f"not a readable GGUF file: {exc}") from exc
    meta = {name: _field_value(f) for name, f in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_config(meta, str(path), tensors)
    weights: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantizedWeight] = {}
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight":
            continue
        hf = _hf_name(name, str(path))
        order = _rope_row_order(name, int(tensor.data.shape[0]), config)
        weight = _convert(tensor, _target_kind(hf, tensor.tensor_type.name, quantization))
        if isinstance(weight, QuantizedWeight):
            quantized[hf] = weight if order is None else weight.rows(order)
        else:
            weights[hf] = weight if order is None else weight[order]
    tokenizer = spec_from_gguf_metadata(meta, str(path))
    return Checkpoint(config, weights, tokenizer, str(path), quantized)


def _convert(tensor: Any, kind: str | None) -> torch.Tensor | QuantizedWeight:
    """One GGUF tensor, quantized as `kind` says (None: dense float32), in the file's row
    order. Q4_0 / Q4_1 blocks become int4 as they are; anything else is dequantized first."""
    import gguf

    if kind == "int4" and tensor.tensor_type.name in _INT4_BLOCKS:
        return _int4_from_blocks(tensor)
    dense = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    array = torch.from_numpy(np.array(dense, dtype=np.float32, order="C"))  # a writable copy
    weight = _quantize(array, kind) if kind else None
    return array if weight is None else weight


def _is_projection(name: str) -> bool:
    return _PROJECTION.match(name) is not None


def _target_kind(name: str, gguf_type: str, quantization: str) -> str | None:
    """int8, int4 or None (dense) for one tensor of a GGUF file."""
    if not _is_projection(name) or quantization == "none":
        return None
    if quantization == "auto":
        return _AUTO_KINDS.get(gguf_type)
    return quantization


def _quantize(weight: torch.Tensor, kind: str) -> QuantizedWeight | None:
    """A dense [N, K] weight quantized; None where int4's groups do not fit K."""
    if kind == "int8":
        return quantize_int8(weight)
    return quantize_int4(weight) if can_quantize_int4(weight) else None


def _int4_from_blocks(tensor: Any) -> QuantizedWeight:
    """Q4_0 (w = d (q - 8)) or Q4_1 (w = d q + m) blocks of 32 as int4 with scale d and zero
    0 or m + 8 d: the same values. A block: f16 d, [f16 m], 16 bytes whose low nibbles are
    inputs 0-15 and high nibbles inputs 16-31."""
    size = _INT4_BLOCKS[tensor.tensor_type.name]
    raw = np.asarray(tensor.data)
    rows = raw.shape[0]
    blocks = raw.reshape(rows, -1, size)  # [N, K/32, size] uint8
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
    zeros = np.zeros_like(d)
    if size == 20:
        m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        zeros = m + 8 * d
    nibbles = blocks[..., size - 16 :]  # [N, K/32, 16]
    q = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(rows, -1)  # [N, K]
    return QuantizedWeight.int4(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(zeros))


def _field_value(f: Any) -> Any:
    try:
        return f.contents()
    except (ValueError, IndexError, UnicodeDecodeError):
        return None


def gguf_config(meta: dict[str, Any], source: str, tensors: dict[str, Any]) -> LlamaConfig:
    """LlamaConfig from GGUF metadata (`<arch>.block_count`, `<arch>.embedding_length`, ...)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConfigError(
            source, "general.architecture", f"only 'llama' is supported, got {arch!r}"
        )

    def need(key: str) -> Any:
        if meta.get(f"{arch}.{key}") is None:
            raise ConfigError(source, f"{arch}.{key}", "missing from the GGUF metadata")
        return meta[f"{arch}.{key}"]

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_hidden_layers=int(need("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(meta.get(f"{arch}.attention.head_count_kv") or heads),
        head_dim=int(meta.get(f"{arch}.rope.dimension_count") or hidden // heads),
        max_position_embeddings=int(meta.get(f"{arch}.context_length") or 2048),
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=_gguf_rope_scaling(meta, arch, source),
        rope_freq_factors=_rope_freq_factors(tensors),
        tie_word_embeddings="output.weight" not in tensors,
        source=source,
    )


def _gguf_rope_scaling(meta: dict[str, Any], arch: str, source: str) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type") or "none"
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "none" or factor in (None, 0, 1):
        return RopeScaling()
    if kind != "linear":
        raise ConfigError(source, f"{arch}.rope.scaling.type", f"unsupported {kind!r}")
    return RopeScaling(kind="linear", factor=float(factor))


def _rope_freq_factors(tensors: dict[str, Any]) -> tuple[float, ...] | None:
    # llama3-style scaling is stored as per-frequency divisors rather than metadata
    tensor = tensors.get("rope_freqs.weight")
    return None if tensor is None else tuple(float(x) for x in np.asarray(tensor.data).ravel())


def _hf_name(name: str, source: str) -> str:
    match = _BLOCK_NAME.match(name)
    if match:
        index, part, kind = match.groups()
        if part in _GGUF_LAYER_NAMES:
            return f"model.layers.{index}.{_GGUF_LAYER_NAMES[part]}.{kind}"
    stem, _, kind = name.rpartition(".")
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
    raise ConfigError(source, name, "unknown tensor for a llama model")


def _rope_row_order(name: str, rows: int, config: LlamaConfig) -> torch.Tensor | None:
    """The rows that undo llama.cpp's rotary permutation of Q and K (interleaved ->
    half-split): row r of the result is row order[r] of the file. None for other tensors."""
    if ".attn_q." not in name and ".attn_k." not in name:
        return None
    heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
    return torch.arange(rows).view(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


# Conversion cache ---------------------------------------------------------------------------


def _cache_key(path: Path, cache_dir: Path, quantization: str = "none") -> str:
    """Keyed on the file's whole content, not its location, so a copy or a hard link of the
    same file reuses one converted cache and a file edited anywhere never loads stale
    weights; and on the quantization (none keeps the key it always had). The SHA-256 is
    computed once per (size, modification time) and remembered in `cache_dir/digests/`."""
    key = f"gguf-{content_digest(path, cache_dir / 'digests')[:16]}-v{CACHE_FORMAT}"
    return key if quantization == "none" else f"{key}-{quantization}"


def content_digest(path: Path, memo_dir: Path) -> str:
    """SHA-256 of a file, memoized by its resolved path, size and mtime_ns."""
    stat = path.stat()
    stamp = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    memo = memo_dir / hashlib.sha256(stamp.encode()).hexdigest()[:32]
    try:
        remembered = memo.read_text().split()
        if len(remembered) == 2 and remembered[0] == stamp.rsplit("|", 2)[1]:
            return remembered[1]
    except OSError:
        pass
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    value = digest.hexdigest()
    try:
        memo_dir.mkdir(parents=True, exist_ok=True)
        memo.write_text(f"{stat.st_size} {value}")
    except OSError as exc:  # a read-only cache: hash again next time
        logger.warning("could not remember the digest of %s: %s", path, exc)
    return value


def _write_cache(entry: Path, checkpoint: Checkpoint) -> None:
    """Write into a temporary sibling folder, then rename it into place (atomic)."""
    from safetensors.torch import save_file

    tmp = entry.with_name(f"{entry.name}.tmp-{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        tensors = dict(checkpoint.weights)
        for name, weight in checkpoint.quantized.items():
            tensors.update(weight.tensors(name))
        save_file(tensors, str(tmp / _WEIGHTS_FILE))
        (tmp / _TOKENIZER_FILE).write_text(checkpoint.tokenizer.tokenizer_json, encoding="utf-8")
        tok_meta = checkpoint.tokenizer.to_dict()
        del tok_meta["tokenizer_json"]
        meta = {
            "format": CACHE_FORMAT,
            "config": checkpoint.config.to_dict(),
            "tokenizer": tok_meta,
            "quantized": {name: w.kind for name, w in checkpoint.quantized.items()},
        }
        (tmp / _META_FILE).write_text(json.dumps(meta), encoding="utf-8")
        os.replace(tmp, entry)
    except OSError as exc:
        logger.warning("could not cache the converted model at %s: %s", entry, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _read_cache(entry: Path, source: str) -> Checkpoint:
    from safetensors.torch import load_file

    meta = json.loads((entry / _META_FILE).read_text(encoding="utf-8"))
    config = LlamaConfig.from_dict(meta["config"])
    tok_meta = dict(meta["tokenizer"])
    tok_meta["tokenizer_json"] = (entry / _TOKENIZER_FILE).read_text(encoding="utf-8")
    weights = load_file(str(entry / _WEIGHTS_FILE))
    quantized = {
        name: QuantizedWeight.from_tensors(kind, name, weights)
        for name, kind in meta.get("quantized", {}).items()
    }
    for name, weight in quantized.items():
        for key in weight.tensors(name):
            del weights[key]
    return Checkpoint(config, weights, TokenizerSpec.from_dict(tok_meta), source, quantized)
