"""KServe v2 metadata, Triton's model configuration and statistics extensions, as documents.

Each function returns the document as plain data (dicts, lists, strings, numbers): REST
encodes it as JSON, and gRPC fills the matching protobuf message from the same document, so
both protocols answer from one source.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from lockgate.config import (
    EnsembleStep,
    ModelConfig,
    TensorSpec,
    VersionPolicyKind,
    WarmupSample,
)
from lockgate.datatypes import config_datatype

Document = dict[str, Any]


def encode(document: Document | list[Any]) -> bytes:
    """A document as JSON bytes."""
    return msgspec.json.encode(document)


# --- metadata -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Runtime:
    """How Triton names a model's runtime: its backend, and for some its platform."""

    backend: str
    platform: str = ""


def server_metadata(*, name: str, version: str, extensions: Sequence[str]) -> Document:
    """GET /v2: {"name", "version", "extensions"}."""
    return {"name": name, "version": version, "extensions": list(extensions)}


def model_metadata(config: ModelConfig, versions: Sequence[int], runtime: Runtime) -> Document:
    """GET /v2/models/{m}: shapes carry -1 for the batch dim when the model batches."""
    batch = [-1] if config.batching else []
    return {
        "name": config.name,
        "versions": [str(v) for v in versions],
        "platform": runtime.platform or runtime.backend,
        "inputs": [_tensor_metadata(spec, batch) for spec in config.inputs],
        "outputs": [_tensor_metadata(spec, batch) for spec in config.outputs],
    }


def _tensor_metadata(spec: TensorSpec, batch: list[int]) -> dict[str, Any]:
    return {"name": spec.name, "datatype": spec.datatype, "shape": [*batch, *spec.dims]}


def model_config(config: ModelConfig, runtime: Runtime) -> Document:
    """GET /v2/models/{m}/config, in the JSON form of Triton's model_config.proto."""
    doc: dict[str, Any] = {
        "name": config.name,
        "platform": runtime.platform,
        "backend": runtime.backend,
        "version_policy": _version_policy(config),
        "max_batch_size": config.max_batch_size,
        "input": [_config_input(spec) for spec in config.inputs],
        "output": [_config_output(spec) for spec in config.outputs],
        "instance_group": [_instance_group(config)],
        "default_model_filename": config.default_model_filename,
        "parameters": _parameters(config),
        "model_warmup": [_warmup(config, sample) for sample in config.warmup],
        "model_transaction_policy": {"decoupled": config.decoupled},
    }
    if config.dynamic_batching is not None:
        doc["dynamic_batching"] = _dynamic_batching(config)
    if config.sequence_batching is not None:
        doc["sequence_batching"] = config.sequence_batching.document()
    if config.response_cache.enable:
        doc["response_cache"] = {"enable": True}
    if config.ensemble:
        doc["ensemble_scheduling"] = {"step": [_ensemble_step(step) for step in config.ensemble]}
    return doc


def _parameters(config: ModelConfig) -> dict[str, Any]:
    """The backend's parameters, and a decoupled model's bound on waiting responses, which
    Triton's schema lacks (a config.pbtxt gives it as a parameter, and reads it back so)."""
    parameters = {key: {"string_value": value} for key, value in config.parameters.items()}
    if config.decoupled:
        bound = str(config.max_buffered_responses)
        parameters["max_buffered_responses"] = {"string_value": bound}
    return parameters


def _ensemble_step(step: EnsembleStep) -> dict[str, Any]:
    return {
        "model_name": step.model,
        "model_version": -1 if step.version is None else step.version,
        "input_map": dict(step.input_map),
        "output_map": dict(step.output_map),
    }


def _version_policy(config: ModelConfig) -> dict[str, Any]:
    policy = config.version_policy
    if policy.kind is VersionPolicyKind.ALL:
        return {"all": {}}
    if policy.kind is VersionPolicyKind.SPECIFIC:
        return {"specific": {"versions": list(policy.versions)}}
    return {"latest": {"num_versions": policy.num_versions}}


