"""all-MiniLM-L6-v2 sentence embeddings, served by lockgate's python backend.

The demo builder copies this file to `<repo>/minilm/<version>/model.py`. It tokenizes text
inside the model (so clients send plain strings), runs the int8 ONNX encoder with
onnxruntime, mean-pools over the attention mask and L2-normalizes.

    input  text         BYTES [batch, 1]    UTF-8 sentences
    output embedding    FP32  [batch, 384]  unit vectors
           token_count  INT64 [batch, 1]    the tokens each was embedded from (after
                                            truncation, [CLS] and [SEP] included): the
                                            usage that /v1/embeddings reports

The weights are read where their packages installed them; nothing big is copied.
Settings (config `parameters`):
    onnx_package / onnx_path             where model.onnx is (package folder or file)
    tokenizer_package / tokenizer_path   where model/tokenizer.json is
    max_tokens                           truncation length (default 256)
    intra_op_threads                     onnxruntime threads (default 1)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from lockgate.demo.packages import package_folder
from lockgate.errors import BadRequest


def data_file(parameters: dict[str, str], kind: str, relative: str) -> Path:
    """`parameters[<kind>_path]`, else `relative` inside `parameters[<kind>_package]`."""
    explicit = parameters.get(f"{kind}_path")
    if explicit:
        return Path(explicit)
    return package_folder(parameters[f"{kind}_package"]) / relative


class Model:
    def __init__(self) -> None:
        self.session: ort.InferenceSession | None = None
        self.tokenizer: Tokenizer | None = None
        self.feeds: list[str] = []
        self.max_chars = 0

    def load(self, config: Any, version_dir: Path) -> None:
        parameters: dict[str, str] = dict(config.parameters)
        tokenizer = Tokenizer.from_file(
            str(data_file(parameters, "tokenizer", "model/tokenizer.json"))
        )
        max_tokens = int(parameters.get("max_tokens", "256"))
        tokenizer.enable_truncation(max_tokens)
        # text past what max_tokens tokens can cover is cut before tokenizing, not after
        longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
        self.max_chars = max_tokens * longest
        tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")  # pad each batch to its longest
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(parameters.get("intra_op_threads", "1"))
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        onnx_path = data_file(parameters, "onnx", "model.onnx")
        self.session = ort.InferenceSession(str(onnx_path), sess_options=options)
        self.feeds = [node.name for node in self.session.get_inputs()]
        self.tokenizer = tokenizer

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.session is None or self.tokenizer is None:
            raise RuntimeError("the model is not loaded")
        limit = self.max_chars
        texts = [_text(item, limit) for item in inputs["text"].reshape(-1).tolist()]  # [batch]
        encodings = self.tokenizer.encode_batch(texts)
        tokens = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),  # [B, T]
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }
        (hidden,) = self.session.run(["last_hidden_state"], {n: tokens[n] for n in self.feeds})
        mask = tokens["attention_mask"]
        return {
            "embedding": mean_pool(hidden, mask),
            "token_count": mask.sum(axis=1, keepdims=True, dtype=np.int64),  # [B, 1]
        }


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """hidden: [B, T, D], mask: [B, T] -> unit vectors [B, D] (float32)."""
    weights = mask[..., None].astype(np.float32)  # [B, T, 1]
    summed = (hidden * weights).sum(axis=1)  # [B, D]
    mean = summed / np.maximum(weights.sum(axis=1), 1e-9)
    norms = np.linalg.norm(mean, axis=1, keepdims=True)
    return (mean / np.maximum(norms, 1e-12)).astype(np.float32)


def _text(item: object, limit: int) -> str:
    """At most `limit` characters of an item's text (UTF-8 takes at most 4 bytes a character)."""
    if isinstance(item, bytes):
        return item[: 4 * limit].decode("utf-8", errors="replace")[:limit]  # bad bytes: U+FFFD
    if isinstance(item, str):
        return item[:limit]
    raise BadRequest(f"input 'text' holds {type(item).__name__}, not text")
