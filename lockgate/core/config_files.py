"""Reading `config.yaml` and Triton's `config.pbtxt` into a `ModelConfig`.

Both formats go through one reader: a Triton config is first translated into the field
names of `config.yaml`, then validated by the same code. Every problem raises
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

Unknown keys are errors in `config.yaml` (a typo must not pass silently). In
`config.pbtxt`, fields that Triton knows and lockgate does not use (optimization,
response_cache, sequence_batching, ...) are ignored with a warning.

A warmup sample with no `inputs` means zeros for every input.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from lockgate.backends.base import backend_names, platforms
from lockgate.config import (
    DATATYPES,
    DynamicBatching,
    ModelConfig,
    TensorSpec,
    VersionPolicy,
    VersionPolicyKind,
    WarmupSample,
)
from lockgate.core import pbtxt
from lockgate.errors import ConfigError

log = logging.getLogger(__name__)

CONFIG_FILENAMES = ("config.yaml", "config.pbtxt")

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
        "instance_count",
        "instance_group",
        "version_policy",
        "warmup",
        "parameters",
        "default_model_filename",
    }
)
_TENSOR_KEYS = frozenset({"name", "datatype", "data_type", "dims", "optional"})
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
_WARMUP_KEYS = frozenset({"name", "batch_size", "count", "inputs"})
_WARMUP_KINDS = ("zero", "random")
_DEFAULT_BATCHING = DynamicBatching()
_INSTANCE_KINDS = ("KIND_AUTO", "KIND_CPU", "KIND_GPU", "KIND_MODEL")

_PLATFORMS = platforms()  # Triton's `platform` names for the runtimes lockgate has


def load_model_config(model_dir: Path) -> ModelConfig:
    """Read `<model_dir>/config.yaml`, or `config.pbtxt` when there is no YAML file."""
    for filename in CONFIG_FILENAMES:
        path = model_dir / filename
        if path.is_file():
            text = _read_text(path)
            parse = parse_yaml_config if filename.endswith(".yaml") else parse_pbtxt_config
            return parse(text, path=str(path), folder=model_dir.name)
    raise ConfigError(str(model_dir), "config", "no config.yaml or config.pbtxt")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "file", f"cannot read: {exc}") from exc


def parse_yaml_config(text: str, *, path: str, folder: str) -> ModelConfig:
    """Parse the text of a `config.yaml` for the model in folder `folder`."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(path, "yaml", f"syntax error at {where}{problem}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(path, "config", "the file must hold a mapping of settings")
    return config_from_dict(raw, path=path, folder=folder)


def parse_pbtxt_config(text: str, *, path: str, folder: str) -> ModelConfig:
    """Parse the text of a Triton `config.pbtxt` for the model in folder `folder`."""
    try:
        message = pbtxt.parse(text)
    except pbtxt.PbtxtSyntaxError as exc:
        raise ConfigError(path, "pbtxt", f"syntax error at line {exc.line}: {exc.problem}") from exc
    return config_from_dict(_TritonTranslator(path).translate(message), path=path, folder=folder)


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


def normalize_datatype(value: str) -> str | None:
    """`FP32`, `fp32` and Triton's `TYPE_FP32` are FP32; `TYPE_STRING` is BYTES."""
    name = value.strip().upper().removeprefix("TYPE_")
    if name == "STRING":
        name = "BYTES"
    return name if name in DATATYPES else None


