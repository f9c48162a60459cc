"""Exact-match caching of deterministic language-model completions.

A completion is deterministic when it is greedy (temperature 0) and asks for no logprobs: the
same prompt tokens and sampling parameters give the same text. Such completions are kept in
the language model's response cache (in-process and Redis, as for classic models) under a
hash of the endpoint, the prompt's token ids and every sampling parameter. Only completions
that ended by themselves (a stop or the token limit) are kept, never a cancelled or
deadline-cut one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lockgate.cache.key import text_key
from lockgate.cache.response_cache import ResponseCache
from lockgate.config import ResponseCacheConfig
from lockgate.datatypes import Arrays

KEPT_REASONS = frozenset({"stop", "length"})


@dataclass(frozen=True, slots=True)
class Completion:
    text: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int

    def arrays(self) -> Arrays:
        text = np.empty(2, dtype=object)
        text[:] = [self.text.encode(), self.finish_reason.encode()]
        tokens = np.array([self.prompt_tokens, self.completion_tokens], dtype=np.int64)
        return {"text": text, "tokens": tokens}

    @classmethod
    def of(cls, arrays: Arrays) -> Completion:
        text, reason = (bytes(x).decode() for x in arrays["text"])
        prompt, completion = (int(x) for x in arrays["tokens"])
        return cls(text, reason, prompt, completion)


@dataclass(frozen=True, slots=True)
class CompletionKey:
    model: str
    version: int
    settings: ResponseCacheConfig
    digest: str


class CompletionCache:
    """The response cache seen by the OpenAI routes."""

    def __init__(self, cache: ResponseCache) -> None:
        self.cache = cache

    @staticmethod
    def key(
        model: str,
        version: int,
        settings: ResponseCacheConfig,
        endpoint: str,
        prompt_ids: list[int],
        params: str,
    ) -> CompletionKey:
        """`params`: a canonical text of every sampling parameter (the dataclass's repr)."""
        data = np.asarray(prompt_ids, dtype="<i8").tobytes()
        digest = text_key(model, str(version), endpoint.encode() + b"\0" + params.encode() + data)
        return CompletionKey(model, version, settings, digest)

    async def get(self, key: CompletionKey) -> Completion | None:
        hit = await self.cache.get(key.model, key.version, key.settings, key.digest)
        if hit is None:
            return None
        try:
            return Completion.of(hit.outputs)
        except (KeyError, ValueError, UnicodeDecodeError):  # not a completion: a foreign entry
            return None

    def put(self, key: CompletionKey, completion: Completion) -> None:
        if completion.finish_reason in KEPT_REASONS:
            self.cache.put(key.model, key.version, key.settings, key.digest, completion.arrays())
