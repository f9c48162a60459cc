from __future__ import annotations

import logging
from pathlib import Path

import pytest

from lockgate.config import DynamicBatching, TensorSpec, VersionPolicyKind
from lockgate.core.config_files import load_model_config, parse_yaml_config
from lockgate.core.config_reader import check_warmup_inputs, normalize_datatype
from lockgate.core.config_triton import parse_pbtxt_config
from lockgate.errors import ConfigError

FULL_YAML = """
name: digits
backend: onnxruntime
max_batch_size: 64
inputs:
  - {name: input, datatype: FP32, dims: [64]}
  - {name: mask, datatype: TYPE_BOOL, dims: [-1], optional: true}
outputs:
  - {name: label, datatype: INT64, dims: []}
dynamic_batching:
  max_queue_delay_us: 500
  preferred_batch_sizes: [16, 8]
  max_queue_size: 100
  default_timeout_us: 20000
  priority_levels: 2
  default_priority_level: 1
latency_slo_ms: 20
instance_count: 2
version_policy: {latest: {num_versions: 2}}
warmup:
  - {name: zeros, batch_size: 8, count: 3, inputs: {input: zero}}
parameters: {intra_op_threads: 2, fast: true, mode: x}
default_model_filename: weights.onnx
"""


X1 = "{name: x, datatype: FP32, dims: [1]}"
BATCH8 = "backend: python\nmax_batch_size: 8\n"


def write(folder: Path, filename: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / filename).write_text(text)
    return folder


def yaml_error(text: str, folder: str = "m") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_yaml_config(text, path="repo/m/config.yaml", folder=folder)
    assert info.value.path == "repo/m/config.yaml"
    assert "repo/m/config.yaml" in str(info.value)
    return info.value


def test_full_yaml(tmp_path: Path) -> None:
    config = load_model_config(write(tmp_path / "digits", "config.yaml", FULL_YAML))
    assert config.name == "digits" and config.backend == "onnxruntime"
    assert config.max_batch_size == 64
    assert config.inputs == (
        TensorSpec("input", "FP32", (64,)),
        TensorSpec("mask", "BOOL", (-1,), optional=True),
    )
    assert config.outputs == (TensorSpec("label", "INT64", ()),)
    assert config.dynamic_batching == DynamicBatching(
        max_queue_delay_us=500,
        preferred_batch_sizes=(8, 16),
        max_queue_size=100,
        default_timeout_us=20000,
        priority_levels=2,
        default_priority_level=1,
    )
    assert config.latency_slo_ms == 20.0
    assert config.instance_count == 2
    assert config.version_policy.kind is VersionPolicyKind.LATEST
    assert config.version_policy.num_versions == 2
    assert config.warmup[0].batch_size == 8 and config.warmup[0].count == 3
    assert config.warmup[0].inputs == {"input": "zero"}
    assert config.parameters == {"intra_op_threads": "2", "fast": "true", "mode": "x"}
    assert config.default_model_filename == "weights.onnx"
    assert config.source == str(tmp_path / "digits" / "config.yaml")


def test_minimal_yaml_defaults() -> None:
    config = parse_yaml_config("backend: sklearn\ninput: []\n", path="c.yaml", folder="iris")
    assert config.name == "iris"
    assert config.max_batch_size == 0 and config.dynamic_batching is None
    assert config.instance_count == 1 and config.latency_slo_ms is None


def test_yaml_preferred_over_pbtxt(tmp_path: Path) -> None:
    folder = write(tmp_path / "m", "config.yaml", "backend: python\n")
    write(folder, "config.pbtxt", 'backend: "onnxruntime"\n')
    assert load_model_config(folder).backend == "python"


def test_version_policies() -> None:
    all_ = parse_yaml_config("backend: python\nversion_policy: {all: {}}", path="c", folder="m")
    assert all_.version_policy.kind is VersionPolicyKind.ALL
    text = "backend: python\nversion_policy: {specific: {versions: [1, 3]}}"
    specific = parse_yaml_config(text, path="c", folder="m")
    assert specific.version_policy.kind is VersionPolicyKind.SPECIFIC
    assert specific.version_policy.select([1, 2, 3]) == [3, 1]


