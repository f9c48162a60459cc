"""Model configuration: the typed form of `config.yaml` or Triton's `config.pbtxt`.

Parsing lives in `lockgate/core/`: `config_files.py` (YAML), `config_triton.py` (config.pbtxt)
and `config_reader.py` (the one validating reader). This module holds only the types and their
validation, so every other package shares one vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from lockgate.errors import ConfigError

# KServe v2 datatypes.
DATATYPES = (
    "BOOL",
    "UINT8",
    "UINT16",
    "UINT32",
    "UINT64",
    "INT8",
    "INT16",
    "INT32",
    "INT64",
    "FP16",
    "FP32",
    "FP64",
    "BF16",
    "BYTES",
)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One input or output. `dims` excludes the batch dim when max_batch_size > 0; -1: any.
    `reshape` (Triton's): the shape the model itself takes or gives, batch dim excluded, where
    clients send or get `dims`; None: the same as `dims`."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None
    label_filename: str = ""  # an output's class names, a line each, in the model folder
    # an input whose shape may differ between the requests of a batch (Triton's), for a
    # model that takes each request on its own: a Triton Python model
    allow_ragged_batch: bool = False


@dataclass(frozen=True, slots=True)
class DynamicBatching:
    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int = 1024  # bounded by default: a full queue answers 503 at once
    default_timeout_us: int = 0  # 0: no default deadline
    priority_levels: int = 1
    default_priority_level: int = 0  # 0 means "the lowest level" (priority_levels)


class SequenceStrategy(Enum):
    OLDEST = "oldest"
    DIRECT = "direct"  # served by the same scheduler as OLDEST


class SequenceControlKind(Enum):
    START = "CONTROL_SEQUENCE_START"
    END = "CONTROL_SEQUENCE_END"
    READY = "CONTROL_SEQUENCE_READY"
    CORRID = "CONTROL_SEQUENCE_CORRID"


@dataclass(frozen=True, slots=True)
class SequenceControl:
    """A control input (Triton's `control_input`): the model input `name` gets, for each row,
    `false_true[0]` or `false_true[1]` (START, END, READY), or the sequence's correlation id
    (CORRID), as `datatype`."""

    kind: SequenceControlKind
    name: str
    datatype: str  # INT32, FP32 or BOOL for a flag; UINT64, INT64, UINT32, INT32 or BYTES
    false_true: tuple[float, float] = (0, 1)


@dataclass(frozen=True, slots=True)
class SequenceState:
    """An implicit state (Triton's `state`): the model's output `output_name` for one request
    of a sequence is its input `input_name` for the next; the first request gets zeros of
    `initial_dims`. `dims` exclude the batch dimension; -1: any."""

    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]
    initial_dims: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SequenceBatching:
    """`sequence_batching`: a stateful model. Each request carries a sequence id; the requests
    of one sequence run in arrival order, at most one per batch, with the control inputs and
    the implicit state added to its row."""

    strategy: SequenceStrategy = SequenceStrategy.DIRECT
    max_sequence_idle_us: int = 1_000_000  # Triton's default: 1 s
    max_candidate_sequences: int = 0  # oldest: live sequences per instance; 0: the server's
    max_queue_delay_us: int = 0
    preferred_batch_sizes: tuple[int, ...] = ()
    controls: tuple[SequenceControl, ...] = ()
    states: tuple[SequenceState, ...] = ()

    def control(self, kind: SequenceControlKind) -> SequenceControl | None:
        for control in self.controls:
            if control.kind is kind:
                return control
        return None

    def document(self) -> dict[str, Any]:
        """Triton's JSON form (`GET /v2/models/{m}/config`, a Python model's `model_config`),
        which `config.yaml` takes too."""
        strategy: dict[str, Any] = {"max_queue_delay_microseconds": self.max_queue_delay_us}
        if self.strategy is SequenceStrategy.OLDEST:
            strategy["max_candidate_sequences"] = self.max_candidate_sequences
            strategy["preferred_batch_size"] = list(self.preferred_batch_sizes)
        return {
            "max_sequence_idle_microseconds": self.max_sequence_idle_us,
            self.strategy.value: strategy,
            "control_input": [
                {"name": c.name, "control": [_control_document(c)]} for c in self.controls
            ],
            "state": [
                {
                    "input_name": s.input_name,
                    "output_name": s.output_name,
                    "data_type": _triton_type(s.datatype),
                    "dims": list(s.dims),
                    "initial_state": [
                        {
                            "name": "zeros",
                            "data_type": _triton_type(s.datatype),
                            "dims": list(s.initial_dims),
                            "zero_data": True,
                        }
                    ],
                }
                for s in self.states
            ],
        }


def _control_document(control: SequenceControl) -> dict[str, Any]:
    doc: dict[str, Any] = {"kind": control.kind.value}
    if control.kind is SequenceControlKind.CORRID:
        doc["data_type"] = _triton_type(control.datatype)
    elif control.datatype == "INT32":
        doc["int32_false_true"] = [int(v) for v in control.false_true]
    elif control.datatype == "BOOL":
        doc["bool_false_true"] = [bool(v) for v in control.false_true]
    else:
        doc["fp32_false_true"] = list(control.false_true)
    return doc


def _triton_type(datatype: str) -> str:
    return "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"


class VersionPolicyKind(Enum):
    LATEST = "latest"
    ALL = "all"
    SPECIFIC = "specific"


@dataclass(frozen=True, slots=True)
class VersionPolicy:
    kind: VersionPolicyKind = VersionPolicyKind.LATEST
    num_versions: int = 1  # for LATEST
    versions: tuple[int, ...] = ()  # for SPECIFIC

    def select(self, available: list[int]) -> list[int]:
        """The versions to serve, newest first."""
        ordered = sorted(available, reverse=True)
        if self.kind is VersionPolicyKind.ALL:
            return ordered
        if self.kind is VersionPolicyKind.SPECIFIC:
            return [v for v in ordered if v in self.versions]
        return ordered[: self.num_versions]


@dataclass(frozen=True, slots=True)
class WarmupSample:
    """A warmup request: `batch_size` rows of each input, zeros, random or given data."""

    name: str
    batch_size: int = 1
    count: int = 1
    inputs: dict[str, str] = field(default_factory=dict)  # input name -> "zero" | "random"


@dataclass(frozen=True, slots=True)
class ResponseCacheConfig:
    """`response_cache`: answers kept by a hash of the request, in the process and in Redis."""

    enable: bool = False
    ttl_s: float | None = None  # None: kept until evicted
    max_bytes: int = 64 * 2**20  # the in-process tier's bound for this model version
    coalesce: bool = True  # identical requests in flight at once run once
    redis: bool = True  # also use the server's Redis tier, when one is configured


@dataclass(frozen=True, slots=True)
class EnsembleStep:
    """One step of an ensemble: a model, and the maps between its tensors and the ensemble's."""

    model: str
    version: int | None = None  # None: the model's default version
    input_map: dict[str, str] = field(default_factory=dict)  # step input -> ensemble tensor
    output_map: dict[str, str] = field(default_factory=dict)  # step output -> ensemble tensor


@dataclass(frozen=True, slots=True)
class CascadeConfig:
    """`cascade`: models from cheapest to largest. A row goes on to the next model when its
    confidence (the largest value of `confidence_output` in the row) is below `threshold`, or
    when the `rule` function ("file.py:function" in the model folder) says so."""

    models: tuple[str, ...]
    confidence_output: str = ""
    threshold: float = 0.0
    rule: str = ""


class FallbackKind(Enum):
    MODEL = "model"  # a cheaper model with the same inputs and outputs
    CACHE = "cache"  # the response cache, stale entries included
    STATIC = "static"  # fixed outputs, one row value per output


@dataclass(frozen=True, slots=True)
class Fallback:
    """One way to answer when the model cannot in time. `fallback` lists them in order."""

    kind: FallbackKind
    model: str = ""
    static: dict[str, list[object]] = field(default_factory=dict)  # output -> one row's value


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    backend: str
    max_batch_size: int = 0  # 0: the model takes no batch dimension; requests are not batched
    inputs: tuple[TensorSpec, ...] = ()
    outputs: tuple[TensorSpec, ...] = ()
    dynamic_batching: DynamicBatching | None = None
    latency_slo_ms: float | None = None
    # admit a request when its predicted answer is within this share of its deadline (None:
    # the server's default, 0.8); the rest pays for the network and the HTTP layer
    admission_slack: float | None = None
    instance_count: int = 1
    version_policy: VersionPolicy = VersionPolicy()
    warmup: tuple[WarmupSample, ...] = ()
    parameters: dict[str, str] = field(default_factory=dict)  # backend-specific settings
    default_model_filename: str = ""
    response_cache: ResponseCacheConfig = ResponseCacheConfig()
    ensemble: tuple[EnsembleStep, ...] = ()  # backend "ensemble"
    cascade: CascadeConfig | None = None  # backend "cascade"
    fallback: tuple[Fallback, ...] = ()
    # Triton's `model_transaction_policy { decoupled: true }`: each request answered by a
    # stream of responses (a Triton Python model only), of which at most
    # `max_buffered_responses` wait for a slow client before the model's sends wait
    decoupled: bool = False
    max_buffered_responses: int = 64
    sequence_batching: SequenceBatching | None = None  # a stateful model (Triton's)
    source: str = ""  # the file this config came from, for error messages

    def __post_init__(self) -> None:
        if self.decoupled and self.response_cache.enable:  # as Triton refuses it
            raise ConfigError(
                self.source or self.name,
                "response_cache",
                "the response cache does not support decoupled models "
                "(model_transaction_policy { decoupled: true }): each request is answered by "
                "a stream of responses, not one answer to keep; disable response_cache",
            )

    def input(self, name: str) -> TensorSpec | None:
        for spec in self.inputs:
            if spec.name == name:
                return spec
        return None

    def output(self, name: str) -> TensorSpec | None:
        for spec in self.outputs:
            if spec.name == name:
                return spec
        return None

    @property
    def batching(self) -> bool:
        return self.max_batch_size > 0

    @property
    def reshapes(self) -> bool:
        """Some input or output has a `reshape`: the model sees other shapes than clients."""
        return any(spec.reshape is not None for spec in (*self.inputs, *self.outputs))

    @property
    def runs(self) -> tuple[tuple[str, int | None], ...]:
        """The models a composition runs, as (model, version; None: its default): an
        ensemble's steps, then a cascade's models. Empty for any other model."""
        steps = tuple((step.model, step.version) for step in self.ensemble)
        if self.cascade is not None:
            steps += tuple((model, None) for model in self.cascade.models)
        return steps

    @property
    def batcher(self) -> DynamicBatching:
        """The batcher's settings; a sequence model's come from its `oldest` or `direct`."""
        sequences = self.sequence_batching
        if sequences is not None:
            return DynamicBatching(
                max_queue_delay_us=sequences.max_queue_delay_us,
                preferred_batch_sizes=sequences.preferred_batch_sizes,
            )
        return self.dynamic_batching or DynamicBatching()
