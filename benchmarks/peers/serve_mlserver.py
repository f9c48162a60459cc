"""MLServer custom runtime for the benchmark models (model-settings.json names it), served
in the MLServer process (parallel_workers 0) with MLServer's adaptive batching.
KServe v2: digits FP32 [B, 64] -> label INT64 [B], probabilities FP32 [B, 10];
minilm BYTES [B, 1] -> embedding FP32 [B, 384].
"""

from __future__ import annotations

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec, StringCodec
from mlserver.types import InferenceRequest, InferenceResponse
from peer_models import Digits, MiniLM


class PeerModel(MLModel):
    async def load(self) -> bool:
        kind = self.settings.parameters.extra["model"]  # type: ignore[union-attr,index]
        self.digits = Digits() if kind == "digits" else None
        self.minilm = MiniLM() if kind == "minilm" else None
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        request = payload.inputs[0]
        if self.digits is not None:
            rows = NumpyCodec.decode_input(request).astype(np.float32)  # [B, 64]
            label, probabilities = self.digits(rows)
            outputs = [
                NumpyCodec.encode_output("label", label),
                NumpyCodec.encode_output("probabilities", probabilities),
            ]
        else:
            assert self.minilm is not None
            texts = StringCodec.decode_input(request)  # B strings
            outputs = [NumpyCodec.encode_output("embedding", self.minilm(list(texts)))]
        return InferenceResponse(model_name=self.name, outputs=outputs)
