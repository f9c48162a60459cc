"""The live sequences of a stateful model (Triton's sequence batcher): which sequences are live,
when each was last used, the implicit state each carries to its next request, and the checks
of a request's correlation id. Pure bookkeeping: the caller gives the times, and the states are
held here, never computed (`core/sequence_batcher.py` builds the arrays and runs the requests).

A sequence starts with a request that carries `sequence_start` and ends with one that carries
`sequence_end`; in between, each request names it by its id. A sequence with no request for
`idle_s` seconds is freed, as one that ended: its next request must start it again.
"""

from __future__ import annotations

import asyncio
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from lockgate.datatypes import Arrays
from lockgate.errors import BadRequest, Unavailable

SequenceId = int | str  # a uint64 or a string, as Triton's correlation id; 0 or "": none


@dataclass(frozen=True, slots=True)
class SequenceFlags:
    """What a request says of its sequence: Triton's `sequence_id`, `sequence_start` and
    `sequence_end` parameters."""

    id: SequenceId = 0
    start: bool = False
    end: bool = False


@dataclass(slots=True, eq=False)
class Sequence:
    id: SequenceId
    used: float  # time.monotonic() when its last request arrived or was answered
    pending: int = 0  # requests admitted and not yet answered
    # the state inputs of its next request (one row each); None: the initial state
    states: Arrays | None = None
    # its requests run one at a time, in arrival order (asyncio.Lock wakes waiters in order)
    turn: asyncio.Lock = field(default_factory=asyncio.Lock)


class SequenceTable:
    """The live sequences of one model version, least recently used first, at most `limit`."""

    def __init__(self, model: str, limit: int, idle_s: float) -> None:
        self.model = model
        self.limit = limit
        self.idle_s = idle_s
        self.live: OrderedDict[SequenceId, Sequence] = OrderedDict()
        # ended sequences with requests still to answer: a new start of the id runs after them
        self.ending: dict[SequenceId, Sequence] = {}

    def admit(self, flags: SequenceFlags, now: float) -> Sequence:
        """The sequence a request joins, at the end of its queue. Raises BadRequest (400) for
        a missing id, or a request with no START flag for a sequence not live; Unavailable
        (503) when a new sequence would pass the limit."""
        if not flags.id:
            raise BadRequest(
                f"inference request to model '{self.model}' must specify a non-zero or "
                "non-empty correlation ID"
            )
        self.expire(now)
        sequence = self.live.get(flags.id)
        if sequence is None:
            if not flags.start:
                raise BadRequest(
                    f"inference request for sequence {flags.id} to model '{self.model}' must "
                    "specify the START flag on the first request of the sequence"
                )
            self.check_room(now)
            sequence = self.live[flags.id] = Sequence(flags.id, now)
            before = self.ending.get(flags.id)
            if before is not None:
                sequence.turn = before.turn
        sequence.pending += 1
        sequence.used = now
        self.live.move_to_end(flags.id)
        if flags.end:  # no request may follow but one that starts it again
            del self.live[flags.id]
            self.ending[flags.id] = sequence
        return sequence

    def check_room(self, now: float) -> None:
        if len(self.live) < self.limit:
            return
        idle = [s.used for s in self.live.values() if not s.pending]
        wait = min(idle) + self.idle_s - now if idle else self.idle_s
        raise Unavailable(
            f"model '{self.model}' has {len(self.live)} live sequences, its limit: end a "
            "sequence or retry later",
            retry_after=max(1, math.ceil(wait)),
        )

    def done(self, sequence: Sequence, now: float) -> None:
        """A request of `sequence` is answered (or failed, or cancelled)."""
        sequence.pending -= 1
        sequence.used = now
        if self.live.get(sequence.id) is sequence:
            self.live.move_to_end(sequence.id)
        elif not sequence.pending and self.ending.get(sequence.id) is sequence:
            del self.ending[sequence.id]

    def expire(self, now: float) -> list[SequenceId]:
        """Free the sequences idle past `idle_s` with no request waiting; their ids."""
        expired = []
        for sequence in self.live.values():
            if now - sequence.used <= self.idle_s:
                break  # the rest were used later
            if not sequence.pending:
                expired.append(sequence.id)
        for key in expired:
            del self.live[key]
        return expired

    def count(self, now: float) -> int:
        """The live sequences, once the idle ones are freed."""
        self.expire(now)
        return len(self.live)
