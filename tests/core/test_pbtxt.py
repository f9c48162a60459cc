"""Triton's `config.pbtxt`, read against Triton's `model_config.proto` as Triton reads it."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from google.protobuf import text_format
from hypothesis import given
from hypothesis import strategies as st

from lockgate.config import (
    DynamicBatching,
    SequenceControl,
    SequenceControlKind,
    SequenceState,
    SequenceStrategy,
    TensorSpec,
)
from lockgate.core.config_reader import config_from_dict, normalize_datatype
from lockgate.core.config_triton import parse_pbtxt_config, read_pbtxt
from lockgate.core.repository import scan_repository
from lockgate.core.triton import model_config_pb2 as pb
from lockgate.errors import ConfigError
from tests.conftest import free_port, start_server

# -- configs in the shapes of Triton's own examples

DENSENET_ONNX = """
name: "densenet_onnx"
platform: "onnxruntime_onnx"
max_batch_size : 1
input [
  {
    name: "data_0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
  }
]
output [
  {
    name: "fc6_1"
    data_type: TYPE_FP32
    dims: [ 1000 ]
    reshape { shape: [ 1000, 1, 1 ] }
    label_filename: "densenet_labels.txt"
  }
]
"""

ORT_TENSORRT = """
name: "text_recognition"
backend: "onnxruntime"
max_batch_size : 16
input [ { name: "input.1" data_type: TYPE_FP32 dims: [ 1, 32, 100 ] } ]
output [ { name: "308" data_type: TYPE_FP32 dims: [ 26, 37 ] } ]
model_warmup {
   name: "text_recognition"
   batch_size: 16
   inputs: {
       key: "input.1"
       value: { data_type: TYPE_FP32 dims: 1 dims: 32 dims: 100 zero_data: true }
   }
}
optimization {
  graph : { level : 1 }
  execution_accelerators {
    gpu_execution_accelerator : [ {
      name : "tensorrt",
      parameters { key: "precision_mode" value: "FP16" },
      parameters { key: "max_workspace_size_bytes" value: "1073741824" }
    }]
  }
}
"""

ENSEMBLE = """
# an ensemble of a preprocessing model and a classifier
name: "preprocess_resnet50_ensemble"
platform: "ensemble"
max_batch_size: 128
input [ { name: "INPUT" data_type: TYPE_STRING dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1000 ] } ]
ensemble_scheduling {
  step [
    {
      model_name: "image_preprocess"
      model_version: -1
      input_map { key: "INPUT" value: "INPUT" }
      output_map { key: "OUTPUT" value: "preprocessed_image" }
    },
    {
      model_name: "resnet50"
      model_version: 3
      input_map { key: "input" value: "preprocessed_image" }
      output_map { key: "resnet_v1_50/predictions/Softmax" value: "OUTPUT" }
    }
  ]
}
"""

PYTHON_TWO_INPUTS = """
name: "add_sub"
backend: "python"
input [ { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
input [ { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] optional: true } ]
output [ { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] } ]
output [ { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] } ]
instance_group [ { kind: KIND_CPU }]
parameters: { key: "EXECUTION_ENV_PATH", value: { string_value: "$$TRITON_MODEL_DIRECTORY/env" } }
"""

PRIORITIES = """
name: "ranked"
backend: "python"
max_batch_size: 8
input [ { name: "INPUT0" data_type: TYPE_INT64 dims: [ -1 ] } ]
output [ { name: "OUTPUT0" data_type: TYPE_BF16 dims: [ -1 ] } ]
dynamic_batching:
{
    preferred_batch_size: [ 4, 8 ]
    max_queue_delay_microseconds: 300
    priority_levels: 2
    default_priority_level: 2
    default_queue_policy {
      timeout_action: DELAY
      default_timeout_microseconds: 100000
      allow_timeout_override: true
      max_queue_size: 10
    }
    priority_queue_policy: [ { key: 1 value: { timeout_action: REJECT max_queue_size: 4 } } ]
}
version_policy: { latest: { } }
"""

SEQUENCE = """
name: "simple_sequence"
platform: "onnxruntime_onnx"
max_batch_size: 8
sequence_batching {
  control_input [
    { name: "START" control [ { kind: CONTROL_SEQUENCE_START int32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY int32_false_true: [ 0, 1 ] } ] }
  ]
}
input [ { name: "INPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_INT32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_GPU gpus: [ 0 ] } ]
"""


def warnings_of(caplog: pytest.LogCaptureFixture) -> str:
    return " ".join(record.getMessage() for record in caplog.records)


def test_onnx_classifier_with_label_file(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = parse_pbtxt_config(DENSENET_ONNX, path="c.pbtxt", folder="densenet_onnx")
    assert config.backend == "onnxruntime" and config.max_batch_size == 1
    assert config.inputs == (TensorSpec("data_0", "FP32", (3, 224, 224)),)
    assert config.outputs == (
        TensorSpec(
            "fc6_1", "FP32", (1000,), reshape=(1000, 1, 1), label_filename="densenet_labels.txt"
        ),
    )
    assert config.dynamic_batching is None and config.instance_count == 1
    ignored = warnings_of(caplog)
    assert "label_filename" not in ignored
    assert "reshape" not in ignored and "format" not in ignored


def test_onnxruntime_with_tensorrt_accelerator_and_warmup(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        config = parse_pbtxt_config(ORT_TENSORRT, path="c.pbtxt", folder="text_recognition")
    assert config.backend == "onnxruntime" and config.max_batch_size == 16
    assert config.inputs[0].dims == (1, 32, 100)
    (sample,) = config.warmup
    assert (sample.name, sample.batch_size, sample.count) == ("text_recognition", 16, 1)
    assert sample.inputs == {"input.1": "zero"}
    assert "ignoring Triton field 'optimization'" in warnings_of(caplog)


def test_ensemble_of_two_steps() -> None:
    config = parse_pbtxt_config(ENSEMBLE, path="c.pbtxt", folder="preprocess_resnet50_ensemble")
    assert config.backend == "ensemble"
    assert config.inputs == (TensorSpec("INPUT", "BYTES", (1,)),)
    first, second = config.ensemble
    assert (first.model, first.version) == ("image_preprocess", None)
    assert first.output_map == {"OUTPUT": "preprocessed_image"}
    assert (second.model, second.version) == ("resnet50", 3)
    assert second.output_map == {"resnet_v1_50/predictions/Softmax": "OUTPUT"}


def test_python_model_with_repeated_lists_and_parameters() -> None:
    config = parse_pbtxt_config(PYTHON_TWO_INPUTS, path="c.pbtxt", folder="add_sub")
    assert [spec.name for spec in config.inputs] == ["INPUT0", "INPUT1"]
    assert [spec.optional for spec in config.inputs] == [False, True]
    assert [spec.name for spec in config.outputs] == ["OUTPUT0", "OUTPUT1"]
    assert config.instance_count == 1  # an unset count is one instance, as in Triton
    assert config.parameters == {"EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/env"}


def test_allow_ragged_batch_is_read_from_pbtxt_and_yaml() -> None:
    text = """
name: "ragged"
backend: "python"
max_batch_size: 4
input [
  { name: "TOKENS" data_type: TYPE_INT64 dims: [ -1 ] allow_ragged_batch: true },
  { name: "MASK" data_type: TYPE_INT64 dims: [ -1 ] }
]
output [{ name: "OUT" data_type: TYPE_FP32 dims: [ 1 ] }]
"""
    config = parse_pbtxt_config(text, path="c.pbtxt", folder="ragged")
    assert [spec.allow_ragged_batch for spec in config.inputs] == [True, False]
    raw = {
        "backend": "python",
        "inputs": [{"name": "T", "datatype": "INT64", "dims": [-1], "allow_ragged_batch": "yes"}],
    }
    with pytest.raises(ConfigError, match="allow_ragged_batch"):
        config_from_dict(raw, path="config.yaml", folder="ragged")


def test_priorities_and_queue_policies(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = parse_pbtxt_config(PRIORITIES, path="c.pbtxt", folder="ranked")
    assert config.inputs == (TensorSpec("INPUT0", "INT64", (-1,)),)
    assert config.outputs == (TensorSpec("OUTPUT0", "BF16", (-1,)),)
    assert config.dynamic_batching == DynamicBatching(
        max_queue_delay_us=300,
        preferred_batch_sizes=(4, 8),
        max_queue_size=10,
        default_timeout_us=100000,
        priority_levels=2,
        default_priority_level=2,
    )
    assert config.version_policy.num_versions == 1
    ignored = warnings_of(caplog)
    assert "dynamic_batching.priority_queue_policy" in ignored
    assert "dynamic_batching.default_queue_policy.timeout_action" in ignored
    # lockgate always takes a request's own timeout: allow_timeout_override says so, quietly
    assert "allow_timeout_override" not in ignored


def test_sequence_batching_reads_as_triton_defaults_it(caplog: pytest.LogCaptureFixture) -> None:
    message = read_pbtxt(SEQUENCE, path="c.pbtxt")
    assert message.WhichOneof("scheduling_choice") == "sequence_batching"
    with caplog.at_level(logging.WARNING):
        config = parse_pbtxt_config(SEQUENCE, path="c.pbtxt", folder="simple_sequence")
    assert config.inputs == (TensorSpec("INPUT", "INT32", (1,)),)
    sequences = config.sequence_batching
    assert sequences is not None
    assert sequences.strategy is SequenceStrategy.DIRECT  # Triton's default strategy
    assert sequences.max_sequence_idle_us == 1_000_000  # and its default idle time
    assert sequences.controls == (
        SequenceControl(SequenceControlKind.START, "START", "INT32", (0, 1)),
        SequenceControl(SequenceControlKind.READY, "READY", "INT32", (0, 1)),
    )
    assert config.dynamic_batching is None and config.batcher.max_queue_delay_us == 0
    warned = warnings_of(caplog)
    assert "sequence_batching" not in warned
    assert "KIND_GPU" in warned  # runs on the CPU, and says so


STATEFUL = """
name: "stateful"
backend: "python"
max_batch_size: 4
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 2 ] } ]
sequence_batching {
  max_sequence_idle_microseconds: 250000
  oldest {
    max_candidate_sequences: 6 preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 100
  }
  control_input [
    { name: "END" control [ { kind: CONTROL_SEQUENCE_END fp32_false_true: [ 0, 1 ] } ] },
    { name: "READY" control [ { kind: CONTROL_SEQUENCE_READY bool_false_true: [ false, true ] } ] },
    { name: "CORRID" control [ { kind: CONTROL_SEQUENCE_CORRID data_type: TYPE_STRING } ] }
  ]
  state [ {
    input_name: "STATE_IN" output_name: "STATE_OUT" data_type: TYPE_FP32 dims: [ -1 ]
    initial_state { data_type: TYPE_FP32 dims: [ 3 ] zero_data: true name: "zeros" }
  } ]
}
"""


def test_the_oldest_strategy_controls_and_an_implicit_state() -> None:
    config = parse_pbtxt_config(STATEFUL, path="s.pbtxt", folder="stateful")
    sequences = config.sequence_batching
    assert sequences is not None
    assert sequences.strategy is SequenceStrategy.OLDEST
    assert sequences.max_sequence_idle_us == 250_000
    assert sequences.max_candidate_sequences == 6
    assert config.batcher.preferred_batch_sizes == (2, 4)
    assert config.batcher.max_queue_delay_us == 100
    corrid = sequences.control(SequenceControlKind.CORRID)
    assert corrid == SequenceControl(SequenceControlKind.CORRID, "CORRID", "BYTES")
    ready = sequences.control(SequenceControlKind.READY)
    assert ready is not None and ready.datatype == "BOOL" and ready.false_true == (0, 1)
    (state,) = sequences.states
    assert state == SequenceState("STATE_IN", "STATE_OUT", "FP32", (-1,), (3,))


@pytest.mark.parametrize(
    ("change", "field", "words"),
    [
        (
            ("fp32_false_true: [ 0, 1 ]", "fp32_false_true: [ 0, 1, 2 ]"),
            "control_input[0].control[0].fp32_false_true",
            "exactly 2 entries",
        ),
        (
            ("fp32_false_true: [ 0, 1 ]", "data_type: TYPE_INT32"),
            "control_input[0].control[0]",
            "exactly one of int32_false_true",
        ),
        (("TYPE_STRING", "TYPE_FP32"), "control_input[2].control[0].data_type", "UINT64"),
        (('name: "READY"', 'name: "INPUT"'), "control_input[1].name", "also a declared input"),
        (('name: "CORRID"', 'name: "STATE_IN"'), "state[0].input_name", "filled in twice"),
        (("zero_data: true", 'data_file: "s.bin"'), "initial_state[0].data_file", "zero_data"),
        (("dims: [ 3 ] zero", "dims: [ -1 ] zero"), "initial_state[0].dims", "fixed"),
        (("preferred_batch_size: [ 2, 4 ]", "preferred_batch_size: [ 8 ]"), "oldest", "exceeds"),
        (
            ("max_batch_size: 4", "max_batch_size: 4 dynamic_batching { }"),
            "pbtxt",  # one of Triton's scheduling_choice
            "dynamic_batching",
        ),
        (
            ("max_batch_size: 4", "max_batch_size: 4 response_cache { enable: true }"),
            "sequence_batching",
            "response cache",
        ),
    ],
)
def test_a_bad_sequence_batching_names_its_field(
    change: tuple[str, str], field: str, words: str
) -> None:
    text = STATEFUL.replace(*change)
    assert text != STATEFUL
    with pytest.raises(ConfigError) as caught:
        parse_pbtxt_config(text, path="s.pbtxt", folder="stateful")
    assert field in caught.value.field and words in str(caught.value), str(caught.value)


def test_a_stateful_models_config_reads_back_from_the_config_lockgate_answers() -> None:
    from lockgate.core.config_triton import parse_json_config
    from lockgate.protocol import v2_metadata

    config = parse_pbtxt_config(STATEFUL, path="s.pbtxt", folder="stateful")
    document = v2_metadata.model_config(config, v2_metadata.Runtime("python"))
    again = parse_json_config(v2_metadata.encode(document).decode(), path="s", folder="stateful")
    assert again.sequence_batching == config.sequence_batching


def test_int64_dims_and_versions_keep_their_width() -> None:
    text = """backend: "python" version_policy { specific { versions: [ 1, 9007199254740993 ] } }
    input { name: "x" data_type: TYPE_UINT8 dims: [ 9007199254740993 ] }"""
    config = parse_pbtxt_config(text, path="c.pbtxt", folder="m")
    assert config.inputs[0].dims == (9007199254740993,)
    assert config.version_policy.versions == (1, 9007199254740993)


# -- what Triton refuses, refused here too: the file, the line and the column


@pytest.mark.parametrize(
    ("text", "where", "fragment"),
    [
        ('name: "m"\nbackend: "python"\nmax_batch_sise: 8\n', "line 3, column 1", "max_batch_sise"),
        (
            'backend: "python"\ninput [\n  { name: "x" data_typ: TYPE_FP32 dims: [ 1 ] }\n]',
            "line 3, column 15",
            'no field named "data_typ"',
        ),
        (
            'backend: "python"\ninput { name: "x" data_type: TYPE_FLOAT32 dims: 1 }',
            "line 2, column 30",
            'Enum type "inference.DataType" has no value named TYPE_FLOAT32',
        ),
        (
            'backend: "python"\ninstance_group [ { kind: KIND_TPU } ]',
            "line 2, column 26",
            "no value named KIND_TPU",
        ),
        ('backend: "python"\nmax_batch_size: "8"', "line 2, column 17", "Couldn't parse integer"),
        ('backend: "python"\nmax_batch_size: 8.5', "line 2, column 17", "Couldn't parse integer"),
        (
            'backend: "python"\ndynamic_batching { max_queue_delay_microseconds: -1 }',
            "line 2, column 50",
            "out of range",
        ),
        ('backend: "python"\nbackend: "onnxruntime"', "line 2", 'multiple "backend" fields'),
        (
            'backend: "python" max_batch_size: 4\ndynamic_batching { }\nsequence_batching { }',
            "line 3",
            'another member of oneof "scheduling_choice"',
        ),
        ('backend: "python"\nlatency_slo_ms: 20', "line 2, column 1", "latency_slo_ms"),
        ('backend: "python"\ninput { name: "x"', "line 2", "Expected"),
    ],
)
def test_what_triton_refuses_names_file_line_and_column(
    text: str, where: str, fragment: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pbtxt_config(text, path="r/m/config.pbtxt", folder="m")
    error = info.value
    assert error.field == "pbtxt"
    assert error.problem.startswith(where + ":") or error.problem.startswith(where + ",")
    assert fragment in error.problem
    assert str(error).startswith("r/m/config.pbtxt: ")
    line = text.split("\n")[int(where.split()[1].rstrip(",")) - 1]
    assert f"'{line}'" not in error.problem  # the position is given: the line is not quoted


# -- a round trip through protobuf's own writer


_DATATYPES = [value.name for value in pb.DataType.DESCRIPTOR.values if value.number != 0]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(_DATATYPES),
            st.lists(st.integers(min_value=-1, max_value=2**40), max_size=4),
        ),
        max_size=4,
    )
)
def test_configs_written_by_protobuf_read_back(tensors: list[tuple[str, list[int]]]) -> None:
    message = pb.ModelConfig(backend="python", max_batch_size=4)
    for index, (datatype, dims) in enumerate(tensors):
        message.input.add(name=f"in{index}", data_type=datatype, dims=dims)
    config = parse_pbtxt_config(text_format.MessageToString(message), path="c", folder="m")
    assert config.inputs == tuple(
        TensorSpec(f"in{i}", normalize_datatype(datatype) or "", tuple(dims))
        for i, (datatype, dims) in enumerate(tensors)
    )


# -- one bad config fails its model alone

ECHO_PY = "class Model:\n    def infer(self, inputs):\n        return {'y': inputs['x'] * 2}\n"
ECHO_PBTXT = """name: "{name}"
backend: "python"
{batch}: 8
input [ {{ name: "x" data_type: TYPE_FP32 dims: [ 4 ] }} ]
output [ {{ name: "y" data_type: TYPE_FP32 dims: [ 4 ] }} ]
dynamic_batching {{ max_queue_delay_microseconds: 100 }}
instance_group [ {{ count: 1 kind: KIND_CPU }} ]
"""


def write_echo(root: Path, name: str, batch_key: str = "max_batch_size") -> None:
    (root / name / "1").mkdir(parents=True)
    (root / name / "1" / "model.py").write_text(ECHO_PY)
    (root / name / "config.pbtxt").write_text(ECHO_PBTXT.format(name=name, batch=batch_key))


def test_scan_reports_the_misspelt_model_and_keeps_the_others(tmp_path: Path) -> None:
    write_echo(tmp_path, "echo")
    write_echo(tmp_path, "typo", batch_key="max_batch_sise")
    entries = {entry.name: entry for entry in scan_repository(tmp_path)}
    assert entries["echo"].ok and entries["echo"].config is not None
    assert entries["echo"].config.batcher.max_queue_delay_us == 100
    typo = entries["typo"]
    assert not typo.ok and typo.config is None and typo.versions == []
    assert str(tmp_path / "typo" / "config.pbtxt") in (typo.error or "")
    assert "line 3, column 1" in (typo.error or "")


def test_a_server_serves_the_good_models_and_reports_the_misspelt_one(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    write_echo(repo, "echo")
    write_echo(repo, "typo", batch_key="max_batch_sise")
    server = start_server(repo, tmp_path, "--no-llm")
    try:
        body = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1] * 4}]}
        answer = httpx.post(server.url + "/v2/models/echo/infer", json=body, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["outputs"][0]["data"] == [2.0] * 4
        assert httpx.get(server.url + "/v2/models/typo/ready").status_code == 503
        index = httpx.post(server.url + "/v2/repository/index", timeout=30).json()
        states = {entry["name"]: entry for entry in index}
        assert states["echo"]["state"] == "READY"
        typo = states["typo"]
        assert typo["state"] == "UNAVAILABLE"
        assert "config.pbtxt" in typo["reason"]
        assert "line 3, column 1" in typo["reason"]
        assert 'no field named "max_batch_sise"' in typo["reason"]
    finally:
        server.stop()


def test_lockgates_own_fields_come_as_parameters() -> None:
    """Triton's schema has no SLO: `latency_slo_ms` and `admission_slack` are given as
    parameters of the same name, and leave the backend's parameters."""
    text = PYTHON_TWO_INPUTS.replace(
        "parameters: {",
        'parameters: { key: "latency_slo_ms", value: { string_value: "50" } }\n'
        'parameters: { key: "admission_slack", value: { string_value: "0.9" } }\nparameters: {',
    )
    config = parse_pbtxt_config(text, path="c.pbtxt", folder="add_sub")
    assert config.latency_slo_ms == 50.0 and config.admission_slack == 0.9
    assert config.parameters == {"EXECUTION_ENV_PATH": "$$TRITON_MODEL_DIRECTORY/env"}
    bad = PYTHON_TWO_INPUTS.replace(
        "parameters: {",
        'parameters: { key: "latency_slo_ms", value: { string_value: "soon" } }\nparameters: {',
    )
    with pytest.raises(ConfigError, match=r"latency_slo_ms.*expected a number"):
        parse_pbtxt_config(bad, path="c.pbtxt", folder="add_sub")


