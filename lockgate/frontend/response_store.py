"""The responses kept for `GET /v1/responses/{id}` (and its `input_items`) and
`previous_response_id`: an LRU of at most `capacity` of them, in this process's memory (the
least recently stored or read goes first). Pure bookkeeping: no I/O.

Each entry is bounded by the model's context: a response's conversation (its input, that of
the responses before it, and its output) fitted in the context it was answered in. It is kept
twice: as the chat messages that continue it, and as the input items the API lists.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from lockgate.protocol import openai as oa


@dataclass(frozen=True, slots=True)
class StoredResponse:
    response: dict[str, Any]  # as it was answered
    # the messages of its conversation after the instructions (those are not carried over):
    # the input of the responses before it and its own, and the outputs, as chat messages
    conversation: tuple[oa.ChatMessage, ...]
    # the same before its output, as the API lists them (`input_items`): the items of the
    # responses before it (input and output, each with its id), then its own input
    input_items: tuple[dict[str, Any], ...]


@dataclass(slots=True)
class ResponseStore:
    capacity: int  # responses kept; 0: none
    entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if isinstance(self.capacity, bool) or self.capacity < 0:
            raise ValueError(
                f"--responses-store-size must be 0 (off) or more, got {self.capacity!r}"
            )

    def get(self, rid: str) -> StoredResponse | None:
        stored = self.entries.get(rid)
        if stored is not None:
            self.entries.move_to_end(rid)
        return stored

    def put(self, rid: str, stored: StoredResponse) -> bool:
        """Keep a response (the least recently used goes past `capacity`); False: the store
        is off."""
        if not self.capacity:
            return False
        self.entries[rid] = stored
        self.entries.move_to_end(rid)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return True

    def delete(self, rid: str) -> bool:
        return self.entries.pop(rid, None) is not None

    def __len__(self) -> int:
        return len(self.entries)