def test_instance_group_counts_are_summed() -> None:
    text = "backend: python\ninstance_group: [{count: 2, kind: KIND_CPU}, {count: 1}]"
    assert parse_yaml_config(text, path="c", folder="m").instance_count == 3


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("backend: tensorflow", "backend", "unknown backend"),
        ("max_batch_size: 1", "backend", "missing"),
        ("backend: python\nmax_batch_size: -1", "max_batch_size", ">= 0"),
        ("backend: python\nmax_batch_size: yes", "max_batch_size", "integer"),
        ("backend: python\nname: other", "name", "does not match"),
        ("backend: python\nlatency_slo_ms: 0", "latency_slo_ms", "> 0"),
        ("backend: python\nlatency_slo_ms: -5", "latency_slo_ms", "> 0"),
        ("backend: python\nadmission_slack: 0", "admission_slack", "(0, 1]"),
        ("backend: python\nadmission_slack: 1.5", "admission_slack", "(0, 1]"),
        ("backend: python\ninstance_count: 0", "instance_count", ">= 1"),
        ("backend: python\ninstance_count: 100000", "instance_count", "<= 256"),
        (
            "backend: python\ninstance_group: [{count: 200}, {count: 100}]",
            "instance_group",
            "300 instances in all, more than 256",
        ),
        ("backend: python\nmax_batch_size: 100000000", "max_batch_size", "<= 1048576"),
        ("backend: python\nbatch_size: 4", "batch_size", "unknown key"),
        (
            "backend: python\ninputs: [{name: x, datatype: FLOAT99, dims: [1]}]",
            "inputs[0].datatype",
            "unknown datatype",
        ),
        ("backend: python\ninputs: [{name: x, datatype: FP32, dims: 3}]", "inputs[0].dims", "list"),
        (
            "backend: python\ninputs: [{name: x, datatype: FP32, dims: [-2]}]",
            "inputs[0].dims",
            ">= -1",
        ),
        (
            "backend: python\ninputs: [{name: x, datatype: FP32, dims: [1.5]}]",
            "inputs[0].dims",
            "integers",
        ),
        (
            "backend: python\ninputs: [{name: x, datatype: FP32, dims: [true]}]",
            "inputs[0].dims",
            "integers",
        ),
        (
            "backend: python\ninputs: [{name: x, datatype: FP32, dims: [1], shape: [1]}]",
            "inputs[0].shape",
            "unknown key",
        ),
        (
            f"backend: python\ninputs: [{X1}, {X1}]",
            "inputs[1].name",
            "duplicate",
        ),
        ("backend: python\ninput: []\ninputs: []", "inputs", "not both"),
        (
            BATCH8 + "dynamic_batching: {preferred_batch_sizes: [4, 16]}",
            "dynamic_batching.preferred_batch_sizes",
            "exceeds max_batch_size",
        ),
        (
            "backend: python\nmax_batch_size: 8\ndynamic_batching: {max_queue_delay: 5}",
            "dynamic_batching.max_queue_delay",
            "unknown key",
        ),
        (
            "backend: python\nmax_batch_size: 8\ndynamic_batching: {max_queue_size: 0}",
            "dynamic_batching.max_queue_size",
            ">= 1",
        ),
        (
            BATCH8 + "dynamic_batching: {priority_levels: 2, default_priority_level: 3}",
            "dynamic_batching.default_priority_level",
            "<= priority_levels",
        ),
        ("backend: python\ndynamic_batching: {}", "dynamic_batching", "max_batch_size > 0"),
        ("backend: python\nversion_policy: {newest: {}}", "version_policy.newest", "unknown key"),
        (
            "backend: python\nversion_policy: {latest: {num_versions: 0}}",
            "version_policy.latest.num_versions",
            ">= 1",
        ),
        (
            "backend: python\nversion_policy: {specific: {versions: []}}",
            "version_policy.specific.versions",
            "at least one",
        ),
        ("backend: python\nversion_policy: {all: {}, latest: {}}", "version_policy", "exactly one"),
        (
            "backend: python\nmax_batch_size: 4\nwarmup: [{batch_size: 8}]",
            "warmup[0].batch_size",
            "exceeds",
        ),
        ("backend: python\nwarmup: [{inputs: {x: ones}}]", "warmup[0].inputs.x", "zero"),
        (
            f"backend: python\ninputs: [{X1}]\nwarmup: [{{inputs: {{y: zero}}}}]",
            "warmup[0].inputs.y",
            "no input",
        ),
        ("backend: python\nparameters: {a: [1, 2]}", "parameters.a", "scalar"),
        (
            "backend: python\ndefault_model_filename: ../x.onnx",
            "default_model_filename",
            "plain file name",
        ),
        (
            "backend: python\ninstance_group: [{count: 1, kind: KIND_TPU}]",
            "instance_group[0].kind",
            "unknown kind",
        ),
        ("backend: python\ninstance_count: 1\ninstance_group: []", "instance_count", "not both"),
        ("- backend: python", "config", "mapping"),
        (
            "backend: python\nmax_batch_size: 4\ndynamic_batching: {}\nsequence_batching: {}",
            "sequence_batching",
            "not both",
        ),
        (
            "backend: python\nsequence_batching: {oldest: {}, direct: {}}",
            "sequence_batching",
            "one strategy",
        ),
        (
            "backend: python\nsequence_batching: {oldest: {max_candidate_sequences: -1}}",
            "sequence_batching.oldest.max_candidate_sequences",
            ">= 0",
        ),
        (
            "backend: python\nsequence_batching: {control_input: [{name: S, control: "
            "[{kind: CONTROL_SEQUENCE_BEGIN, int32_false_true: [0, 1]}]}]}",
            "sequence_batching.control_input[0].control[0].kind",
            "unknown kind",
        ),
        (
            "backend: ensemble\nensemble: [{model: m, input_map: {a: a}, output_map: {b: b}}]\n"
            "sequence_batching: {}",
            "sequence_batching",
            "ensemble",
        ),
        ("backend: sklearn\nsequence_batching: {}", "sequence_batching", "no control inputs"),
    ],
)
def test_yaml_errors_name_the_field(text: str, field: str, fragment: str) -> None:
    error = yaml_error(text)
    assert error.field == field
    assert fragment in error.problem


