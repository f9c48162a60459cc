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
from lockgate.errors import BadRequest

TOKEN_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
MAX_POSITIONS = 512  # the encoder's position embeddings (BERT's)


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
    """Token ids that the encoder cannot take (outside its vocabulary, a sequence longer than
    its positions or empty, masks and types other than 0 and 1) are refused with 400, before
    the session runs: onnxruntime would raise, a 500."""

    def __init__(self) -> None:
        self.session: ort.InferenceSession | None = None
        self.feeds: list[str] = []
        self.vocab_size = 0

    def load(self, config: Any, version_dir: Path) -> None:
        parameters: dict[str, str] = dict(config.parameters)
        tokenizer = Tokenizer.from_file(
            str(data_file(parameters, "tokenizer", "model/tokenizer.json"))
        )
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(parameters.get("intra_op_threads", "1"))
        options.inter_op_num_threads = 1
        onnx_path = data_file(parameters, "onnx", "model.onnx")
        self.session = ort.InferenceSession(str(onnx_path), sess_options=options)
        self.feeds = [node.name for node in self.session.get_inputs()]

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.session is None:
            raise RuntimeError("the model is not loaded")
        self.check(inputs)
        (hidden,) = self.session.run(["last_hidden_state"], {n: inputs[n] for n in self.feeds})
        return {"embedding": mean_pool(hidden, inputs["attention_mask"])}

    def check(self, inputs: dict[str, np.ndarray]) -> None:
        ids = inputs["input_ids"]
        if any(inputs[name].shape != ids.shape for name in TOKEN_INPUTS):
            raise BadRequest("input_ids, attention_mask and token_type_ids must have one shape")
        if not 0 < ids.shape[-1] <= MAX_POSITIONS:
            raise BadRequest(f"a sequence holds 1 to {MAX_POSITIONS} tokens, not {ids.shape[-1]}")
        if ids.min() < 0 or ids.max() >= self.vocab_size:
            raise BadRequest(f"input_ids must be token ids in 0..{self.vocab_size - 1}")
        for name in ("attention_mask", "token_type_ids"):
            values = inputs[name]
            if values.min() < 0 or values.max() > 1:
                raise BadRequest(f"{name} must hold 0 and 1 only")
