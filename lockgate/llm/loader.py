"""Checkpoints to (config, weights, tokenizer): GGUF files and Hugging Face folders.

Weights come out in Hugging Face naming and layout, whatever the source. A GGUF file is
dequantized once and a converted copy is cached (safetensors + JSON) under
`$LOCKGATE_CACHE_DIR` or `~/.cache/lockgate/llm/`, so later loads skip the slow parse.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lockgate.errors import ConfigError
from lockgate.llm.model_config import LlamaConfig, RopeScaling
from lockgate.llm.tokenizer import TokenizerSpec, spec_from_gguf_metadata, spec_from_hf_folder

logger = logging.getLogger("lockgate.llm")

CACHE_FORMAT = 1  # bump when the cached layout or the conversion changes
_WEIGHTS_FILE = "model.safetensors"
_META_FILE = "lockgate.json"
_TOKENIZER_FILE = "tokenizer.json"


@dataclass(slots=True)
class Checkpoint:
    config: LlamaConfig
    weights: dict[str, torch.Tensor]  # Hugging Face names, [out, in] layout
    tokenizer: TokenizerSpec
    source: str


def load_checkpoint(path: str | Path, cache_dir: Path | None = None) -> Checkpoint:
    """A `.gguf` file or a Hugging Face folder (config.json + *.safetensors + tokenizer.json)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return load_hf_folder(p)
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf(p, cache_dir=cache_dir)
    raise ConfigError(str(p), "model_path", "expected a .gguf file or a Hugging Face model folder")


def default_cache_dir() -> Path:
    env = os.environ.get("LOCKGATE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lockgate" / "llm"


# Hugging Face folder ------------------------------------------------------------------------


def load_hf_folder(folder: Path) -> Checkpoint:
    start = time.perf_counter()
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(str(folder), "config.json", "file not found")
    raw = json.loads(config_file.read_text(encoding="utf-8"))
    if raw.get("model_type", "llama") not in ("llama", "mistral"):
        raise ConfigError(str(config_file), "model_type", f"unsupported {raw.get('model_type')!r}")
    config = LlamaConfig.from_hf(raw, source=str(config_file))
    weights = _read_safetensors(sorted(folder.glob("*.safetensors")), folder)
    checkpoint = Checkpoint(config, weights, spec_from_hf_folder(folder), str(folder))
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


def load_gguf(path: Path, cache_dir: Path | None = None, use_cache: bool = True) -> Checkpoint:
    """Dequantize a llama GGUF file, or read its converted copy from the cache."""
    start = time.perf_counter()
    root = cache_dir or default_cache_dir()
    entry = root / _cache_key(path, root)
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
    checkpoint = parse_gguf(path)
    logger.info("parsed and dequantized %s in %.2f s", path, time.perf_counter() - start)
    if use_cache:
        _write_cache(entry, checkpoint)
    return checkpoint


def parse_gguf(path: Path) -> Checkpoint:
    """Read metadata and dequantize every tensor of a GGUF file (slow: seconds)."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as exc:
        raise ConfigError(str(path), "<file>", f"not a readable GGUF file: {exc}") from exc
    meta = {name: _field_value(f) for name, f in reader.fields.items()}
    tensors = {t.name: t for t in reader.tensors}
    config = gguf_config(meta, str(path), tensors)
    weights = {}
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight":
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        weights[_hf_name(name, str(path))] = _unpermute(name, np.asarray(array), config)
    return Checkpoint(config, weights, spec_from_gguf_metadata(meta, str(path)), str(path))


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


def _unpermute(name: str, array: np.ndarray, config: LlamaConfig) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of Q and K rows (interleaved -> half-split)."""
    if ".attn_q." in name or ".attn_k." in name:
        heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
        rows = array.shape[0]
        array = array.reshape(heads, rows // heads // 2, 2, *array.shape[1:])
        array = array.swapaxes(1, 2).reshape(rows, *array.shape[3:])
    return torch.from_numpy(np.array(array, dtype=np.float32, order="C"))  # a writable copy


# Conversion cache ---------------------------------------------------------------------------


def _cache_key(path: Path, cache_dir: Path) -> str:
    """Keyed on the file's whole content, not its location, so a copy or a hard link of the
    same file reuses one converted cache and a file edited anywhere never loads stale
    weights. The SHA-256 is computed once per (size, modification time) and remembered in
    `cache_dir/digests/`."""
    return f"gguf-{content_digest(path, cache_dir / 'digests')[:16]}-v{CACHE_FORMAT}"


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
        save_file(checkpoint.weights, str(tmp / _WEIGHTS_FILE))
        (tmp / _TOKENIZER_FILE).write_text(checkpoint.tokenizer.tokenizer_json, encoding="utf-8")
        tok_meta = checkpoint.tokenizer.to_dict()
        del tok_meta["tokenizer_json"]
        meta = {
            "format": CACHE_FORMAT,
            "config": checkpoint.config.to_dict(),
            "tokenizer": tok_meta,
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
    return Checkpoint(config, weights, TokenizerSpec.from_dict(tok_meta), source)
