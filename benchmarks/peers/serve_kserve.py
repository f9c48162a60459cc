"""KServe's Python model server serving one benchmark model (PEER_MODEL) on PEER_PORT,
KServe v2 REST at /v2/models/{model}/infer, one worker. KServe's Python server has no
in-process adaptive batcher, so every request runs alone.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from kserve import InferOutput, InferRequest, InferResponse, Model, ModelServer
from peer_models import Digits, MiniLM, as_text

MODEL = os.environ["PEER_MODEL"]


class PeerModel(Model):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.digits = Digits() if name == "digits" else None
        self.minilm = MiniLM() if name == "minilm" else None
        self.ready = True

    async def predict(
        self, payload: InferRequest, headers: dict[str, str] | None = None, **_: Any
    ) -> InferResponse:
        array = payload.inputs[0].as_numpy()
        if self.digits is not None:
            label, probabilities = self.digits(array.astype(np.float32))  # [B, 64]
            outputs = [
                InferOutput("label", list(label.shape), "INT64", label),
                InferOutput("probabilities", list(probabilities.shape), "FP32", probabilities),
            ]
        else:
            assert self.minilm is not None
            embedding = self.minilm([as_text(t) for t in array.reshape(-1).tolist()])
            outputs = [InferOutput("embedding", list(embedding.shape), "FP32", embedding)]
        for output in outputs:
            output.set_data_from_numpy(output.data, binary_data=False)
        return InferResponse(payload.id or "", self.name, outputs)


if __name__ == "__main__":
    model = PeerModel(MODEL)
    ModelServer(http_port=int(os.environ["PEER_PORT"]), grpc_port=int(os.environ["PEER_PORT"]) + 1,
                workers=1, enable_grpc=False).start([model])  # fmt: skip
