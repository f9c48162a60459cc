"""A tiny language model for the tests of what a tokenizer adds to a prompt: a GGUF with
SmolLM2's tokenizer, but one that adds its BOS token to a text prompt, and a chat template that
renders vLLM's `documents` (SmolLM2's adds none and ignores them); random weights of a tiny
Llama. What add_special_tokens and documents change shows in its prompts' token counts."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

BOS_MODEL = "tiny-bos"  # its served name
# SmolLM2's template, after a system message of the request's documents when it has some
DOCUMENTS_TEMPLATE = (
    "{% if documents %}{{ '<|im_start|>system\\nDocuments:\\n' }}{% for d in documents %}"
    "{{ d['title'] + ': ' + d['text'] + '\\n' }}{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
)


def write_bos_model(smollm2: Path, path: Path) -> None:
    """A GGUF with SmolLM2's tokenizer, but one that adds its BOS token to a text prompt, and
    SmolLM2's chat template after `DOCUMENTS_TEMPLATE`; random weights of a tiny Llama (what it
    says does not matter, only what its prompts are made of)."""
    meta = {k: f.contents() for k, f in gguf.GGUFReader(smollm2).fields.items()}
    vocab, hidden, layers = len(meta["tokenizer.ggml.tokens"]), 32, 1
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    writer.add_token_list(meta["tokenizer.ggml.tokens"])
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_add_bos_token(True)  # SmolLM2's adds none
    writer.add_chat_template(DOCUMENTS_TEMPLATE + meta["tokenizer.chat_template"])
    rng = np.random.default_rng(0)
    shapes = {"token_embd": (vocab, hidden), "output_norm": (hidden,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm": (hidden,),
            f"blk.{i}.ffn_norm": (hidden,),
            f"blk.{i}.attn_q": (hidden, hidden),
            f"blk.{i}.attn_k": (hidden // 2, hidden),
            f"blk.{i}.attn_v": (hidden // 2, hidden),
            f"blk.{i}.attn_output": (hidden, hidden),
            f"blk.{i}.ffn_gate": (64, hidden),
            f"blk.{i}.ffn_up": (64, hidden),
            f"blk.{i}.ffn_down": (hidden, 64),
        }
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", rng.standard_normal(shape).astype(np.float32) * 0.1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_bos_model_folder(smollm2: Path, folder: Path) -> Path:
    """A model folder of the tiny model, written from SmolLM2's GGUF at `smollm2`; the path of
    its GGUF."""
    gguf_path = folder / "1" / "model.gguf"
    gguf_path.parent.mkdir(parents=True)
    write_bos_model(smollm2, gguf_path)
    parameters = {
        "model_file": "model.gguf",
        "served_model_name": BOS_MODEL,
        "dtype": "float32",
        "kv_cache_gib": "0.01",
        "max_model_len": "256",
    }
    lines = [f"  {k}: '{v}'" for k, v in parameters.items()]
    (folder / "config.yaml").write_text("backend: llm\nparameters:\n" + "\n".join(lines))
    return gguf_path
