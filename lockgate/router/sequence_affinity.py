"""Sequence affinity: every request of a stateful model's sequence (Triton's `sequence_id`,
`sequence_start` and `sequence_end` parameters) goes to one replica, the one that holds the
sequence's state.

A request that starts a sequence goes to the replica its id prefers by rendezvous hashing over
the usable replicas of its group (full ones included: a sequence is never moved for load), so
several routers send a new sequence to the same replica. The router then pins the sequence to
that replica until a request ends it, in a table of at most `--sequence-table-size` sequences
(the least recently used goes first): a replica that joins later takes no live sequence. A
later request of a sequence the table does not hold (started through another router, or
forgotten) goes where rendezvous hashing says. When the pinned replica is not usable (ejected,
or gone from discovery), the request is refused (503) with a message that names the
replica: the state lives there and is never started again elsewhere unasked. A sequence
request is neither hedged nor retried on another replica.

The parameters are read off the request cheaply: a body with no `"sequence_id"` in its JSON
part (the JSON header of a binary request) is not decoded at all; one with it has its
`parameters` object decoded and nothing else built (`of_json`). A gRPC request's parameters are
found by `grpc_model.sequence_of`. An id that is 0, empty or not an integer nor a string gives
no affinity: the replica answers 400.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from lockgate.router import rendezvous
from lockgate.router.replica import Replica

_MARK = b'"sequence_id"'
_HEADER_LENGTH = b"inference-header-content-length"


class _Body(msgspec.Struct):
    parameters: Any = None


_decode = msgspec.json.Decoder(_Body).decode


class SequenceGone(Exception):
    """The replica a sequence is pinned to is not usable: its request is refused (503)."""


@dataclass(frozen=True, slots=True)
class SequenceRequest:
    """What a request says of its sequence."""

    key: bytes  # the sequence id as text
    start: bool = False
    end: bool = False

    @classmethod
    def of_parameters(cls, parameters: Mapping[str, Any]) -> SequenceRequest | None:
        """From a request's parameters (the v2 JSON's, or gRPC's decoded); None when they
        name no usable sequence id."""
        sequence_id = parameters.get("sequence_id")
        if isinstance(sequence_id, bool) or not sequence_id:
            return None
        if isinstance(sequence_id, int):
            key = b"%d" % (sequence_id % 2**64)
        elif isinstance(sequence_id, str):
            key = sequence_id.encode()
        else:
            return None
        start = parameters.get("sequence_start") is True
        return cls(key, start, parameters.get("sequence_end") is True)

    @classmethod
    def of_json(cls, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> SequenceRequest | None:
        """From a KServe v2 REST body (JSON, or binary with its JSON header first)."""
        part = body
        for name, value in headers:
            if name == _HEADER_LENGTH:
                if value.isdigit():
                    part = body[: int(value)]
                break
        if _MARK not in part:
            return None  # most requests: no decoding
        try:
            parameters = _decode(part).parameters
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None  # the replica answers 400
        return cls.of_parameters(parameters) if isinstance(parameters, dict) else None


@dataclass(slots=True)
class SequenceTable:
    """The replica each sequence started through this router is pinned to (by URL)."""

    size: int = 65536
    pins: OrderedDict[bytes, str] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.size < 0:
            raise ValueError("--sequence-table-size must be 0 or more")

    def pick(self, request: SequenceRequest, usable: Sequence[Replica]) -> Replica | None:
        """The replica for a request of the sequence, of the `usable` replicas of its group;
        SequenceGone when its pinned replica is not among them."""
        url = None if request.start else self.pins.get(request.key)
        if url is not None:
            chosen = next((r for r in usable if r.url == url), None)
            if chosen is None:
                raise SequenceGone(
                    f"sequence {request.key.decode(errors='replace')[:80]} lives on replica "
                    f"{url}, which is not usable now: its state is not moved to another "
                    "replica (retry later, or start the sequence again)"
                )
        else:
            chosen = rendezvous.first(request.key, usable)
            if chosen is None:
                return None
        if request.end:
            self.pins.pop(request.key, None)
        elif self.size:
            self.pins[request.key] = chosen.url
            self.pins.move_to_end(request.key)
            if len(self.pins) > self.size:
                self.pins.popitem(last=False)
        return chosen

    def __len__(self) -> int:
        return len(self.pins)
