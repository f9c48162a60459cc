"""The sequence batcher: a stateful model's requests (Triton's `sequence_batching`) through its
dynamic batcher.

Each request names its sequence (`SequenceFlags`). The requests of one sequence run one at a
time, in arrival order: a request enters the batcher only once the one before it in its
sequence is answered, so a batch holds at most one request of each sequence, and the batcher
batches the requests of several sequences, a row each. Before a request enters, its row gets
the control inputs the config declares (START, END, READY, CORRID) and the implicit state: the
initial state (zeros) on a request that starts its sequence, else the state output of the
sequence's previous request. The state outputs go back to the sequence, not to the client
(unless the config also lists one as an output). Which sequences are live, and when they are
freed, is `core/sequences.py`.

Both of Triton's strategies are served this way. `oldest` is what this does: the batcher takes
the oldest requests of the live sequences, up to `max_batch_size` (with its
`max_queue_delay_microseconds` and `preferred_batch_size`). `direct` pins each sequence to a
batch slot of one instance; here it runs as `oldest` does, which gives each row the same
inputs. A model that keeps its own state per CORRID, rather than as an implicit state, needs
one instance: lockgate runs a sequence's requests on whichever instance is free.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from lockgate.config import ModelConfig, SequenceBatching, SequenceControl, SequenceControlKind
from lockgate.core.batcher import Batcher
from lockgate.core.request import InferRequest
from lockgate.core.sequences import Sequence, SequenceFlags, SequenceTable
from lockgate.core.serving_metrics import ServingMetrics
from lockgate.datatypes import Arrays, numpy_dtype
from lockgate.errors import BackendError, BadRequest, ServingError

log = logging.getLogger("lockgate.sequences")

DEFAULT_MAX_SEQUENCES = 1024  # live sequences of a model version, when its config sets none
_INT_CORRIDS = ("UINT64", "INT64", "UINT32", "INT32")


def max_sequences(config: ModelConfig, default: int = DEFAULT_MAX_SEQUENCES) -> int:
    """The live sequences a model version holds at most: `oldest.max_candidate_sequences` per
    instance when the config sets it (as Triton's candidate slots), else `default`."""
    settings = config.sequence_batching
    if settings is not None and settings.max_candidate_sequences > 0:
        return settings.max_candidate_sequences * config.instance_count
    return default


class SequenceBatcher:
    """Sequences, control inputs and implicit state around one model version's batcher."""

    def __init__(
        self,
        config: ModelConfig,
        version: int,
        batcher: Batcher,
        metrics: ServingMetrics,
        limit: int = DEFAULT_MAX_SEQUENCES,
    ) -> None:
        assert config.sequence_batching is not None
        self.settings: SequenceBatching = config.sequence_batching
        self.config = config
        self.batcher = batcher
        self.metrics = metrics
        self.labels = (config.name, str(version))
        self.table = SequenceTable(config.name, limit, self.settings.max_sequence_idle_us / 1e6)
        # state outputs the config does not list: the sequence's, not the client's
        self.hidden = {
            s.output_name for s in self.settings.states if config.output(s.output_name) is None
        }
        self._count_fn = lambda: float(self.table.count(time.monotonic()))
        metrics.sequences.set_function(self.labels, self._count_fn)
        if not self.settings.states and config.instance_count > 1:
            log.warning(
                "model %s: a sequence's requests may run on any of its %d instances; a model "
                "that keeps its own state per sequence needs one instance (or an implicit state)",
                config.name,
                config.instance_count,
            )

    async def submit(self, request: InferRequest) -> Arrays:
        """Run `request` after the requests before it in its sequence; its outputs."""
        flags = request.sequence or SequenceFlags()
        try:
            self._check(request, flags)
            sequence = self.table.admit(flags, time.monotonic())
        except ServingError as error:
            self.metrics.requests.inc((*self.labels, error.kind))
            raise
        try:
            async with sequence.turn:
                return await self._run(sequence, flags, request)
        finally:
            self.table.done(sequence, time.monotonic())

    def _check(self, request: InferRequest, flags: SequenceFlags) -> None:
        if request.rows != 1:
            raise BadRequest(
                f"inference request to model '{self.config.name}' must specify batch-size 1 "
                "due to requirements of sequence batcher"
            )
        corrid = self.settings.control(SequenceControlKind.CORRID)
        if corrid is not None and corrid.datatype in _INT_CORRIDS and isinstance(flags.id, str):
            raise BadRequest(
                f"model '{self.config.name}' takes an unsigned integer correlation ID "
                f"(its CORRID is {corrid.datatype}), got the string {flags.id!r}"
            )

    async def _run(self, sequence: Sequence, flags: SequenceFlags, request: InferRequest) -> Arrays:
        batching = self.config.batching
        states = sequence.states
        if flags.start or states is None:
            states = initial_states(self.settings, 1, batching)
        request.inputs = {
            **request.inputs,
            **control_inputs(self.settings, flags, 1, batching),
            **states,
        }
        outputs = await self.batcher.submit(request)
        sequence.states = self._next_states(outputs)
        return {name: array for name, array in outputs.items() if name not in self.hidden}

    def _next_states(self, outputs: Arrays) -> Arrays:
        states: Arrays = {}
        for state in self.settings.states:
            array = outputs.get(state.output_name)
            if array is None:
                raise BackendError(
                    f"model '{self.config.name}' returned no state output '{state.output_name}' "
                    f"(sequence_batching.state '{state.input_name}')"
                )
            states[state.input_name] = array.astype(numpy_dtype(state.datatype), copy=False)
        return states

    def close(self) -> None:
        self.metrics.sequences.remove_function(self.labels, self._count_fn)


def control_inputs(
    settings: SequenceBatching, flags: SequenceFlags, rows: int, batching: bool, ready: bool = True
) -> Arrays:
    """The control inputs of `rows` rows of one sequence (READY false: rows that hold no
    request): [rows, 1] each, [1] for a model that does not batch."""
    shape = (rows, 1) if batching else (1,)
    return {control.name: _control(control, flags, shape, ready) for control in settings.controls}


def _control(
    control: SequenceControl, flags: SequenceFlags, shape: tuple[int, ...], ready: bool
) -> np.ndarray:
    dtype = numpy_dtype(control.datatype)
    if control.kind is SequenceControlKind.CORRID:
        if control.datatype == "BYTES":
            return np.full(shape, str(flags.id).encode(), dtype=object)
        # a uint64 id, cut to the low-order bits of a 32-bit type, as Triton does
        return np.full(shape, int(flags.id), dtype=np.uint64).astype(dtype)
    on = {
        SequenceControlKind.START: flags.start,
        SequenceControlKind.END: flags.end,
        SequenceControlKind.READY: ready,
    }[control.kind]
    return np.full(shape, control.false_true[1 if on else 0], dtype=dtype)


def initial_states(settings: SequenceBatching, rows: int, batching: bool) -> Arrays:
    """The implicit state of `rows` rows that start a sequence: zeros."""
    return {
        state.input_name: np.zeros(
            ((rows,) if batching else ()) + state.initial_dims, dtype=numpy_dtype(state.datatype)
        )
        for state in settings.states
    }


def idle_inputs(config: ModelConfig, rows: int) -> Arrays:
    """What warmup and profiling add to a stateful model's inputs: rows that hold no request
    (READY false, CORRID 0) and the initial state."""
    settings = config.sequence_batching
    if settings is None:
        return {}
    idle = control_inputs(settings, SequenceFlags(), rows, config.batching, ready=False)
    return {**idle, **initial_states(settings, rows, config.batching)}
