"""all-MiniLM-L6-v2 as two models, for the demo ensemble `minilm_ensemble`: `Tokenize` turns
text into token ids, `Encode` runs the int8 ONNX encoder and pools. The single-model `minilm`
does both in one; the ensemble shows the same result from two steps, each with its own
batcher.

    Tokenize: text BYTES [batch, 1] -> input_ids, attention_mask, token_type_ids INT64 [batch, T]
    Encode:   input_ids, attention_mask, token_type_ids -> embedding FP32 [batch, 384]

Settings (config `parameters`) as for `minilm_model.py`; `class_name` picks the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from tokenizers import Tokenizer

from lockgate.demo.minilm_model import _text, data_file, mean_pool

TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class Tokenize:
    def __init__(self) -> None:
        self.tokenizer: Tokenizer | None = None
        self.max_chars = 0

    def load(self, config: Any, version_dir: Path) -> None:
        parameters: dict[str, str] = dict(config.parameters)
        tokenizer = Tokenizer.from_file(
            str(data_file(parameters, "tokenizer", "model/tokenizer.json"))
        )
        max_tokens = int(parameters.get("max_tokens", "256"))
        tokenizer.enable_truncation(max_tokens)
        longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
        self.max_chars = max_tokens * longest
        tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
        self.tokenizer = tokenizer

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.tokenizer is None:
            raise RuntimeError("the model is not loaded")
        texts = [_text(item, self.max_chars) for item in inputs["text"].reshape(-1).tolist()]
        encodings = self.tokenizer.encode_batch(texts)
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),  # [B, T]
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }


class Encode:
    def __init__(self) -> None:
        self.session: ort.InferenceSession | None = None
        self.feeds: list[str] = []

    def load(self, config: Any, version_dir: Path) -> None:
        parameters: dict[str, str] = dict(config.parameters)
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(parameters.get("intra_op_threads", "1"))
        options.inter_op_num_threads = 1
        onnx_path = data_file(parameters, "onnx", "model.onnx")
        self.session = ort.InferenceSession(str(onnx_path), sess_options=options)
        self.feeds = [node.name for node in self.session.get_inputs()]

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.session is None:
            raise RuntimeError("the model is not loaded")
        (hidden,) = self.session.run(["last_hidden_state"], {n: inputs[n] for n in self.feeds})
        return {"embedding": mean_pool(hidden, inputs["attention_mask"])}
