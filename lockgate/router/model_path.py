"""The model a KServe v2 inference request names in its path:
`POST /v2/models/{model}[/versions/{version}]/{infer|generate|generate_stream}`."""

from __future__ import annotations

from dataclasses import dataclass

VERBS = frozenset({"infer", "generate", "generate_stream"})
_PREFIX = "/v2/models/"


@dataclass(frozen=True, slots=True)
class ModelPath:
    model: str
    version: str | None  # None: the path names no version (the replica takes its newest)
    verb: str  # infer, generate or generate_stream

    @classmethod
    def parse(cls, method: str, path: str) -> ModelPath | None:
        if method != "POST" or not path.startswith(_PREFIX):
            return None
        parts = path[len(_PREFIX) :].split("/")
        if len(parts) == 2 and parts[0] and parts[1] in VERBS:
            return cls(parts[0], None, parts[1])
        if len(parts) == 4 and parts[0] and parts[1] == "versions" and parts[2]:
            return cls(parts[0], parts[2], parts[3]) if parts[3] in VERBS else None
        return None

    def at(self, version: str) -> str:
        """The same request's path at `version`."""
        return f"{_PREFIX}{self.model}/versions/{version}/{self.verb}"