class _Reader:
    """Typed access to a raw mapping; every failure names the file and the field."""

    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, field: str, problem: str) -> ConfigError:
        return ConfigError(self.path, field, problem)

    # -- scalars

    def integer(self, value: Any, field: str, minimum: int | None = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.error(field, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise self.error(field, f"must be >= {minimum}, got {value}")
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
        max_batch_size = self.integer(raw.get("max_batch_size", 0), "max_batch_size", 0)
        inputs = self.tensors(raw, "input", "inputs")
        outputs = self.tensors(raw, "output", "outputs")
        batching = raw.get("dynamic_batching")
        return ModelConfig(
            name=name,
            backend=self.backend(raw.get("backend")),
            max_batch_size=max_batch_size,
            inputs=inputs,
            outputs=outputs,
            dynamic_batching=self.dynamic_batching(batching, max_batch_size),
            latency_slo_ms=self.latency_slo(raw.get("latency_slo_ms")),
            instance_count=self.instance_count(raw),
            version_policy=self.version_policy(raw.get("version_policy")),
            warmup=self.warmup(raw.get("warmup"), inputs, max_batch_size),
            parameters=self.parameters(raw.get("parameters")),
            default_model_filename=self.filename(raw.get("default_model_filename")),
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
        return TensorSpec(
            name=name,
            datatype=normalized,
            dims=self.dims(raw.get("dims"), f"{field}.dims"),
            optional=self.boolean(raw.get("optional", False), f"{field}.optional"),
        )

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

    def instance_count(self, raw: Mapping[str, Any]) -> int:
        if "instance_count" in raw and "instance_group" in raw:
            raise self.error("instance_count", "give instance_count or instance_group, not both")
        if "instance_group" not in raw:
            return self.integer(raw.get("instance_count", 1), "instance_count", 1)
        groups = self.listed(raw, "instance_group", self.instance_group)
        return sum(groups) if groups else 1

    def instance_group(self, value: Any, field: str) -> int:
        raw = self.mapping(value, field, frozenset({"count", "kind", "name"}))
        kind = raw.get("kind", "KIND_CPU")
        if kind not in _INSTANCE_KINDS:
            raise self.error(f"{field}.kind", f"unknown kind {kind!r}; one of {_INSTANCE_KINDS}")
        if kind == "KIND_GPU":
            log.warning(
                "%s: %s.kind KIND_GPU: lockgate runs this group on the CPU", self.path, field
            )
        return self.integer(raw.get("count", 1), f"{field}.count", 1)

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
            if kind not in _WARMUP_KINDS:
                problem = f"expected one of {_WARMUP_KINDS}, got {kind!r}"
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


class _TritonTranslator:
    """A parsed `config.pbtxt` -> a mapping with the keys of `config.yaml`."""

    _IGNORED_QUIETLY = frozenset({"reshape", "format", "is_shape_tensor", "allow_ragged_batch"})
    _BATCHING_FIELDS = frozenset(
        {
            "preferred_batch_size",
            "max_queue_delay_microseconds",
            "default_queue_policy",
            "priority_levels",
            "default_priority_level",
        }
    )
    _WARMUP_FIELDS = frozenset({"name", "batch_size", "count", "inputs"})

    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, field: str, problem: str) -> ConfigError:
        return ConfigError(self.path, field, problem)

    def translate(self, message: pbtxt.Message) -> dict[str, Any]:
        raw: dict[str, Any] = {}
        for name in message.names():
            handler = getattr(self, f"_field_{name}", None)
            if handler is None:
                log.warning(
                    "%s: ignoring Triton field '%s' (not used by lockgate)", self.path, name
                )
                continue
            handler(message, raw)
        return raw

    def one(self, message: pbtxt.Message, name: str) -> Any:
        return message.get(name)

    def sub(self, value: Any, field: str) -> pbtxt.Message:
        if not isinstance(value, pbtxt.Message):
            raise self.error(field, f"expected a message {{ ... }}, got {value!r}")
        return value

    # -- top-level fields, one handler each

    def _field_name(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        raw["name"] = self.one(message, "name")

    def _field_backend(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        raw["backend"] = self.one(message, "backend")

    def _field_platform(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        platform = self.one(message, "platform")
        if "backend" in message:
            return  # backend wins when both are given, as in Triton
        if platform not in _PLATFORMS:
            known = ", ".join(_PLATFORMS)
            raise self.error("platform", f"unsupported platform {platform!r}; one of {known}")
        raw["backend"] = _PLATFORMS[platform]

    def _field_max_batch_size(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        raw["max_batch_size"] = self.one(message, "max_batch_size")

    def _field_default_model_filename(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        raw["default_model_filename"] = self.one(message, "default_model_filename")

    def _field_latency_slo_ms(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        raw["latency_slo_ms"] = self.one(message, "latency_slo_ms")  # a lockgate extension

    def _field_input(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        raw["input"] = self.tensors(message, "input")

    def _field_output(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        raw["output"] = self.tensors(message, "output")

    def _field_dynamic_batching(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        batching = self.sub(self.one(message, "dynamic_batching"), "dynamic_batching")
        raw["dynamic_batching"] = self.dynamic_batching(batching)

    def _field_instance_group(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        groups = []
        for index, value in enumerate(message.values("instance_group")):
            group = self.sub(value, f"instance_group[{index}]")
            groups.append({key: group.get(key) for key in ("count", "kind") if key in group})
        raw["instance_group"] = groups

    def _field_version_policy(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        policy = self.sub(self.one(message, "version_policy"), "version_policy")
        translated: dict[str, Any] = {}
        for kind in policy.names():
            body = self.sub(policy.get(kind), f"version_policy.{kind}")
            if kind == "specific":
                translated[kind] = {"versions": body.values("versions")}
            elif kind == "latest":
                translated[kind] = {k: body.get(k) for k in ("num_versions",) if k in body}
            else:
                translated[kind] = {k: body.get(k) for k in body.names()}
        raw["version_policy"] = translated

    def _field_model_warmup(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        raw["warmup"] = [
            self.warmup_sample(self.sub(value, f"model_warmup[{i}]"), f"model_warmup[{i}]")
            for i, value in enumerate(message.values("model_warmup"))
        ]

    def _field_parameters(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        parameters: dict[str, Any] = {}
        for index, value in enumerate(message.values("parameters")):
            field = f"parameters[{index}]"
            entry = self.sub(value, field)
            body = self.sub(entry.get("value"), f"{field}.value")
            parameters[str(entry.get("key"))] = body.get("string_value")
        raw["parameters"] = parameters

    # -- nested messages

    def tensors(self, message: pbtxt.Message, key: str) -> list[dict[str, Any]]:
        specs = []
        for index, value in enumerate(message.values(key)):
            tensor = self.sub(value, f"{key}[{index}]")
            spec: dict[str, Any] = {"dims": tensor.values("dims")}
            for name in tensor.names():
                if name in ("name", "data_type", "optional"):
                    spec[name] = tensor.get(name)
                elif name not in ("dims", *self._IGNORED_QUIETLY):
                    log.warning("%s: ignoring field '%s[%d].%s'", self.path, key, index, name)
            specs.append(spec)
        return specs

    def warn_unused(self, message: pbtxt.Message, field: str, used: frozenset[str]) -> None:
        for name in message.names():
            if name not in used:
                log.warning(
                    "%s: ignoring field '%s.%s' (not used by lockgate)", self.path, field, name
                )

    def dynamic_batching(self, batching: pbtxt.Message) -> dict[str, Any]:
        self.warn_unused(batching, "dynamic_batching", self._BATCHING_FIELDS)
        out: dict[str, Any] = {"preferred_batch_sizes": batching.values("preferred_batch_size")}
        if "max_queue_delay_microseconds" in batching:
            out["max_queue_delay_us"] = batching.get("max_queue_delay_microseconds")
        policy = batching.get("default_queue_policy")
        if policy is not None:
            policy = self.sub(policy, "dynamic_batching.default_queue_policy")
            if policy.get("max_queue_size", 0) != 0:  # Triton's 0 is "unbounded": keep ours
                out["max_queue_size"] = policy.get("max_queue_size")
            if "default_timeout_microseconds" in policy:
                out["default_timeout_us"] = policy.get("default_timeout_microseconds")
        if batching.get("priority_levels", 0) != 0:  # Triton's 0 is "no priorities"
            out["priority_levels"] = batching.get("priority_levels")
        if "default_priority_level" in batching:
            out["default_priority_level"] = batching.get("default_priority_level")
        return out

    def warmup_sample(self, sample: pbtxt.Message, field: str) -> dict[str, Any]:
        self.warn_unused(sample, field, self._WARMUP_FIELDS)
        out: dict[str, Any] = {
            k: sample.get(k) for k in ("name", "batch_size", "count") if k in sample
        }
        kinds: dict[str, str] = {}
        for index, value in enumerate(sample.values("inputs")):
            entry = self.sub(value, f"{field}.inputs[{index}]")
            data = self.sub(entry.get("value"), f"{field}.inputs[{index}].value")
            kinds[str(entry.get("key"))] = self.warmup_kind(data, f"{field}.inputs[{index}]")
        out["inputs"] = kinds
        return out

    def warmup_kind(self, data: pbtxt.Message, field: str) -> str:
        if data.get("random_data") is True:
            return "random"
        if data.get("zero_data") is True:
            return "zero"
        if "input_data_file" in data:
            raise self.error(
                f"{field}.input_data_file", "not supported; use zero_data or random_data"
            )
        raise self.error(field, "give zero_data: true or random_data: true")
