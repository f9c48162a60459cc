"""BentoML service for one benchmark model (PEER_MODEL), `bentoml serve serve_bentoml:Service`,
one worker, adaptive batching. POST /predict:

    digits: {"rows": [[64 floats]]} -> [{"label": int, "probabilities": [10 floats]}]
    minilm: {"texts": ["..."]}      -> [{"embedding": [384 floats]}]
"""

from __future__ import annotations

import os
from typing import Any

import bentoml
import numpy as np
from peer_models import Digits, MiniLM, batch_settings

MODEL = os.environ.get("PEER_MODEL", "digits")
MAX_BATCH, _ = batch_settings(MODEL)
MAX_LATENCY_MS = 10_000  # a latency bound, not a delay: high, so that it never sheds load


@bentoml.service(workers=1, traffic={"timeout": 60, "max_concurrency": 4096})
class Service:
    def __init__(self) -> None:
        self.digits = Digits() if MODEL == "digits" else None
        self.minilm = MiniLM() if MODEL == "minilm" else None

    if MODEL == "digits":

        @bentoml.api(batchable=True, max_batch_size=MAX_BATCH, max_latency_ms=MAX_LATENCY_MS)
        def predict(self, rows: np.ndarray) -> list[dict[str, Any]]:
            assert self.digits is not None
            label, probabilities = self.digits(rows)  # [B, 64]
            return [{"label": int(a), "probabilities": b.tolist()}
                    for a, b in zip(label, probabilities, strict=True)]  # fmt: skip

    else:

        @bentoml.api(batchable=True, max_batch_size=MAX_BATCH, max_latency_ms=MAX_LATENCY_MS)
        def predict(self, texts: list[str]) -> list[dict[str, Any]]:
            assert self.minilm is not None
            return [{"embedding": row} for row in self.minilm(texts).tolist()]  # [B, 384]
