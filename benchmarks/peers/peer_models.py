"""The two benchmark models, for peer servers: no lockgate import, only numpy + onnxruntime +
tokenizers, so the file runs in each peer's own venv.

    Digits   input  FP32 [B, 64]  -> label INT64 [B], probabilities FP32 [B, 10]
    MiniLM   texts  list[str] (B) -> embedding FP32 [B, 384] (unit vectors)

MiniLM follows lockgate/demo/minilm_model.py step for step: tokenizer.json with truncation
to 256 tokens and padding to the longest in the batch, the int8 ONNX encoder at one
intra-op thread, mean pooling over the attention mask, then L2 normalization.
File locations come from the environment (set by run.sh):
    PEER_DIGITS_ONNX, PEER_MINILM_ONNX, PEER_MINILM_TOKENIZER
"""

from __future__ import annotations

import os

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

MAX_TOKENS = 256


def _session(path: str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])


class Digits:
    """skl2onnx LogisticRegression: input 'input', outputs 'label' and 'probabilities'."""

    def __init__(self, path: str | None = None) -> None:
        self.session = _session(path or os.environ["PEER_DIGITS_ONNX"])
        self.outputs = [o.name for o in self.session.get_outputs()]

    def __call__(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """rows: [B, 64] -> (label [B] int64, probabilities [B, 10] float32)."""
        feed = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1, 64)
        label, probabilities = self.session.run(self.outputs, {"input": feed})
        return np.asarray(label, dtype=np.int64), np.asarray(probabilities, dtype=np.float32)


class MiniLM:
    def __init__(self, onnx_path: str | None = None, tokenizer_path: str | None = None) -> None:
        tokenizer = Tokenizer.from_file(tokenizer_path or os.environ["PEER_MINILM_TOKENIZER"])
        tokenizer.enable_truncation(MAX_TOKENS)
        tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        self.tokenizer = tokenizer
        self.session = _session(onnx_path or os.environ["PEER_MINILM_ONNX"])
        self.feeds = [node.name for node in self.session.get_inputs()]

    def __call__(self, texts: list[str]) -> np.ndarray:
        """texts (B) -> embedding [B, 384] float32."""
        encodings = self.tokenizer.encode_batch(texts)
        tokens = {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),  # [B, T]
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }
        (hidden,) = self.session.run(["last_hidden_state"], {n: tokens[n] for n in self.feeds})
        return mean_pool(hidden, tokens["attention_mask"])


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """hidden: [B, T, D], mask: [B, T] -> unit vectors [B, D] (float32)."""
    weights = mask[..., None].astype(np.float32)  # [B, T, 1]
    summed = (hidden * weights).sum(axis=1)  # [B, D]
    mean = summed / np.maximum(weights.sum(axis=1), 1e-9)
    norms = np.linalg.norm(mean, axis=1, keepdims=True)
    return (mean / np.maximum(norms, 1e-12)).astype(np.float32)


def as_text(item: object) -> str:
    return item.decode("utf-8") if isinstance(item, bytes) else str(item)


def batch_settings(model: str) -> tuple[int, float]:
    """(max batch size, max delay in seconds) shared by every server, from the environment:
    PEER_<MODEL>_MAX_BATCH and PEER_MAX_DELAY_MS."""
    size = int(os.environ.get(f"PEER_{model.upper()}_MAX_BATCH", "16"))
    return size, float(os.environ.get("PEER_MAX_DELAY_MS", "2")) / 1e3
