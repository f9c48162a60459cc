"""Which models' KServe v2 inference the router may send twice (a hedge's second copy, or a
retry after the request was sent): those it has seen answer 200 as classic models.

A lockgate replica marks every answer of a language model's v2 inference (REST and gRPC
ModelInfer, served by `frontend/llm_infer.py`) with `x-lockgate-model-kind: language`, a
header over HTTP and trailing metadata over gRPC. A generation is expensive and not what
hedging is for (only idempotent inference is), so such a model is sent once: never hedged,
and not retried once the request was sent (a 503, the replica's refusal before any work, is
still tried elsewhere). A model not yet seen to answer may be a language model: it is sent
once too, until its first answer tells. Replicas that are not lockgate mark nothing, so the
models named by `lockgate route --send-once` are language models from the start, whatever
their answers say. Pure bookkeeping: the router reads the answers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_MODELS = 4096  # model names remembered as classic (beyond them: sent once, as unknown)


@dataclass(slots=True)
class ModelKinds:
    classic: set[str] = field(default_factory=set)  # seen to answer 200 unmarked
    language: set[str] = field(default_factory=set)  # marked, or named: never sent twice

    @classmethod
    def naming(cls, send_once: tuple[str, ...]) -> ModelKinds:
        """Kinds with the models of `send_once` taken as language models from the start."""
        return cls(language=set(send_once))

    def repeatable(self, model: str) -> bool:
        """Whether a request of `model` may be sent twice."""
        return model in self.classic

    def learn(self, model: str, status: int, language: bool) -> None:
        """An answer of `model`: `language` when it carries the mark. Once marked, a model
        stays a language model."""
        if language:
            self.language.add(model)
            self.classic.discard(model)
        elif (
            status == 200
            and model not in self.classic
            and model not in self.language
            and len(self.classic) < MAX_MODELS
        ):
            self.classic.add(model)
