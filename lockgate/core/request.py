"""A request as the core sees it: named arrays plus deadline, priority and cancellation."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from lockgate.core.sequences import SequenceFlags
from lockgate.datatypes import Arrays

_ids = itertools.count(1)


@dataclass(slots=True, eq=False)
class InferRequest:
    """One client request to a classic model.

    `inputs` hold numpy arrays; BYTES tensors are object arrays of `bytes`. When the model
    batches, every input has the batch dimension first and `rows` is its length. It is the
    `BatchedRequest` a backend that takes each request on its own reads (`backends/base.py`).
    """

    model: str
    inputs: Arrays
    version: int | None = None
    outputs: tuple[str, ...] | None = None  # None: all outputs
    deadline: float | None = None  # time.monotonic() seconds
    # The deadline came from the model's latency SLO, not from the client: it bounds the time
    # in the queue, but a request the model alone cannot finish in time is still served.
    soft_deadline: bool = False
    priority: int = 0  # 0: the model's default; 1 is the highest
    id: str = ""
    parameters: Mapping[str, object] = field(default_factory=dict)  # as the client sent them
    arrival: float = field(default_factory=time.monotonic)
    rows: int = 1
    future: asyncio.Future[Arrays] | None = None
    admitted: float = 0.0  # when admission let it in
    predicted: float = 0.0  # seconds from admission to answer admission predicted; 0: none
    margin: float = 0.0  # the calibration margin included in `predicted`
    planned_rows: int = 0  # rows admission planned in the batch it rides
    seq: int = field(default_factory=lambda: next(_ids))
    trace_id: str = ""  # when the request is traced: the exemplar of its latency
    sequence: SequenceFlags | None = None  # a stateful model's: the sequence it belongs to
    # its way through the batcher, time.monotonic() seconds (0.0: not reached)
    batched: float = 0.0  # left the queue in a batch
    computed: float = 0.0  # the model finished that batch
    compute_seconds: float = 0.0  # the model's time on it
    batch_rows: int = 0
    # The model raised on a batch this request shared: it runs again in a batch of its own,
    # so a request the model cannot take fails alone, not the requests batched with it.
    alone: bool = False

    @property
    def correlation_id(self) -> int | str:
        """Its sequence's id (Triton's correlation id); 0 when it belongs to none."""
        return self.sequence.id if self.sequence is not None else 0

    @property
    def flags(self) -> int:
        """Triton's request flags: 1 when it starts its sequence, 2 when it ends it."""
        if self.sequence is None:
            return 0
        return int(self.sequence.start) | (int(self.sequence.end) << 1)

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (now or time.monotonic()) >= self.deadline

    def remaining(self, now: float | None = None) -> float:
        if self.deadline is None:
            return float("inf")
        return self.deadline - (now or time.monotonic())
