"""The one validating reader of model configs: a mapping with the keys of `config.yaml` into a
`ModelConfig`. `config_files.py` reads YAML into such a mapping; `config_triton.py` translates
Triton's `config.pbtxt` into one. Every problem raises
`ConfigError(path, field, problem)`; `field` is a dotted path such as `inputs[0].dims`.

A `config.yaml` (every key but `backend` is optional):

    name: digits                 # must equal the folder name
    backend: onnxruntime         # onnxruntime | onnx | sklearn | python | pytorch | torch
    max_batch_size: 64           # 0: the model takes no batch dimension
    inputs:  [{name: input, datatype: FP32, dims: [64]}]
    outputs: [{name: label, datatype: INT64, dims: [1]}]
    dynamic_batching: {max_queue_delay_us: 500, preferred_batch_sizes: [8, 16]}
    latency_slo_ms: 20
    instance_count: 1
    version_policy: {latest: {num_versions: 1}}
    warmup: [{name: zeros, batch_size: 8, count: 2, inputs: {input: zero}}]
    parameters: {intra_op_threads: 1}
    response_cache: {enable: true, ttl_s: 300, max_bytes: 67108864, coalesce: true, redis: true}
    fallback: [{model: digits_small}, {cache: true}, {static: {label: -1}}]
    model_transaction_policy: {decoupled: true}   # a Triton Python model that streams
    max_buffered_responses: 64   # a decoupled model's responses waiting for a slow client

A stateful model (Triton's `sequence_batching`, in the keys of Triton's JSON form; instead of
`dynamic_batching`):

    sequence_batching:
      max_sequence_idle_microseconds: 1000000
      oldest: {max_candidate_sequences: 64, preferred_batch_size: [8]}
      control_input:
        - {name: START, control: [{kind: CONTROL_SEQUENCE_START, int32_false_true: [0, 1]}]}
        - {name: CORRID, control: [{kind: CONTROL_SEQUENCE_CORRID, data_type: TYPE_UINT64}]}
      state:
        - {input_name: STATE_IN, output_name: STATE_OUT, data_type: TYPE_FP32, dims: [4]}

Compositions (`backend: ensemble` or `backend: cascade`):

    ensemble:                    # or Triton's ensemble_scheduling: {step: [...]}
      - {model: tokenizer, input_map: {text: text}, output_map: {input_ids: ids}}
      - {model: encoder, input_map: {input_ids: ids}, output_map: {embedding: embedding}}
    cascade: {models: [small, large], confidence_output: probabilities, threshold: 0.9}
    cascade: {models: [small, large], rule: "rule.py:escalate"}   # or a function of yours

Unknown keys are errors in `config.yaml` (a typo must not pass silently). In
`config.pbtxt`, fields that Triton knows and lockgate does not use (optimization, ...) are
ignored with a warning.

A warmup sample with no `inputs` means zeros for every input.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from lockgate.backends.base import backend_names
from lockgate.config import (
    DATATYPES,
    CascadeConfig,
    DynamicBatching,
    EnsembleStep,
    Fallback,
    FallbackKind,
    ModelConfig,
    ResponseCacheConfig,
    SequenceBatching,
    SequenceControl,
    SequenceControlKind,
    SequenceState,
    SequenceStrategy,
    TensorSpec,
    VersionPolicy,
    VersionPolicyKind,
    WarmupSample,
)
from lockgate.datatypes import normalize_datatype
from lockgate.errors import ConfigError

log = logging.getLogger(__name__)


_TOP_LEVEL = frozenset(
    {
        "name",
        "backend",
        "max_batch_size",
        "input",
        "inputs",
        "output",
        "outputs",
        "dynamic_batching",
        "latency_slo_ms",
        "admission_slack",
        "instance_count",
        "instance_group",
        "version_policy",
        "warmup",
        "parameters",
        "default_model_filename",
        "response_cache",
        "ensemble",
        "ensemble_scheduling",
        "cascade",
        "fallback",
        "model_transaction_policy",
        "max_buffered_responses",
        "sequence_batching",
    }
)
_TENSOR_KEYS = frozenset(
    {
        "name",
        "datatype",
        "data_type",
        "dims",
        "optional",
        "reshape",
        "label_filename",
        "allow_ragged_batch",
    }
)
_BATCHING_KEYS = frozenset(
    {
        "max_queue_delay_us",
        "preferred_batch_sizes",
        "max_queue_size",
        "default_timeout_us",
        "priority_levels",
        "default_priority_level",
    }
)
_CACHE_KEYS = frozenset({"enable", "ttl_s", "max_bytes", "coalesce", "redis"})
_STEP_KEYS = frozenset(
    {"model", "model_name", "version", "model_version", "input_map", "output_map"}
)
_CASCADE_KEYS = frozenset({"models", "confidence_output", "threshold", "rule"})
_SEQUENCE_KEYS = frozenset(
    {"max_sequence_idle_microseconds", "control_input", "state", "oldest", "direct"}
)
_OLDEST_KEYS = frozenset(
    {
        "max_candidate_sequences",
        "preferred_batch_size",
        "max_queue_delay_microseconds",
        "preserve_ordering",
    }
)
_DIRECT_KEYS = frozenset({"max_queue_delay_microseconds", "minimum_slot_utilization"})
_CONTROL_KEYS = frozenset(
    {"kind", "int32_false_true", "fp32_false_true", "bool_false_true", "data_type"}
)
_FLAG_VALUES = {"int32_false_true": "INT32", "fp32_false_true": "FP32", "bool_false_true": "BOOL"}
_CORRID_TYPES = ("UINT64", "INT64", "UINT32", "INT32", "BYTES")
_STATEFUL_BACKENDS = ("python", "onnxruntime", "onnx")  # they take inputs and give outputs by name
_STATE_KEYS = frozenset(
    {
        "input_name",
        "output_name",
        "data_type",
        "dims",
        "initial_state",
        "use_same_buffer_for_input_output",
        "use_growable_memory",
    }
)
_INITIAL_STATE_KEYS = frozenset({"data_type", "dims", "zero_data", "data_file", "name"})
_WARMUP_KEYS = frozenset({"name", "batch_size", "count", "inputs"})
_WARMUP_KINDS = ("zero", "random")
_SAFE_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a warmup file: one plain name
_DEFAULT_BATCHING = DynamicBatching()
_INSTANCE_KINDS = ("KIND_AUTO", "KIND_CPU", "KIND_GPU", "KIND_MODEL")
# bounds on what a config may ask for, a load request's override included: each instance is a
# thread and a copy of the model, and warmup and profiling build batches of max_batch_size rows
MAX_INSTANCES = 256
MAX_BATCH_SIZE = 1 << 20


def config_from_dict(raw: Mapping[str, Any], *, path: str, folder: str) -> ModelConfig:
    """Validate a mapping with the keys of `config.yaml` and build the ModelConfig."""
    return _Reader(path).config(raw, folder)


def check_warmup_inputs(config: ModelConfig) -> None:
    """Every warmup input must name a declared input (call once inputs are known)."""
    if config.inputs:
        _check_warmup(config.inputs, config.warmup, config.source)


def _check_warmup(
    inputs: tuple[TensorSpec, ...], warmup: tuple[WarmupSample, ...], source: str
) -> None:
    declared = {spec.name for spec in inputs}
    for index, sample in enumerate(warmup):
        for name in sample.inputs:
            if name not in declared:
                field = f"warmup[{index}].inputs.{name}"
                raise ConfigError(source, field, f"no input named '{name}'")


class _Reader:
    """Typed access to a raw mapping; every failure names the file and the field."""

    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, field: str, problem: str) -> ConfigError:
        return ConfigError(self.path, field, problem)

    # -- scalars

    def integer(
        self, value: Any, field: str, minimum: int | None = None, maximum: int | None = None
    ) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(field, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.error(field, f"must be >= {minimum}, got {value}")
        if maximum is not None and value > maximum:
            raise self.error(field, f"must be <= {maximum}, got {value}")
        return value

    def number(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.error(field, f"expected a number, got {value!r}")
        if not math.isfinite(value):
            raise self.error(field, f"must be finite, got {value}")
        return float(value)

    def string(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.error(field, f"expected a non-empty string, got {value!r}")
        return value

    def boolean(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            raise self.error(field, f"expected true or false, got {value!r}")
        return value

    # -- containers

    def mapping(self, value: Any, field: str, allowed: frozenset[str]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.error(field, f"expected a mapping, got {type(value).__name__}")
        for key in value:
            if key not in allowed:
                raise self.error(_join(field, str(key)), f"unknown key; known: {_known(allowed)}")
        return value

    def items(self, value: Any, field: str) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            raise self.error(field, f"expected a list, got {type(value).__name__}")
        return value

    def listed(
        self, raw: Mapping[str, Any], key: str, read: Callable[[Any, str], Any], prefix: str = ""
    ) -> tuple[Any, ...]:
        """`raw[key]` as a list, each item read by `read(item, field)`."""
        field = _join(prefix, key)
        return tuple(
            read(item, f"{field}[{i}]") for i, item in enumerate(self.items(raw.get(key), field))
        )

    # -- the config

    def config(self, raw: Mapping[str, Any], folder: str) -> ModelConfig:
        self.mapping(dict(raw), "", _TOP_LEVEL)
        name = self.model_name(raw.get("name"), folder)
        max_batch_size = self.integer(
            raw.get("max_batch_size", 0), "max_batch_size", 0, MAX_BATCH_SIZE
        )
        inputs = self.tensors(raw, "input", "inputs")
        outputs = self.tensors(raw, "output", "outputs")
        batching = raw.get("dynamic_batching")
        sequences = self.sequence_batching(raw, max_batch_size, inputs)
        return ModelConfig(
            name=name,
            backend=self.backend(raw.get("backend")),
            max_batch_size=max_batch_size,
            inputs=inputs,
            outputs=outputs,
            dynamic_batching=self.dynamic_batching(batching, max_batch_size),
            latency_slo_ms=self.latency_slo(raw.get("latency_slo_ms")),
            admission_slack=self.admission_slack(raw.get("admission_slack")),
            instance_count=self.instance_count(raw),
            version_policy=self.version_policy(raw.get("version_policy")),
            warmup=self.warmup(raw.get("warmup"), inputs, max_batch_size),
            parameters=self.parameters(raw.get("parameters")),
            default_model_filename=self.filename(raw.get("default_model_filename")),
            response_cache=self.response_cache(raw.get("response_cache")),
            ensemble=self.ensemble(raw),
            cascade=self.cascade(raw.get("cascade")),
            fallback=self.fallback(raw.get("fallback"), name),
            decoupled=self.decoupled(raw),
            max_buffered_responses=self.integer(
                raw.get("max_buffered_responses", 64), "max_buffered_responses", 1, 1 << 16
            ),
            sequence_batching=sequences,
            source=self.path,
        )

    def model_name(self, value: Any, folder: str) -> str:
        if value is None:
            return folder
        name = self.string(value, "name")
        if name != folder:
            raise self.error("name", f"'{name}' does not match its folder name '{folder}'")
        return name

    def backend(self, value: Any) -> str:
        known = backend_names()
        if value is None:
            raise self.error("backend", f"missing; one of {', '.join(known)}")
        name = self.string(value, "backend")
        if name not in known:
            raise self.error("backend", f"unknown backend '{name}'; one of {', '.join(known)}")
        return name

    def tensors(self, raw: Mapping[str, Any], singular: str, plural: str) -> tuple[TensorSpec, ...]:
        if singular in raw and plural in raw:
            raise self.error(plural, f"give '{plural}' or '{singular}', not both")
        key = plural if plural in raw else singular
        specs = self.listed(raw, key, self.tensor)
        seen: set[str] = set()
        for index, spec in enumerate(specs):
            if spec.name in seen:
                raise self.error(f"{key}[{index}].name", f"duplicate name '{spec.name}'")
            seen.add(spec.name)
        return specs

    def tensor(self, value: Any, field: str) -> TensorSpec:
        raw = self.mapping(value, field, _TENSOR_KEYS)
        name = self.string(raw.get("name"), f"{field}.name")
        key = "data_type" if "data_type" in raw else "datatype"
        datatype = self.string(raw.get(key), f"{field}.{key}")
        normalized = normalize_datatype(datatype)
        if normalized is None:
            raise self.error(f"{field}.{key}", f"unknown datatype '{datatype}'; one of {DATATYPES}")
        dims = self.dims(raw.get("dims"), f"{field}.dims")
        reshape = raw.get("reshape")
        return TensorSpec(
            name=name,
            datatype=normalized,
            dims=dims,
            optional=self.boolean(raw.get("optional", False), f"{field}.optional"),
            reshape=None if reshape is None else self.reshape(reshape, dims, f"{field}.reshape"),
            label_filename=self.label_filename(
                raw.get("label_filename"), f"{field}.label_filename"
            ),
            allow_ragged_batch=self.boolean(
                raw.get("allow_ragged_batch", False), f"{field}.allow_ragged_batch"
            ),
        )

    def label_filename(self, value: Any, field: str) -> str:
        """A file of the model folder itself: no separator, not `..`."""
        if value is None:
            return ""
        name = self.string(value, field)
        if "/" in name or "\\" in name or name in (".", ".."):
            raise self.error(field, f"expected a file name in the model folder, got {name!r}")
        return name

    def reshape(self, value: Any, dims: tuple[int, ...], field: str) -> tuple[int, ...]:
        """Triton's `reshape`: as many elements as `dims`; a -1 in one needs a single -1 in
        each (it takes the elements the fixed dims leave)."""
        shape = self.dims(value, field)
        if -1 in dims or -1 in shape:
            if dims.count(-1) != 1 or shape.count(-1) != 1:
                problem = f"{list(shape)} for dims {list(dims)}: -1 once in each, or in neither"
                raise self.error(field, problem)
        elif math.prod(shape) != math.prod(dims):
            problem = f"{list(shape)} holds {math.prod(shape)} elements, dims {list(dims)} hold "
            raise self.error(field, problem + f"{math.prod(dims)}")
        return shape

    def dims(self, value: Any, field: str) -> tuple[int, ...]:
        if not isinstance(value, list):
            raise self.error(field, f"expected a list of integers >= -1, got {value!r}")
        for dim in value:
            if isinstance(dim, bool) or not isinstance(dim, int) or dim < -1:
                raise self.error(field, f"expected a list of integers >= -1, got {value!r}")
        return tuple(value)

    def dynamic_batching(self, value: Any, max_batch_size: int) -> DynamicBatching | None:
        if value is None or value is False:
            return None
        field = "dynamic_batching"
        raw = {} if value is True else self.mapping(value, field, _BATCHING_KEYS)
        if max_batch_size == 0:
            raise self.error(field, "needs max_batch_size > 0 (the model must take a batch)")
        preferred = self.listed(
            raw, "preferred_batch_sizes", lambda v, f: self.integer(v, f, 1), field
        )
        for size in preferred:
            if size > max_batch_size:
                problem = f"preferred batch size {size} exceeds max_batch_size {max_batch_size}"
                raise self.error(f"{field}.preferred_batch_sizes", problem)
        levels = self.integer(raw.get("priority_levels", 1), f"{field}.priority_levels", 1)
        default_level = self.integer(
            raw.get("default_priority_level", 0), f"{field}.default_priority_level", 0
        )
        if default_level > levels:
            problem = f"must be <= priority_levels ({levels}), got {default_level}"
            raise self.error(f"{field}.default_priority_level", problem)
        return DynamicBatching(
            max_queue_delay_us=self.integer(
                raw.get("max_queue_delay_us", 0), f"{field}.max_queue_delay_us", 0
            ),
            preferred_batch_sizes=tuple(sorted(set(preferred))),
            max_queue_size=self.integer(
                raw.get("max_queue_size", _DEFAULT_BATCHING.max_queue_size),
                f"{field}.max_queue_size",
                1,
            ),
            default_timeout_us=self.integer(
                raw.get("default_timeout_us", 0), f"{field}.default_timeout_us", 0
            ),
            priority_levels=levels,
            default_priority_level=default_level,
        )

    def latency_slo(self, value: Any) -> float | None:
        if value is None:
            return None
        slo = self.number(value, "latency_slo_ms")
        if slo <= 0:
            raise self.error("latency_slo_ms", f"must be > 0, got {value}")
        return slo

    def admission_slack(self, value: Any) -> float | None:
        if value is None:
            return None
        slack = self.number(value, "admission_slack")
        if not 0 < slack <= 1:
            raise self.error("admission_slack", f"must be in (0, 1], got {value}")
        return slack

    def instance_count(self, raw: Mapping[str, Any]) -> int:
        if "instance_count" in raw and "instance_group" in raw:
            raise self.error("instance_count", "give instance_count or instance_group, not both")
        if "instance_group" not in raw:
            return self.integer(raw.get("instance_count", 1), "instance_count", 1, MAX_INSTANCES)
        groups = self.listed(raw, "instance_group", self.instance_group)
        total = sum(groups) if groups else 1
        if total > MAX_INSTANCES:
            raise self.error(
                "instance_group", f"{total} instances in all, more than {MAX_INSTANCES}"
            )
        return total

    def instance_group(self, value: Any, field: str) -> int:
        raw = self.mapping(value, field, frozenset({"count", "kind", "name"}))
        kind = raw.get("kind", "KIND_CPU")
        if kind not in _INSTANCE_KINDS:
            raise self.error(f"{field}.kind", f"unknown kind {kind!r}; one of {_INSTANCE_KINDS}")
        if kind == "KIND_GPU":
            log.warning(
                "%s: %s.kind KIND_GPU: lockgate runs this group on the CPU", self.path, field
            )
        return self.integer(raw.get("count", 1), f"{field}.count", 1, MAX_INSTANCES)

    def version_policy(self, value: Any) -> VersionPolicy:
        if value is None:
            return VersionPolicy()
        field = "version_policy"
        raw = self.mapping(value, field, frozenset({"latest", "all", "specific"}))
        if len(raw) != 1:
            raise self.error(field, "give exactly one of latest, all, specific")
        ((kind, body),) = raw.items()
        if kind == "all":
            self.mapping(body, f"{field}.all", frozenset())
            return VersionPolicy(kind=VersionPolicyKind.ALL)
        if kind == "latest":
            latest = self.mapping(body, f"{field}.latest", frozenset({"num_versions"}))
            count = self.integer(latest.get("num_versions", 1), f"{field}.latest.num_versions", 1)
            return VersionPolicy(kind=VersionPolicyKind.LATEST, num_versions=count)
        specific = self.mapping(body, f"{field}.specific", frozenset({"versions"}))
        versions = self.listed(
            specific, "versions", lambda v, f: self.integer(v, f, 0), f"{field}.specific"
        )
        if not versions:
            raise self.error(f"{field}.specific.versions", "list at least one version")
        return VersionPolicy(kind=VersionPolicyKind.SPECIFIC, versions=tuple(versions))

    def warmup(
        self, value: Any, inputs: tuple[TensorSpec, ...], max_batch_size: int
    ) -> tuple[WarmupSample, ...]:
        samples = tuple(
            self.warmup_sample(item, f"warmup[{i}]", max_batch_size)
            for i, item in enumerate(self.items(value, "warmup"))
        )
        if inputs:
            _check_warmup(inputs, samples, self.path)
        return samples

    def warmup_sample(self, value: Any, field: str, max_batch_size: int) -> WarmupSample:
        raw = self.mapping(value, field, _WARMUP_KEYS)
        batch_size = self.integer(raw.get("batch_size", 1), f"{field}.batch_size", 1)
        if max_batch_size and batch_size > max_batch_size:
            problem = f"{batch_size} exceeds max_batch_size {max_batch_size}"
            raise self.error(f"{field}.batch_size", problem)
        kinds = self.mapping(raw.get("inputs"), f"{field}.inputs", _AnyKey())
        for name, kind in kinds.items():
            if isinstance(kind, str) and kind.startswith("file:"):
                filename = kind.removeprefix("file:")
                if not _SAFE_FILE.fullmatch(filename) or ".." in filename:
                    problem = f"a file name in the model's warmup folder, got {filename!r}"
                    raise self.error(f"{field}.inputs.{name}", problem)
            elif kind not in _WARMUP_KINDS:
                problem = f"expected one of {_WARMUP_KINDS} or 'file:<name>', got {kind!r}"
                raise self.error(f"{field}.inputs.{name}", problem)
        return WarmupSample(
            name=self.string(raw.get("name", field), f"{field}.name"),
            batch_size=batch_size,
            count=self.integer(raw.get("count", 1), f"{field}.count", 1),
            inputs={str(name): str(kind) for name, kind in kinds.items()},
        )

    def parameters(self, value: Any) -> dict[str, str]:
        raw = self.mapping(value, "parameters", _AnyKey())
        parameters: dict[str, str] = {}
        for key, item in raw.items():
            if isinstance(item, bool):
                parameters[str(key)] = "true" if item else "false"
            elif isinstance(item, str | int | float):
                parameters[str(key)] = str(item)
            else:
                raise self.error(f"parameters.{key}", f"expected a scalar, got {item!r}")
        return parameters

    def response_cache(self, value: Any) -> ResponseCacheConfig:
        if value is None or value is False:
            return ResponseCacheConfig()
        field = "response_cache"
        raw = {} if value is True else self.mapping(value, field, _CACHE_KEYS)
        ttl = raw.get("ttl_s")
        if ttl is not None and self.number(ttl, f"{field}.ttl_s") <= 0:
            raise self.error(f"{field}.ttl_s", f"must be > 0 seconds, got {ttl}")
        default = ResponseCacheConfig()
        return ResponseCacheConfig(
            enable=self.boolean(raw.get("enable", True), f"{field}.enable"),
            ttl_s=None if ttl is None else float(ttl),
            max_bytes=self.integer(
                raw.get("max_bytes", default.max_bytes), f"{field}.max_bytes", 1
            ),
            coalesce=self.boolean(raw.get("coalesce", True), f"{field}.coalesce"),
            redis=self.boolean(raw.get("redis", True), f"{field}.redis"),
        )

    def ensemble(self, raw: Mapping[str, Any]) -> tuple[EnsembleStep, ...]:
        """`ensemble: [steps]`, or Triton's `ensemble_scheduling: {step: [steps]}`."""
        if "ensemble" in raw and "ensemble_scheduling" in raw:
            raise self.error("ensemble", "give ensemble or ensemble_scheduling, not both")
        if "ensemble_scheduling" in raw:
            outer = self.mapping(
                raw["ensemble_scheduling"], "ensemble_scheduling", frozenset({"step"})
            )
            steps = self.listed(outer, "step", self.ensemble_step, "ensemble_scheduling")
        else:
            steps = self.listed(raw, "ensemble", self.ensemble_step)
        backend = raw.get("backend")
        if steps and backend != "ensemble":
            raise self.error("ensemble", "steps need backend: ensemble")
        if backend == "ensemble" and not steps:
            raise self.error("ensemble", "an ensemble needs at least one step")
        return steps

    def ensemble_step(self, value: Any, field: str) -> EnsembleStep:
        raw = self.mapping(value, field, _STEP_KEYS)
        key = "model_name" if "model_name" in raw else "model"
        version_key = "model_version" if "model_version" in raw else "version"
        version = self.integer(raw.get(version_key, -1), f"{field}.{version_key}", -1)
        maps = {}
        for which in ("input_map", "output_map"):
            mapping = self.mapping(raw.get(which), f"{field}.{which}", _AnyKey())
            for k, v in mapping.items():
                if not isinstance(v, str) or not isinstance(k, str):
                    raise self.error(f"{field}.{which}.{k}", f"expected a tensor name, got {v!r}")
            maps[which] = {str(k): str(v) for k, v in mapping.items()}
        if not maps["input_map"] or not maps["output_map"]:
            raise self.error(field, "a step needs an input_map and an output_map")
        return EnsembleStep(
            model=self.string(raw.get(key), f"{field}.{key}"),
            version=None if version < 1 else version,
            input_map=maps["input_map"],
            output_map=maps["output_map"],
        )

    def cascade(self, value: Any) -> CascadeConfig | None:
        if value is None:
            return None
        field = "cascade"
        raw = self.mapping(value, field, _CASCADE_KEYS)
        models = self.listed(raw, "models", lambda v, f: self.string(v, f), field)
        if len(models) < 2:
            raise self.error(f"{field}.models", "list at least two models, cheapest first")
        output = rule = ""
        if "confidence_output" in raw:
            output = self.string(raw["confidence_output"], f"{field}.confidence_output")
        if "rule" in raw:
            rule = self.string(raw["rule"], f"{field}.rule")
        if bool(output) == bool(rule):
            raise self.error(field, "give confidence_output (with threshold) or rule, one of them")
        threshold = self.number(raw.get("threshold", 0.0), f"{field}.threshold")
        if output and not 0 < threshold <= 1:
            raise self.error(f"{field}.threshold", f"must be in (0, 1], got {threshold}")
        return CascadeConfig(tuple(models), output, threshold, rule)

    def fallback(self, value: Any, name: str) -> tuple[Fallback, ...]:
        found = []
        for index, item in enumerate(self.items(value, "fallback")):
            field = f"fallback[{index}]"
            raw = self.mapping(item, field, frozenset({"model", "cache", "static"}))
            if len(raw) != 1:
                raise self.error(field, "give exactly one of model, cache, static")
            ((kind, body),) = raw.items()
            if kind == "model":
                other = self.string(body, f"{field}.model")
                if other == name:
                    raise self.error(f"{field}.model", "a model cannot be its own fallback")
                found.append(Fallback(FallbackKind.MODEL, model=other))
            elif kind == "cache":
                if self.boolean(body, f"{field}.cache"):
                    found.append(Fallback(FallbackKind.CACHE))
            else:
                outputs = self.mapping(body, f"{field}.static", _AnyKey())
                if not outputs:
                    raise self.error(f"{field}.static", "give at least one output's row value")
                static = {str(k): v if isinstance(v, list) else [v] for k, v in outputs.items()}
                found.append(Fallback(FallbackKind.STATIC, static=static))
        return tuple(found)

    def decoupled(self, raw: Mapping[str, Any]) -> bool:
        """`model_transaction_policy: {decoupled: true}`, for a Triton Python model only."""
        field = "model_transaction_policy"
        policy = self.mapping(raw.get(field), field, frozenset({"decoupled"}))
        decoupled = self.boolean(policy.get("decoupled", False), f"{field}.decoupled")
        if decoupled and raw.get("backend") != "python":
            problem = (
                f"backend '{raw.get('backend')}' cannot be decoupled: only a Triton Python "
                "model (backend python, class TritonPythonModel) sends a stream of responses"
            )
            raise self.error(f"{field}.decoupled", problem)
        return decoupled

    def sequence_batching(
        self,
        raw: Mapping[str, Any],
        max_batch_size: int,
        inputs: tuple[TensorSpec, ...],
    ) -> SequenceBatching | None:
        """Triton's `sequence_batching`, in the keys of its JSON form, checked as Triton checks
        it against the rest of the config."""
        value = raw.get("sequence_batching")
        if value is None:
            return None
        field = "sequence_batching"
        body = self.mapping(value, field, _SEQUENCE_KEYS)
        if raw.get("dynamic_batching") not in (None, False):
            raise self.error(field, "give dynamic_batching or sequence_batching, not both")
        self.sequence_model(raw)
        if "oldest" in body and "direct" in body:
            raise self.error(field, "give one strategy: oldest or direct")
        strategy = SequenceStrategy.OLDEST if "oldest" in body else SequenceStrategy.DIRECT
        keys = _OLDEST_KEYS if strategy is SequenceStrategy.OLDEST else _DIRECT_KEYS
        where = f"{field}.{strategy.value}"
        chosen = self.mapping(body.get(strategy.value), where, keys)
        preferred = self.listed(
            chosen, "preferred_batch_size", lambda v, f: self.integer(v, f, 1), where
        )
        for size in preferred:
            if size > max(1, max_batch_size):
                problem = f"preferred batch size {size} exceeds max_batch_size {max_batch_size}"
                raise self.error(f"{where}.preferred_batch_size", problem)
        idle = self.integer(
            body.get("max_sequence_idle_microseconds", 0),
            f"{field}.max_sequence_idle_microseconds",
            0,
        )
        controls = self.listed(body, "control_input", self.sequence_control, field)
        states = self.listed(body, "state", self.sequence_state, field)
        self.sequence_names(controls, states, inputs)
        return SequenceBatching(
            strategy=strategy,
            max_sequence_idle_us=idle or SequenceBatching().max_sequence_idle_us,
            max_candidate_sequences=self.integer(
                chosen.get("max_candidate_sequences", 0), f"{where}.max_candidate_sequences", 0
            ),
            max_queue_delay_us=self.integer(
                chosen.get("max_queue_delay_microseconds", 0),
                f"{where}.max_queue_delay_microseconds",
                0,
            ),
            preferred_batch_sizes=tuple(sorted(set(preferred))),
            controls=controls,
            states=states,
        )

    def sequence_model(self, raw: Mapping[str, Any]) -> None:
        """A stateful model is one the batcher runs, on a backend that takes and gives tensors
        by name: not a composition, not decoupled, and with no response cache (as Triton
        refuses it)."""
        field = "sequence_batching"
        backend = raw.get("backend")
        if backend in ("ensemble", "cascade"):
            raise self.error(field, f"a {backend} cannot have sequence_batching")
        if backend not in _STATEFUL_BACKENDS:
            problem = (
                f"backend '{backend}' takes no control inputs or implicit state; a stateful "
                f"model's backend is one of {', '.join(_STATEFUL_BACKENDS)}"
            )
            raise self.error(field, problem)
        policy = raw.get("model_transaction_policy")
        if isinstance(policy, dict) and policy.get("decoupled") is True:
            raise self.error(field, "lockgate serves no decoupled model with sequence_batching")
        cache = raw.get("response_cache")
        if cache is True or (isinstance(cache, dict) and cache.get("enable", True) is True):
            problem = "the response cache cannot answer a stateful model: disable response_cache"
            raise self.error(field, problem)

    def sequence_control(self, value: Any, field: str) -> SequenceControl:
        """One `control_input`: a model input and the one control it carries."""
        raw = self.mapping(value, field, frozenset({"name", "control"}))
        name = self.string(raw.get("name"), f"{field}.name")
        controls = self.items(raw.get("control"), f"{field}.control")
        if len(controls) != 1:
            raise self.error(f"{field}.control", "give exactly one control for the input")
        where = f"{field}.control[0]"
        control = self.mapping(controls[0], where, _CONTROL_KEYS)
        kinds = [kind.value for kind in SequenceControlKind]
        kind_name = control.get("kind", SequenceControlKind.START.value)  # Triton's 0
        if kind_name not in kinds:
            raise self.error(f"{where}.kind", f"unknown kind {kind_name!r}; one of {kinds}")
        kind = SequenceControlKind(kind_name)
        given = [key for key in _FLAG_VALUES if control.get(key)]
        if kind is SequenceControlKind.CORRID:
            if given:
                raise self.error(where, f"{kind.value} takes a data_type, not {given[0]}")
            datatype = self.control_datatype(control.get("data_type"), f"{where}.data_type")
            return SequenceControl(kind, name, datatype)
        if len(given) != 1:
            choices = ", ".join(_FLAG_VALUES)
            raise self.error(where, f"{kind.value} needs exactly one of {choices}")
        (key,) = given
        values = self.items(control[key], f"{where}.{key}")
        if len(values) != 2:
            raise self.error(f"{where}.{key}", f"must have exactly 2 entries, got {values!r}")
        false, true = (
            float(self.boolean(v, f"{where}.{key}[{i}]"))
            if key == "bool_false_true"
            else self.number(v, f"{where}.{key}[{i}]")
            for i, v in enumerate(values)
        )
        return SequenceControl(kind, name, _FLAG_VALUES[key], (false, true))

    def control_datatype(self, value: Any, field: str) -> str:
        if value is None:
            raise self.error(field, f"missing; one of {', '.join(_CORRID_TYPES)}")
        datatype = normalize_datatype(self.string(value, field))
        if datatype not in _CORRID_TYPES:
            raise self.error(field, f"got {value!r}; one of {', '.join(_CORRID_TYPES)}")
        return datatype

    def sequence_state(self, value: Any, field: str) -> SequenceState:
        raw = self.mapping(value, field, _STATE_KEYS)
        input_name = self.string(raw.get("input_name"), f"{field}.input_name")
        output_name = self.string(raw.get("output_name"), f"{field}.output_name")
        datatype = self.datatype(raw.get("data_type"), f"{field}.data_type")
        dims = self.dims(raw.get("dims"), f"{field}.dims")
        initial = self.items(raw.get("initial_state"), f"{field}.initial_state")
        if len(initial) > 1:
            raise self.error(f"{field}.initial_state", "give at most one initial state")
        initial_dims = tuple(1 if d < 0 else d for d in dims)  # no initial_state: -1 dims as 1
        if initial:
            initial_dims = self.initial_state(initial[0], f"{field}.initial_state[0]", datatype)
            if len(initial_dims) != len(dims) or any(
                d >= 0 and d != i for d, i in zip(dims, initial_dims, strict=True)
            ):
                problem = f"dims {list(initial_dims)} do not fit the state's dims {list(dims)}"
                raise self.error(f"{field}.initial_state[0].dims", problem)
        return SequenceState(input_name, output_name, datatype, dims, initial_dims)

    def initial_state(self, value: Any, field: str, datatype: str) -> tuple[int, ...]:
        """An initial state of zeros (`zero_data`): its dims, every one fixed."""
        raw = self.mapping(value, field, _INITIAL_STATE_KEYS)
        if "data_file" in raw:
            raise self.error(f"{field}.data_file", "not supported by lockgate: use zero_data")
        if "zero_data" not in raw:
            raise self.error(field, "give zero_data (an initial state of zeros)")
        self.string(raw.get("name"), f"{field}.name")  # Triton requires it
        if self.datatype(raw.get("data_type"), f"{field}.data_type") != datatype:
            raise self.error(f"{field}.data_type", f"does not match the state's {datatype}")
        dims = self.dims(raw.get("dims"), f"{field}.dims")
        if -1 in dims:
            raise self.error(f"{field}.dims", f"must all be fixed, got {list(dims)}")
        return dims

    def datatype(self, value: Any, field: str) -> str:
        datatype = normalize_datatype(self.string(value, field))
        if datatype is None:
            raise self.error(field, f"unknown datatype {value!r}; one of {DATATYPES}")
        return datatype

    def sequence_names(
        self,
        controls: tuple[SequenceControl, ...],
        states: tuple[SequenceState, ...],
        inputs: tuple[TensorSpec, ...],
    ) -> None:
        """Each control kind at most once; the inputs lockgate fills in (controls, state
        inputs) named once each and not among the inputs a client sends; state outputs not
        clashing with each other."""
        seen_kinds: set[SequenceControlKind] = set()
        for index, control in enumerate(controls):
            if control.kind in seen_kinds:
                problem = f"{control.kind.value} is given twice"
                raise self.error(f"sequence_batching.control_input[{index}]", problem)
            seen_kinds.add(control.kind)
        declared = {spec.name for spec in inputs}
        filled = [(f"control_input[{i}].name", c.name) for i, c in enumerate(controls)] + [
            (f"state[{i}].input_name", s.input_name) for i, s in enumerate(states)
        ]
        seen: set[str] = set()
        for where, name in filled:
            field = f"sequence_batching.{where}"
            if name in declared:
                raise self.error(field, f"'{name}' is also a declared input: lockgate fills it in")
            if name in seen:
                raise self.error(field, f"'{name}' is filled in twice")
            seen.add(name)
        # a state output may also be a listed output: then a client may ask for it
        state_outputs = [state.output_name for state in states]
        for index, name in enumerate(state_outputs):
            if name in state_outputs[:index]:
                problem = f"'{name}' is the output of two states"
                raise self.error(f"sequence_batching.state[{index}].output_name", problem)

    def filename(self, value: Any) -> str:
        if value is None:
            return ""
        name = self.string(value, "default_model_filename")
        if "/" in name or "\\" in name or name in (".", "..") or name.startswith("."):
            raise self.error("default_model_filename", f"must be a plain file name, got {name!r}")
        return name


class _AnyKey(frozenset[str]):
    """An `allowed` set that admits every key (for free-form maps)."""

    def __contains__(self, key: object) -> bool:
        return True


def _join(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _known(allowed: frozenset[str]) -> str:
    return ", ".join(sorted(allowed))