def test_sequence_batching_in_yaml_takes_tritons_json_keys() -> None:
    text = """
backend: python
max_batch_size: 8
inputs: [{name: INPUT, datatype: INT32, dims: [1]}]
sequence_batching:
  max_sequence_idle_microseconds: 2000000
  oldest: {max_candidate_sequences: 16, preferred_batch_size: [4]}
  control_input:
    - {name: START, control: [{kind: CONTROL_SEQUENCE_START, int32_false_true: [0, 1]}]}
    - {name: ID, control: [{kind: CONTROL_SEQUENCE_CORRID, data_type: UINT64}]}
  state:
    - {input_name: S_IN, output_name: S_OUT, data_type: INT32, dims: [2]}
"""
    config = parse_yaml_config(text, path="c.yaml", folder="acc")
    sequences = config.sequence_batching
    assert sequences is not None and sequences.max_sequence_idle_us == 2_000_000
    assert [c.name for c in sequences.controls] == ["START", "ID"]
    assert sequences.states[0].initial_dims == (2,)
    assert config.batcher.preferred_batch_sizes == (4,)


def test_yaml_syntax_error_has_line() -> None:
    error = yaml_error("backend: python\nmax_batch_size: [1,\n  inputs: {\n")
    assert error.field == "yaml"
    assert "line" in error.problem


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_model_config(tmp_path)
    assert info.value.field == "config"


def test_datatype_names() -> None:
    assert normalize_datatype("TYPE_FP32") == "FP32"
    assert normalize_datatype("fp16") == "FP16"
    assert normalize_datatype("TYPE_STRING") == "BYTES"
    assert normalize_datatype("FLOAT") is None


TRITON_CONFIG = """
name: "resnet"
platform: "onnxruntime_onnx"
max_batch_size: 16
input [
  {
    name: "input__0"
    data_type: TYPE_FP32
    format: FORMAT_NCHW
    dims: [ 3, 224, 224 ]
    reshape { shape: [ 1, 3, 224, 224 ] }
  }
]
output [
  { name: "probs", data_type: TYPE_FP32, dims: [ 1000 ] },
  { name: "names", data_type: TYPE_STRING, dims: [ -1 ] }
]
instance_group [ { count: 2 kind: KIND_CPU }, { count: 1 kind: KIND_CPU } ]
dynamic_batching {
  preferred_batch_size: [ 4, 8 ]
  max_queue_delay_microseconds: 100
  preserve_ordering: true
  default_queue_policy { max_queue_size: 64 default_timeout_microseconds: 5000 }
  priority_levels: 3
  default_priority_level: 2
}
version_policy: { specific { versions: [ 1, 3 ] } }
model_warmup [
  {
    name: "zeros"
    batch_size: 4
    count: 2
    inputs { key: "input__0" value { data_type: TYPE_FP32 dims: [3, 224, 224] zero_data: true } }
  },
  {
    name: "random"
    inputs { key: "input__0" value { data_type: TYPE_FP32 dims: [3, 224, 224] random_data: true } }
  }
]
parameters { key: "intra_op_threads" value { string_value: "2" } }
parameters [ { key: "mode" value: { string_value: "fast" } } ]
default_model_filename: "resnet.onnx"
optimization { execution_accelerators { cpu_execution_accelerator: [ { name: "openvino" } ] } }
response_cache { enable: true }
"""


