"""Where one request goes, as the router decided before sending it: the path (a version canary
rewrites it, or for an OpenAI request names the version in `x-lockgate-model-version`), the
replica group, and what balancing reads (a sequence, a stored response's replica, a sticky
session, a prompt prefix)."""

from __future__ import annotations

from dataclasses import dataclass

from lockgate.router.groups import MAIN
from lockgate.router.llm_request import LLMRequest
from lockgate.router.model_path import ModelPath
from lockgate.router.replica import Replica
from lockgate.router.response_homes import ResponseRequest
from lockgate.router.sequence_affinity import SequenceRequest


@dataclass(slots=True)
class Route:
    path: str  # sent to the replica, query string included
    original: str  # the client's path, query string included
    target: ModelPath | None = None  # a KServe v2 inference request
    llm: LLMRequest | None = None  # an OpenAI completion or embeddings request
    version: str | None = None  # the version it is sent to (None: the replica's newest)
    pin: str | None = None  # an OpenAI request's version canary: sent in a header
    group: str = MAIN  # the replicas that may take it
    session: bytes | None = None  # its sticky session key
    sequence: SequenceRequest | None = None  # a stateful model's sequence it belongs to
    responses: ResponseRequest | None = None  # a request of the OpenAI Responses API
    home: Replica | None = None  # the replica that stored the response it needs

    @property
    def generates(self) -> bool:
        """A completion, chat or Responses API request: a generation, never run twice."""
        if self.responses is not None:
            return self.responses.creates
        return self.llm is not None and self.llm.generates

    @property
    def model(self) -> str | None:
        if self.target is not None:
            return self.target.model
        if self.llm is not None and self.llm.model:
            return self.llm.model
        return None