def _config_input(spec: TensorSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "data_type": config_datatype(spec.datatype),
        "format": "FORMAT_NONE",
        "dims": list(spec.dims),
        **_reshape(spec),
        "is_shape_tensor": False,
        "allow_ragged_batch": spec.allow_ragged_batch,
        "optional": spec.optional,
    }


def _config_output(spec: TensorSpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "data_type": config_datatype(spec.datatype),
        "dims": list(spec.dims),
        **_reshape(spec),
        "label_filename": spec.label_filename,
        "is_shape_tensor": False,
    }


def _reshape(spec: TensorSpec) -> dict[str, Any]:
    """Triton lists `reshape` only when the config gives one."""
    return {} if spec.reshape is None else {"reshape": {"shape": list(spec.reshape)}}


def _instance_group(config: ModelConfig) -> dict[str, Any]:
    return {
        "name": config.name,
        "kind": "KIND_CPU",
        "count": config.instance_count,
        "gpus": [],
        "secondary_devices": [],
        "profile": [],
        "passive": False,
        "host_policy": "",
    }


def _dynamic_batching(config: ModelConfig) -> dict[str, Any]:
    batcher = config.batcher
    return {
        "preferred_batch_size": list(batcher.preferred_batch_sizes),
        "max_queue_delay_microseconds": batcher.max_queue_delay_us,
        "preserve_ordering": False,
        "priority_levels": batcher.priority_levels,
        "default_priority_level": batcher.default_priority_level,
        "default_queue_policy": {
            "timeout_action": "REJECT",
            "default_timeout_microseconds": batcher.default_timeout_us,
            "allow_timeout_override": True,
            "max_queue_size": batcher.max_queue_size,
        },
        "priority_queue_policy": {},
    }


def _warmup(config: ModelConfig, sample: WarmupSample) -> dict[str, Any]:
    inputs: dict[str, Any] = {}
    for spec in config.inputs:
        kind = sample.inputs.get(spec.name, "zero")
        data: dict[str, Any] = {"zero_data": True}
        if kind == "random":
            data = {"random_data": True}
        elif kind.startswith("file:"):
            data = {"input_data_file": kind.removeprefix("file:")}
        inputs[spec.name] = {
            "data_type": config_datatype(spec.datatype),
            "dims": list(spec.dims),
            **data,
        }
    return {
        "name": sample.name,
        "batch_size": sample.batch_size,
        "inputs": inputs,
        "count": sample.count,
    }


# --- statistics ---------------------------------------------------------------------------


@dataclass(slots=True)
class Duration:
    """A count of events and their total time, as Triton's StatisticDuration."""

    count: int = 0
    ns: int = 0


@dataclass(slots=True)
class BatchStats:
    batch_size: int
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(slots=True)
class ModelStats:
    """One model version's numbers for GET /v2/models/{m}/stats."""

    name: str
    version: str
    last_inference_ms: int = 0  # ms since the epoch
    inference_count: int = 0  # rows inferred
    execution_count: int = 0  # model executions (batches)
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)
    batch_stats: list[BatchStats] = field(default_factory=list)


_INFERENCE_PHASES = (
    "success",
    "fail",
    "queue",
    "compute_input",
    "compute_infer",
    "compute_output",
    "cache_hit",
    "cache_miss",
)


def model_statistics(stats: Sequence[ModelStats]) -> Document:
    """{"model_stats": [...]} in the form of Triton's statistics extension."""
    return {"model_stats": [_model_stats(s) for s in stats]}


def _model_stats(stats: ModelStats) -> dict[str, Any]:
    return {
        "name": stats.name,
        "version": stats.version,
        "last_inference": stats.last_inference_ms,
        "inference_count": stats.inference_count,
        "execution_count": stats.execution_count,
        "inference_stats": {phase: _duration(getattr(stats, phase)) for phase in _INFERENCE_PHASES},
        "batch_stats": [
            {
                "batch_size": batch.batch_size,
                "compute_input": _duration(batch.compute_input),
                "compute_infer": _duration(batch.compute_infer),
                "compute_output": _duration(batch.compute_output),
            }
            for batch in stats.batch_stats
        ],
    }


def _duration(duration: Duration) -> dict[str, int]:
    return {"count": duration.count, "ns": duration.ns}
