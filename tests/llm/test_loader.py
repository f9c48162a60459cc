from __future__ import annotations

import json
import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from lockgate.errors import ConfigError
from lockgate.llm.attention import AttentionMetadata
from lockgate.llm.loader import Checkpoint, default_cache_dir, load_checkpoint, load_gguf
from lockgate.llm.models import allocate_kv_cache, build_llama
from lockgate.llm.tokenizer import ChatTokenizer

HEADS, KV_HEADS, HIDDEN, FFN, LAYERS = 4, 2, 32, 64, 2
TOKENS = ["<|end|>", "a", "b", "c", "ab", "Ġ", "Ġab", *(chr(ord("d") + i) for i in range(9))]


def permute_like_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Q and K rows (half-split -> interleaved)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def tiny_weights(tied: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {
        "model.embed_tokens.weight": (len(TOKENS), HIDDEN),
        "model.norm.weight": (HIDDEN,),
    }
    if not tied:
        shapes["lm_head.weight"] = (len(TOKENS), HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            f"{p}input_layernorm.weight": (HIDDEN,),
            f"{p}post_attention_layernorm.weight": (HIDDEN,),
            f"{p}self_attn.q_proj.weight": (HEADS * head_dim, HIDDEN),
            f"{p}self_attn.k_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"{p}self_attn.v_proj.weight": (KV_HEADS * head_dim, HIDDEN),
            f"{p}self_attn.o_proj.weight": (HIDDEN, HEADS * head_dim),
            f"{p}mlp.gate_proj.weight": (FFN, HIDDEN),
            f"{p}mlp.up_proj.weight": (FFN, HIDDEN),
            f"{p}mlp.down_proj.weight": (HIDDEN, FFN),
        }
    return {k: rng.standard_normal(s).astype(np.float32) * 0.2 for k, s in shapes.items()}


GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem = hf.removesuffix(".weight")
    if stem in top:
        return f"{top[stem]}.weight"
    _, _, index, rest = stem.split(".", 3)
    return f"blk.{index}.{GGUF_NAMES[rest]}.weight"


def write_tiny_gguf(path: Path, weights: dict[str, np.ndarray], arch: str = "llama") -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(50000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3] + [1] * (len(TOKENS) - 1))
    writer.add_token_merges(["a b", "Ġ ab"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    for name, w in weights.items():
        if ".q_proj." in name:
            w = permute_like_llama_cpp(w, HEADS)
        elif ".k_proj." in name:
            w = permute_like_llama_cpp(w, KV_HEADS)
        if "mlp.down_proj" in name:  # one quantized tensor exercises dequantization
            q = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture()
def tiny_gguf(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    weights = tiny_weights(tied=True)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, weights)
    return path, weights


def test_gguf_config_and_unpermuted_weights(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    path, expected = tiny_gguf
    ck = load_gguf(path, cache_dir=tmp_path / "cache")
    c = ck.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (LAYERS, HIDDEN, FFN)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (HEADS, KV_HEADS, 8)
    assert (c.rope_theta, c.max_position_embeddings, c.vocab_size) == (50000.0, 256, len(TOKENS))
    assert c.tie_word_embeddings and "lm_head.weight" not in ck.weights
    assert c.rms_norm_eps == pytest.approx(1e-6)
    assert set(ck.weights) == set(expected)
    for name, w in expected.items():
        tol = 0.01 if "down_proj" in name else 0.0  # Q8_0 is lossy
        np.testing.assert_allclose(ck.weights[name].numpy(), w, atol=tol, err_msg=name)


def test_gguf_tokenizer_from_metadata(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    ck = load_gguf(tiny_gguf[0], cache_dir=tmp_path)
    tok = ChatTokenizer(ck.tokenizer)
    assert tok.encode("ab ab") == [4, 6]
    assert tok.encode("<|end|>a") == [0, 1]
    assert tok.decode([4, 6, 0]) == "ab ab"
    assert tok.eos_token_ids == {0}
    assert tok.apply_chat_template([{"role": "user", "content": "ab"}]) == "ab<|end|>"


def test_conversion_cache_roundtrip(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path, _ = tiny_gguf
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="lockgate.llm"):
        cold = load_gguf(path, cache_dir=cache)
        warm = load_gguf(path, cache_dir=cache)
    assert "parsed and dequantized" in caplog.records[0].getMessage()
    assert "from cache" in caplog.records[1].getMessage()
    entries = [e for e in cache.iterdir() if e.name.startswith("gguf-")]
    assert len(entries) == 1 and not entries[0].name.count(".tmp-")
    assert warm.config == cold.config
    assert warm.tokenizer == cold.tokenizer
    for name, tensor in cold.weights.items():
        assert torch.equal(warm.weights[name], tensor)


def test_corrupt_cache_is_rebuilt(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    path, _ = tiny_gguf
    cache = tmp_path / "cache"
    cold = load_gguf(path, cache_dir=cache)
    (entry,) = (e for e in cache.iterdir() if e.name.startswith("gguf-"))
    (entry / "lockgate.json").write_text("{not json", encoding="utf-8")
    again = load_gguf(path, cache_dir=cache)
    assert again.config == cold.config
    assert json.loads((entry / "lockgate.json").read_text(encoding="utf-8"))["format"] >= 1


def test_cache_key_covers_the_whole_file(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    """A byte changed in the middle of the file (outside its first and last MiB, were it that
    big) gives another key: a file edited in place never loads stale weights."""
    from lockgate.llm.loader import _cache_key

    path, _ = tiny_gguf
    copy = tmp_path / "copy.gguf"
    data = bytearray(path.read_bytes())
    copy.write_bytes(bytes(data))
    assert _cache_key(copy, tmp_path) == _cache_key(path, tmp_path)  # content, not location
    data[len(data) // 2] ^= 0xFF
    edited = tmp_path / "edited.gguf"
    edited.write_bytes(bytes(data))
    assert _cache_key(edited, tmp_path) != _cache_key(path, tmp_path)


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LOCKGATE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    monkeypatch.delenv("LOCKGATE_CACHE_DIR")
    assert default_cache_dir() == Path.home() / ".cache" / "lockgate" / "llm"


def test_hf_folder_gives_the_same_model_as_gguf(
    tiny_gguf: tuple[Path, dict[str, np.ndarray]], tmp_path: Path
) -> None:
    from safetensors.torch import save_file

    path, _ = tiny_gguf
    from_gguf = load_gguf(path, cache_dir=tmp_path / "cache")
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(from_gguf.weights, str(folder / "model.safetensors"))
    (folder / "tokenizer.json").write_text(from_gguf.tokenizer.tokenizer_json, encoding="utf-8")
    config = {
        "model_type": "llama",
        "vocab_size": len(TOKENS),
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6,
        "rope_theta": 50000.0,
        "tie_word_embeddings": True,
    }
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    from_hf = load_checkpoint(folder)
    assert from_hf.config.head_dim == from_gguf.config.head_dim
    assert from_hf.config.rope_theta == from_gguf.config.rope_theta
    torch.testing.assert_close(run_tiny(from_hf), run_tiny(from_gguf))


def run_tiny(ck: Checkpoint) -> torch.Tensor:
    model = build_llama(ck.config, ck.weights, "float32")
    cache = allocate_kv_cache(ck.config, 2, 8, "float32")
    n = 5
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]),
        block_tables=torch.tensor([[0]]),
        logits_indices=torch.tensor([n - 1]),
        max_query_len=n,
        max_seq_len=n,
        block_size=8,
        query_lens_list=[n],
        seq_lens_list=[n],
    )
    return model.compute_logits(model(torch.tensor([1, 2, 3, 4, 5]), torch.arange(n), meta, cache))


def test_untied_gguf_has_lm_head(tmp_path: Path) -> None:
    path = tmp_path / "untied.gguf"
    write_tiny_gguf(path, tiny_weights(tied=False))
    ck = load_gguf(path, use_cache=False)
    assert not ck.config.tie_word_embeddings
    assert build_llama(ck.config, ck.weights).lm_head is not None


def test_wrong_architecture_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    write_tiny_gguf(path, tiny_weights(tied=True), arch="gpt2")
    with pytest.raises(ConfigError, match=r"general\.architecture"):
        load_gguf(path, use_cache=False)


def test_bad_paths_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="model_path"):
        load_checkpoint(tmp_path / "missing.bin")
    with pytest.raises(ConfigError, match=r"config\.json"):
        load_checkpoint(tmp_path)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ConfigError, match="GGUF"):
        load_checkpoint(junk, cache_dir=tmp_path / "cache")


def test_smollm2_config(checkpoint: Checkpoint) -> None:
    c = checkpoint.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (30, 576, 9)
    assert (c.num_key_value_heads, c.head_dim, c.intermediate_size) == (3, 64, 1536)
    assert c.tie_word_embeddings and c.vocab_size == 49152
    assert c.rope_theta == 100000.0
    q = checkpoint.weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (576, 576) and q.dtype == torch.float32
