"""A request as the core sees it: named arrays plus deadline, priority and cancellation."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from lockgate.core.sequences import SequenceFlags
from lockgate.datatypes import Arrays

_ids = itertools.count(1)


@dataclass(slots=True, eq=False)
class InferRequest:
    """One client request to a classic model.

    `inputs` hold numpy arrays; BYTES tensors are object arrays of `bytes`. When the model
    batches, every input has the batch dimension first and `rows` is its length.
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

    def expired(self, now: float | None = None) -> bool:
        return self.deadline is not None and (now or time.monotonic()) >= self.deadline

    def remaining(self, now: float | None = None) -> float:
        if self.deadline is None:
            return float("inf")
        return self.deadline - (now or time.monotonic())