def test_a_decoupled_model_and_its_bound_read_back_from_the_config_lockgate_answers() -> None:
    from lockgate.core.config_triton import parse_json_config
    from lockgate.protocol import v2_metadata

    text = (
        'backend: "python"\nmodel_transaction_policy { decoupled: true }\n'
        'parameters: { key: "max_buffered_responses", value: { string_value: "8" } }\n'
    )
    config = parse_pbtxt_config(text, path="s/config.pbtxt", folder="s")
    assert config.decoupled and config.max_buffered_responses == 8 and not config.parameters
    document = v2_metadata.model_config(config, v2_metadata.Runtime("python"))
    assert document["model_transaction_policy"] == {"decoupled": True}
    again = parse_json_config(v2_metadata.encode(document).decode(), path="s", folder="s")
    assert again.decoupled and again.max_buffered_responses == 8
    plain = parse_pbtxt_config('backend: "python"', path="p/config.pbtxt", folder="p")
    assert not plain.decoupled and plain.max_buffered_responses == 64
    with pytest.raises(ConfigError, match=r"max_buffered_responses.*whole number"):
        bad = text.replace('"8"', '"many"')
        parse_pbtxt_config(bad, path="s/config.pbtxt", folder="s")


RESHAPED_DIGITS = """
platform: "onnxruntime_onnx"
max_batch_size: 8
input [ { name: "input" data_type: TYPE_FP32 dims: [ 8, 8 ] reshape: { shape: [ 64 ] } } ]
output [
  { name: "label" data_type: TYPE_INT64 dims: [ 1 ] reshape: { shape: [ ] } },
  { name: "probabilities" data_type: TYPE_FP32 dims: [ 10 ] label_filename: "names.txt" }
]
"""
NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@pytest.mark.parametrize(
    ("dims", "reshape", "problem"),
    [
        ("[ 8, 8 ]", "[ 65 ]", "holds 65 elements"),
        ("[ -1 ]", "[ ]", "-1 once in each"),
        ("[ -1, -1 ]", "[ -1 ]", "-1 once in each"),
    ],
)
def test_a_reshape_must_hold_the_elements_of_its_dims(
    dims: str, reshape: str, problem: str
) -> None:
    text = RESHAPED_DIGITS.replace("[ 8, 8 ]", dims).replace("[ 64 ]", reshape)
    with pytest.raises(ConfigError, match=problem):
        parse_pbtxt_config(text, path="c.pbtxt", folder="digits")


