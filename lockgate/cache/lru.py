"""Tier 1: an in-process LRU bounded in bytes, with an optional time to live."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from lockgate.datatypes import Arrays


@dataclass(slots=True)
class Entry:
    outputs: Arrays
    nbytes: int
    expires: float | None  # time.monotonic(); None: never

    def fresh(self, now: float) -> bool:
        return self.expires is None or now < self.expires


class LRUTier:
    """Least recently used entries leave first once `max_bytes` is passed. An expired entry is
    kept until evicted, so a fallback may still answer from it (`stale=True`)."""

    def __init__(self, max_bytes: int, generation: str = "") -> None:
        self.max_bytes = max_bytes
        self.generation = generation  # the model version's fingerprint its entries came from
        self.bytes = 0
        self._entries: OrderedDict[str, Entry] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str, now: float, *, stale: bool = False) -> Arrays | None:
        entry = self._entries.get(key)
        if entry is None or not (stale or entry.fresh(now)):
            return None
        self._entries.move_to_end(key)
        return entry.outputs

    def put(self, key: str, outputs: Arrays, nbytes: int, expires: float | None) -> bool:
        """Keep `outputs`; False when it is larger than the whole tier."""
        if nbytes > self.max_bytes:
            return False
        self.discard(key)
        self._entries[key] = Entry(outputs, nbytes, expires)
        self.bytes += nbytes
        while self.bytes > self.max_bytes:
            _, oldest = self._entries.popitem(last=False)
            self.bytes -= oldest.nbytes
        return True

    def discard(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
