"""The inputs the sequence batcher adds to a stateful model's rows (`core/sequence_batcher.py`):
control values as the config declares them, the correlation id in the CORRID's type, and the
initial state. Requests through a real server are in `tests/frontend/test_sequence_batching.py`."""

from __future__ import annotations

import numpy as np

from lockgate.config import (
    ModelConfig,
    SequenceBatching,
    SequenceControl,
    SequenceControlKind,
    SequenceState,
)
from lockgate.core.sequence_batcher import control_inputs, idle_inputs, max_sequences
from lockgate.core.sequences import SequenceFlags

START = SequenceControl(SequenceControlKind.START, "S", "FP32", (-1.0, 2.5))
END = SequenceControl(SequenceControlKind.END, "E", "BOOL", (0, 1))
READY = SequenceControl(SequenceControlKind.READY, "R", "INT32", (5, 9))
STATE = SequenceState("H_IN", "H_OUT", "FP32", (-1, 2), (3, 2))


def settings(corrid: str = "UINT64") -> SequenceBatching:
    corrid_control = SequenceControl(SequenceControlKind.CORRID, "ID", corrid)
    return SequenceBatching(controls=(START, END, READY, corrid_control), states=(STATE,))


def test_controls_take_the_configs_false_and_true_values() -> None:
    first = control_inputs(settings(), SequenceFlags(9, start=True), 1, batching=True)
    assert first["S"].tolist() == [[2.5]] and first["S"].dtype == np.float32
    assert first["E"].tolist() == [[False]] and first["E"].dtype == np.bool_
    assert first["R"].tolist() == [[9]] and first["R"].dtype == np.int32
    assert first["ID"].tolist() == [[9]] and first["ID"].dtype == np.uint64
    last = control_inputs(settings(), SequenceFlags(9, end=True), 1, batching=False)
    assert last["S"].tolist() == [-1.0] and last["E"].tolist() == [True]  # [1]: no batch dim


def test_the_correlation_id_in_the_corrids_type() -> None:
    big = SequenceFlags(2**32 + 7)
    assert control_inputs(settings("INT32"), big, 1, True)["ID"].tolist() == [[7]]  # low bits
    assert control_inputs(settings("UINT64"), big, 1, True)["ID"].tolist() == [[2**32 + 7]]
    text = control_inputs(settings("BYTES"), SequenceFlags("alpha"), 1, False)["ID"]
    assert text.tolist() == [b"alpha"] and text.dtype == object


def test_warmup_rows_hold_no_request_and_the_initial_state() -> None:
    config = ModelConfig("m", "python", max_batch_size=4, sequence_batching=settings())
    rows = idle_inputs(config, 3)
    assert rows["R"].tolist() == [[5]] * 3  # READY false
    assert rows["ID"].tolist() == [[0]] * 3
    assert rows["H_IN"].shape == (3, 3, 2) and not rows["H_IN"].any()
    assert idle_inputs(ModelConfig("m", "python"), 3) == {}


def test_the_bound_on_live_sequences() -> None:
    config = ModelConfig("m", "python", instance_count=2, sequence_batching=settings())
    assert max_sequences(config, 100) == 100  # no max_candidate_sequences: the server's
    oldest = SequenceBatching(max_candidate_sequences=5)
    assert (
        max_sequences(ModelConfig("m", "python", instance_count=2, sequence_batching=oldest)) == 10
    )