def test_a_server_reshapes_and_labels_as_triton(demo_repo: Path, tmp_path: Path) -> None:
    """Clients send and get `dims`; the ONNX model takes [B, 64] and gives a label of [B].
    A classification of an output with a label file names each class, over REST and gRPC.
    Version folders `0` and `01` are not versions, as in Triton."""
    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient
    from sklearn.datasets import load_digits

    folder = tmp_path / "repo" / "digits"
    (folder / "1").mkdir(parents=True)
    shutil.copy(demo_repo / "digits_onnx" / "1" / "model.onnx", folder / "1" / "model.onnx")
    for ignored in ("0", "01"):
        shutil.copytree(folder / "1", folder / ignored)
    (folder / "config.pbtxt").write_text(RESHAPED_DIGITS + "version_policy: { all: {} }\n")
    (folder / "names.txt").write_text("\n".join(NAMES[:9]) + "\n")  # no name for 9
    server = start_server(tmp_path / "repo", tmp_path, "--no-llm", grpc_port=free_port())
    try:
        client = httpclient.InferenceServerClient(server.address)
        x = (load_digits().data[:3] / 16.0).astype(np.float32).reshape(3, 8, 8)
        inputs = [httpclient.InferInput("input", [3, 8, 8], "FP32")]
        inputs[0].set_data_from_numpy(x)
        result = client.infer("digits", inputs)
        label, probabilities = result.as_numpy("label"), result.as_numpy("probabilities")
        assert label is not None and probabilities is not None
        assert label.tolist() == [[0], [1], [2]] and probabilities.shape == (3, 10)
        assert client.get_model_metadata("digits")["versions"] == ["1"]
        tensors = client.get_model_config("digits")
        assert tensors["input"][0]["reshape"] == {"shape": [64]}
        assert tensors["output"][0]["reshape"] == {"shape": []}
        assert "reshape" not in tensors["output"][1]
        assert tensors["output"][1]["label_filename"] == "names.txt"
        grpc = grpcclient.InferenceServerClient(server.grpc_address)
        rows = np.concatenate([x[:2], (load_digits().data[9:10] / 16.0).reshape(1, 8, 8)])
        for module, client_of in ((httpclient, client), (grpcclient, grpc)):
            top = module.InferInput("input", [3, 8, 8], "FP32")
            top.set_data_from_numpy(rows.astype(np.float32))
            wanted = [module.InferRequestedOutput("probabilities", class_count=1)]
            classes = client_of.infer("digits", [top], outputs=wanted).as_numpy("probabilities")
            assert classes is not None
            parts = [c.decode().split(":") for c in classes.ravel()]
            assert [p[1:] for p in parts] == [["0", "zero"], ["1", "one"], ["9"]]
    finally:
        server.stop()


def test_the_config_lockgate_answers_reads_back_without_warnings(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`GET .../config` sent back in a load request (tritonclient's load_model(config=...)):
    every field lockgate writes is one it reads."""
    from lockgate.core.config_triton import parse_json_config
    from lockgate.protocol import v2_metadata

    text = """
    name: "q" backend: "onnxruntime" max_batch_size: 8
    input [ { name: "x" data_type: TYPE_FP32 dims: [ 4 ] } ]
    output [ { name: "y" data_type: TYPE_FP32 dims: [ 2 ] } ]
    dynamic_batching {
      priority_levels: 2 default_priority_level: 2
      default_queue_policy { max_queue_size: 4 default_timeout_microseconds: 1000 }
    }
    """
    config = parse_pbtxt_config(text, path="q/config.pbtxt", folder="q")
    document = v2_metadata.model_config(config, v2_metadata.Runtime("onnxruntime"))
    with caplog.at_level(logging.WARNING):
        again = parse_json_config(
            v2_metadata.encode(document).decode(), path="q (load)", folder="q"
        )
    assert "ignoring" not in warnings_of(caplog), warnings_of(caplog)
    assert again.max_batch_size == 8 and again.batcher.priority_levels == 2
