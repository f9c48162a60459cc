"""Ray Serve serving one benchmark model (PEER_MODEL) on PEER_PORT at POST /, one replica,
with @serve.batch (max batch, max wait) batching.

    digits: {"input": [64 floats]} -> {"label": int, "probabilities": [10 floats]}
    minilm: {"text": "..."}        -> {"embedding": [384 floats]}
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import ray
from peer_models import Digits, MiniLM, batch_settings
from ray import serve
from starlette.requests import Request

MODEL = os.environ["PEER_MODEL"]
MAX_BATCH, MAX_DELAY_S = batch_settings(MODEL)


@serve.deployment(num_replicas=1, max_ongoing_requests=1024)
class DigitsDeployment:
    def __init__(self) -> None:
        self.model = Digits()

    @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=MAX_DELAY_S)
    async def infer(self, rows: list[list[float]]) -> list[dict[str, Any]]:
        label, probabilities = self.model(np.asarray(rows, dtype=np.float32))  # [B, 64]
        return [
            {"label": int(a), "probabilities": b.tolist()}
            for a, b in zip(label, probabilities, strict=True)
        ]

    async def __call__(self, request: Request) -> dict[str, Any]:
        return await self.infer((await request.json())["input"])


@serve.deployment(num_replicas=1, max_ongoing_requests=1024)
class MiniLMDeployment:
    def __init__(self) -> None:
        self.model = MiniLM()

    @serve.batch(max_batch_size=MAX_BATCH, batch_wait_timeout_s=MAX_DELAY_S)
    async def infer(self, texts: list[str]) -> list[dict[str, Any]]:
        return [{"embedding": row} for row in self.model(texts).tolist()]  # [B, 384]

    async def __call__(self, request: Request) -> dict[str, Any]:
        return await self.infer(str((await request.json())["text"]))


def main() -> None:
    env = {k: v for k, v in os.environ.items() if k.startswith("PEER_") or k == "PYTHONPATH"}
    ray.init(num_cpus=1, include_dashboard=False, runtime_env={"env_vars": env})
    serve.start(http_options={"host": "127.0.0.1", "port": int(os.environ["PEER_PORT"])})
    kind = DigitsDeployment if MODEL == "digits" else MiniLMDeployment
    serve.run(kind.bind(), route_prefix="/")
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
