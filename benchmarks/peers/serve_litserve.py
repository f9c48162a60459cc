"""LitServe serving one benchmark model (PEER_MODEL) on PEER_PORT at POST /predict.

digits: {"input": [64 floats]} -> {"label": int, "probabilities": [10 floats]}
minilm: {"text": "..."}        -> {"embedding": [384 floats]}
"""

import os
from typing import Any

import litserve as ls
import numpy as np
from peer_models import Digits, MiniLM, batch_settings

MODEL = os.environ["PEER_MODEL"]
MAX_BATCH, MAX_DELAY_S = batch_settings(MODEL)


class DigitsAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.model = Digits()

    def decode_request(self, request: dict[str, Any]) -> list[float]:
        return request["input"]

    def batch(self, inputs: list[list[float]]) -> np.ndarray:
        return np.asarray(inputs, dtype=np.float32)  # [B, 64]

    def predict(self, rows: np.ndarray) -> list[dict[str, Any]]:
        label, probabilities = self.model(rows)
        return [
            {"label": int(a), "probabilities": b.tolist()}
            for a, b in zip(label, probabilities, strict=True)
        ]

    def unbatch(self, output: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return output

    def encode_response(self, output: dict[str, Any]) -> dict[str, Any]:
        return output


class MiniLMAPI(ls.LitAPI):
    def setup(self, device: str) -> None:
        self.model = MiniLM()

    def decode_request(self, request: dict[str, Any]) -> str:
        return str(request["text"])

    def batch(self, inputs: list[str]) -> list[str]:
        return list(inputs)

    def predict(self, texts: list[str]) -> list[list[float]]:
        return self.model(texts).tolist()  # [B, 384]

    def unbatch(self, output: list[list[float]]) -> list[list[float]]:
        return output

    def encode_response(self, output: list[float]) -> dict[str, Any]:
        return {"embedding": output}


def main() -> None:
    kind = DigitsAPI if MODEL == "digits" else MiniLMAPI
    try:  # litserve >= 0.2.11 takes batching on the API
        api = kind(max_batch_size=MAX_BATCH, batch_timeout=MAX_DELAY_S)
        server = ls.LitServer(api, accelerator="cpu", workers_per_device=1)
    except TypeError:
        server = ls.LitServer(
            kind(), accelerator="cpu", workers_per_device=1,
            max_batch_size=MAX_BATCH, batch_timeout=MAX_DELAY_S,
        )  # fmt: skip
    server.run(port=int(os.environ["PEER_PORT"]), host="127.0.0.1", generate_client_file=False)


if __name__ == "__main__":
    main()