def test_triton_pbtxt(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        config = parse_pbtxt_config(TRITON_CONFIG, path="r/resnet/config.pbtxt", folder="resnet")
    assert config.backend == "onnxruntime"
    assert config.max_batch_size == 16
    assert config.inputs == (
        TensorSpec("input__0", "FP32", (3, 224, 224), reshape=(1, 3, 224, 224)),
    )
    assert config.outputs == (
        TensorSpec("probs", "FP32", (1000,)),
        TensorSpec("names", "BYTES", (-1,)),
    )
    assert config.instance_count == 3
    assert config.dynamic_batching == DynamicBatching(
        max_queue_delay_us=100,
        preferred_batch_sizes=(4, 8),
        max_queue_size=64,
        default_timeout_us=5000,
        priority_levels=3,
        default_priority_level=2,
    )
    assert config.version_policy.versions == (1, 3)
    assert [(w.name, w.batch_size, w.count, w.inputs) for w in config.warmup] == [
        ("zeros", 4, 2, {"input__0": "zero"}),
        ("random", 1, 1, {"input__0": "random"}),
    ]
    assert config.parameters == {"intra_op_threads": "2", "mode": "fast"}
    assert config.default_model_filename == "resnet.onnx"
    ignored = " ".join(r.getMessage() for r in caplog.records)
    assert "optimization" in ignored and "response_cache" not in ignored  # read now
    assert config.response_cache.enable
    assert "dynamic_batching.preserve_ordering" in ignored
    assert "reshape" not in ignored  # applied


def test_triton_defaults_keep_queue_bounded() -> None:
    text = """backend: "python" max_batch_size: 4
    dynamic_batching { default_queue_policy { max_queue_size: 0 } priority_levels: 0 }"""
    config = parse_pbtxt_config(text, path="c.pbtxt", folder="m")
    assert config.batcher.max_queue_size == DynamicBatching().max_queue_size
    assert config.batcher.priority_levels == 1


def test_triton_latest_and_all_policies() -> None:
    latest = parse_pbtxt_config(
        'backend: "python" version_policy { latest { num_versions: 2 } }', path="c", folder="m"
    )
    assert latest.version_policy.num_versions == 2
    all_ = parse_pbtxt_config('backend: "python" version_policy: { all { } }', path="c", folder="m")
    assert all_.version_policy.kind is VersionPolicyKind.ALL


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ('platform: "tensorflow_savedmodel"', "platform", "unsupported platform"),
        ('backend: "python" max_batch_size: -2', "max_batch_size", ">= 0"),
        ('backend: "python" name: "other"', "name", "does not match"),
        (
            'backend: "python" input { name: "x" data_type: TYPE_FP99 dims: 1 }',
            "pbtxt",
            "line 1, column 48: Enum type",
        ),
        ('backend: "python" input { name: "x" dims: 1 }', "input[0].data_type", "non-empty"),
        ('backend: "python" input { name: "x" data_type: 99 }', "input[0].data_type", "'99'"),
        (
            'backend: "python" max_batch_size: 2 dynamic_batching { preferred_batch_size: 4 }',
            "dynamic_batching.preferred_batch_sizes",
            "exceeds",
        ),
        ('backend: "python" instance_group { count: -1 }', "instance_group[0].count", ">= 1"),
        ('backend: "python" input: "x"', "pbtxt", 'line 1, column 26: Expected "{"'),
        (
            'backend: "python" model_warmup { inputs { key: "x" value { input_data_file: "../f" } }'
            " }",
            "warmup[0].inputs.x",
            "a file name in the model's warmup folder",
        ),
        (
            'backend: "python" model_warmup { inputs { key: "x" value { zero_data: false } } }',
            "model_warmup[0].inputs.x",
            "zero_data, random_data or input_data_file",
        ),
        ('backend: "python"\nmax_batch_size: {', "pbtxt", "line 2, column 17"),
        ('backend: "python" version_policy { }', "version_policy", "exactly one"),
    ],
)
def test_pbtxt_errors_name_the_field(text: str, field: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_pbtxt_config(text, path="r/m/config.pbtxt", folder="m")
    assert info.value.path == "r/m/config.pbtxt"
    assert info.value.field == field
    assert fragment in info.value.problem


def test_check_warmup_inputs_after_inputs_are_known() -> None:
    config = parse_yaml_config("backend: onnx\nwarmup: [{inputs: {x: zero}}]", path="c", folder="m")
    check_warmup_inputs(config)  # no inputs known: nothing to check against
    from dataclasses import replace

    with pytest.raises(ConfigError, match="no input named 'x'"):
        check_warmup_inputs(replace(config, inputs=(TensorSpec("y", "FP32", (1,)),)))


def test_triton_ensemble_and_response_cache_from_pbtxt(tmp_path: Path) -> None:
    folder = tmp_path / "pipe"
    folder.mkdir()
    (folder / "config.pbtxt").write_text(
        """
        name: "pipe"
        platform: "ensemble"
        max_batch_size: 8
        input [{ name: "text" data_type: TYPE_STRING dims: [1] }]
        output [{ name: "embedding" data_type: TYPE_FP32 dims: [384] }]
        response_cache { enable: true }
        ensemble_scheduling {
          step [
            {
              model_name: "tokenizer"
              model_version: -1
              input_map { key: "text" value: "text" }
              output_map { key: "input_ids" value: "ids" }
            },
            {
              model_name: "encoder"
              model_version: 2
              input_map { key: "input_ids" value: "ids" }
              output_map { key: "embedding" value: "embedding" }
            }
          ]
        }
        """
    )
    config = load_model_config(folder)
    assert config.backend == "ensemble" and config.response_cache.enable
    first, second = config.ensemble
    assert (first.model, first.version, first.input_map) == ("tokenizer", None, {"text": "text"})
    assert (second.model, second.version, second.output_map) == (
        "encoder",
        2,
        {"embedding": "embedding"},
    )


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("backend: python\nresponse_cache: {enable: true, ttl_s: 0}\n", "response_cache.ttl_s"),
        ("backend: python\nresponse_cache: {enabled: true}\n", "response_cache.enabled"),
        ("backend: cascade\ncascade: {models: [a]}\n", "cascade.models"),
        ("backend: cascade\ncascade: {models: [a, b]}\n", "cascade"),
        (
            "backend: cascade\ncascade: {models: [a, b], confidence_output: p, threshold: 2}\n",
            "cascade.threshold",
        ),
        ("backend: ensemble\n", "ensemble"),
        ("backend: python\nfallback: [{model: m}]\n", "fallback[0].model"),
        ("backend: python\nfallback: [{cache: true, static: {y: 1}}]\n", "fallback[0]"),
    ],
)
def test_composition_config_errors_name_the_field(tmp_path: Path, text: str, field: str) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.yaml").write_text(text)
    with pytest.raises(ConfigError) as info:
        load_model_config(folder)
    assert info.value.field == field


def test_decoupled_in_yaml_is_for_the_python_backend_only() -> None:
    text = (
        "backend: python\nmodel_transaction_policy: {decoupled: true}\nmax_buffered_responses: 4\n"
    )
    config = parse_yaml_config(text, path="s/config.yaml", folder="s")
    assert config.decoupled and config.max_buffered_responses == 4
    with pytest.raises(ConfigError, match=r"model_transaction_policy\.decoupled.*cannot be"):
        parse_yaml_config(text.replace("python", "sklearn"), path="s/config.yaml", folder="s")
    with pytest.raises(ConfigError, match="max_buffered_responses"):
        parse_yaml_config(text.replace(": 4", ": 0"), path="s/config.yaml", folder="s")
    with pytest.raises(ConfigError, match=r"model_transaction_policy\.streaming"):
        bad = "backend: python\nmodel_transaction_policy: {streaming: true}\n"
        parse_yaml_config(bad, path="s/config.yaml", folder="s")
