"""The model control requests the router has passed to its replicas (Triton's model repository
extension: `POST /v2/repository/models/{m}/load` and `/unload`, and gRPC's RepositoryModelLoad
and RepositoryModelUnload, sent on over HTTP), remembered to replay to a replica that joins.

Pure bookkeeping: for each model, the last load or unload that at least one replica applied,
with its body and headers, oldest first, so that replaying them in order leaves a new replica
as the others are. Each request recorded is numbered (`seq`); a replica that has been told
every request up to a number (`Replica.told`) is sent only those after it. The bodies held (a
load may carry its model's files) are bounded by `max_bytes`: a request that would pass it is
not remembered, and its model's older entry is dropped with it (a replica that joins keeps
that model as its own start-up left it).
"""

from __future__ import annotations

import urllib.parse
from dataclasses import dataclass, field, replace

_PREFIX = "/v2/repository/models/"
ACTIONS = ("load", "unload")


@dataclass(frozen=True, slots=True)
class Control:
    """A load or unload of one model."""

    model: str
    action: str  # load or unload

    @classmethod
    def parse(cls, method: str, path: str) -> Control | None:
        """The control request a `POST` to `path` is, or None for any other request."""
        if method != "POST" or not path.startswith(_PREFIX):
            return None
        parts = path[len(_PREFIX) :].split("/")
        if len(parts) == 2 and parts[0] and parts[1] in ACTIONS:
            return cls(parts[0], parts[1])
        return None

    @property
    def path(self) -> str:
        """As sent to a replica: the model's name percent-encoded, as one segment."""
        return f"{_PREFIX}{urllib.parse.quote(self.model, safe='')}/{self.action}"


@dataclass(frozen=True, slots=True)
class Entry:
    """One control request as a replica that joins is sent it again."""

    control: Control
    headers: tuple[tuple[bytes, bytes], ...]  # the client's (its API key), without a deadline
    body: bytes
    seq: int = 0  # its number, given by `ControlLog.record`

    @property
    def size(self) -> int:
        return len(self.body) + sum(len(k) + len(v) for k, v in self.headers)


@dataclass(slots=True)
class ControlLog:
    max_bytes: int
    entries: dict[str, Entry] = field(default_factory=dict)  # by model, oldest first
    size: int = 0  # bytes held: bodies and headers
    seq: int = 0  # the number of the last request recorded (0: none yet)

    def record(self, entry: Entry) -> bool:
        """Remember `entry` as its model's last control request, after every other, under
        the next number; False when it would pass `max_bytes` (then its model has no entry
        at all)."""
        self.seq += 1
        self.forget(entry.control.model)
        if self.size + entry.size > self.max_bytes:
            return False
        self.entries[entry.control.model] = replace(entry, seq=self.seq)
        self.size += entry.size
        return True

    def forget(self, model: str) -> None:
        old = self.entries.pop(model, None)
        if old is not None:
            self.size -= old.size

    def restore(self, entry: Entry) -> bool:
        """Keep `entry` under its own number, as a router before this one recorded it (each
        model's once, oldest first, after `seq` is set); False when it would pass `max_bytes`
        (then it is not kept)."""
        if self.size + entry.size > self.max_bytes:
            return False
        self.entries[entry.control.model] = entry
        self.size += entry.size
        return True

    def since(self, told: int) -> list[Entry]:
        """What a replica told every request up to number `told` is sent, in order (0: all)."""
        return [entry for entry in self.entries.values() if entry.seq > told]
