"""v2 metadata, model configuration and statistics documents."""

from __future__ import annotations

import pytest

from lockgate.config import (
    DynamicBatching,
    ModelConfig,
    TensorSpec,
    VersionPolicy,
    VersionPolicyKind,
    WarmupSample,
)
from lockgate.protocol.v2_metadata import (
    BatchStats,
    Duration,
    ModelStats,
    Runtime,
    model_config,
    model_metadata,
    model_statistics,
    server_metadata,
)

# --- metadata -------------------------------------------------------------------------------


ONNX = Runtime("onnxruntime", "onnxruntime_onnx")


def _config(max_batch_size: int = 8) -> ModelConfig:
    return ModelConfig(
        name="digits",
        backend="onnx",
        max_batch_size=max_batch_size,
        inputs=(TensorSpec("x", "FP32", (64,)), TensorSpec("mask", "BYTES", (-1,), optional=True)),
        outputs=(TensorSpec("label", "INT64", ()), TensorSpec("p", "FP32", (10,))),
        dynamic_batching=DynamicBatching(
            max_queue_delay_us=500, preferred_batch_sizes=(4, 8), default_timeout_us=2000
        ),
        instance_count=2,
        version_policy=VersionPolicy(VersionPolicyKind.SPECIFIC, versions=(1, 3)),
        warmup=(WarmupSample("w", batch_size=2, inputs={"x": "random"}),),
        parameters={"intra_op_threads": "1"},
        default_model_filename="model.onnx",
    )


def test_server_metadata() -> None:
    doc = server_metadata(name="lockgate", version="0.1.0", extensions=["a"])
    assert doc == {"name": "lockgate", "version": "0.1.0", "extensions": ["a"]}


@pytest.mark.parametrize(("max_batch_size", "batch"), [(8, [-1]), (0, [])])
def test_model_metadata(max_batch_size: int, batch: list[int]) -> None:
    doc = model_metadata(_config(max_batch_size), [3, 1], ONNX)
    assert doc["name"] == "digits" and doc["versions"] == ["3", "1"]
    assert doc["platform"] == "onnxruntime_onnx"
    assert doc["inputs"][0] == {"name": "x", "datatype": "FP32", "shape": [*batch, 64]}
    assert doc["inputs"][1]["shape"] == [*batch, -1]
    assert doc["outputs"][0] == {"name": "label", "datatype": "INT64", "shape": batch}


def test_model_config_matches_triton_field_names() -> None:
    doc = model_config(_config(), ONNX)
    assert doc["name"] == "digits" and doc["max_batch_size"] == 8
    assert doc["platform"] == "onnxruntime_onnx" and doc["backend"] == "onnxruntime"
    assert doc["version_policy"] == {"specific": {"versions": [1, 3]}}
    assert doc["input"][0]["data_type"] == "TYPE_FP32" and doc["input"][0]["dims"] == [64]
    assert doc["input"][1]["data_type"] == "TYPE_STRING" and doc["input"][1]["optional"] is True
    assert doc["output"][0] == {
        "name": "label",
        "data_type": "TYPE_INT64",
        "dims": [],
        "label_filename": "",
        "is_shape_tensor": False,
    }
    batching = doc["dynamic_batching"]
    assert batching["preferred_batch_size"] == [4, 8]
    assert batching["max_queue_delay_microseconds"] == 500
    assert batching["default_queue_policy"]["default_timeout_microseconds"] == 2000
    assert doc["instance_group"][0]["kind"] == "KIND_CPU" and doc["instance_group"][0]["count"] == 2
    assert doc["parameters"] == {"intra_op_threads": {"string_value": "1"}}
    warm = doc["model_warmup"][0]
    assert warm["batch_size"] == 2 and warm["inputs"]["x"]["random_data"] is True
    assert warm["inputs"]["mask"]["zero_data"] is True
    assert doc["model_transaction_policy"] == {"decoupled": False}


def test_model_config_without_batcher() -> None:
    config = ModelConfig(name="p", backend="python")
    doc = model_config(config, Runtime("python"))
    assert "dynamic_batching" not in doc
    assert doc["platform"] == "" and doc["backend"] == "python"
    assert doc["version_policy"] == {"latest": {"num_versions": 1}}


def test_model_statistics() -> None:
    stats = ModelStats(
        name="digits",
        version="1",
        last_inference_ms=1700,
        inference_count=10,
        execution_count=4,
        success=Duration(10, 5000),
        queue=Duration(10, 700),
        batch_stats=[BatchStats(4, compute_infer=Duration(2, 300))],
    )
    doc = model_statistics([stats])
    model = doc["model_stats"][0]
    assert model["name"] == "digits" and model["version"] == "1"
    assert model["last_inference"] == 1700
    assert model["inference_count"] == 10 and model["execution_count"] == 4
    assert model["inference_stats"]["success"] == {"count": 10, "ns": 5000}
    assert model["inference_stats"]["fail"] == {"count": 0, "ns": 0}
    assert set(model["inference_stats"]) >= {
        "success",
        "fail",
        "queue",
        "compute_input",
        "compute_infer",
        "compute_output",
    }
    assert model["batch_stats"] == [
        {
            "batch_size": 4,
            "compute_input": {"count": 0, "ns": 0},
            "compute_infer": {"count": 2, "ns": 300},
            "compute_output": {"count": 0, "ns": 0},
        }
    ]


def test_a_reshape_reaches_the_grpc_model_config() -> None:
    """Triton's ModelConfig over gRPC carries an input's and an output's reshape."""
    from lockgate.protocol.grpc import codec
    from lockgate.protocol.grpc import inference_pb2 as pb

    document = {
        "name": "m",
        "input": [
            {"name": "x", "data_type": "TYPE_FP32", "dims": [8, 8], "reshape": {"shape": [64]}}
        ],
        "output": [{"name": "y", "data_type": "TYPE_INT64", "dims": [1], "reshape": {"shape": []}}],
    }
    config = codec.from_document(document, pb.ModelConfig())
    assert list(config.input[0].reshape.shape) == [64]
    assert config.output[0].HasField("reshape") and list(config.output[0].reshape.shape) == []
