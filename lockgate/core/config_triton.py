"""Triton's `config.pbtxt`, parsed against Triton's own schema (`triton/model_config.proto`)
by protobuf's text parser, as Triton parses it: a misspelt field, a value of the wrong type or
an unknown enum value is an error that names the file, line and column. The `ModelConfig`
message is then translated into the keys of `config.yaml` and validated by the one reader
(`config_reader.py`). Fields that Triton knows and lockgate does not use (optimization,
model_operations, ...) are ignored with a warning.

proto3 scalars have no presence: an unset number reads as 0, so Triton's zeros that mean
"unset" (an instance count, a warmup batch size or count, `num_versions`, a queue size, the
priority levels) leave lockgate's default in place.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Mapping
from typing import Any

from google.protobuf import json_format, text_format
from google.protobuf.descriptor import EnumDescriptor
from google.protobuf.message import Message

from lockgate.backends.base import platforms
from lockgate.config import ModelConfig
from lockgate.core.config_reader import config_from_dict
from lockgate.core.triton import model_config_pb2 as pb
from lockgate.errors import ConfigError

log = logging.getLogger(__name__)

_PLATFORMS = platforms()  # Triton's `platform` names for the runtimes lockgate has
_TENSOR_FIELDS = frozenset(
    {"name", "data_type", "dims", "optional", "reshape", "label_filename", "allow_ragged_batch"}
)
_TENSOR_IGNORED_QUIETLY = frozenset({"format", "is_shape_tensor"})
_BATCHING_FIELDS = frozenset(
    {
        "preferred_batch_size",
        "max_queue_delay_microseconds",
        "default_queue_policy",
        "priority_levels",
        "default_priority_level",
    }
)
# allow_timeout_override: lockgate always takes a request's own timeout, and writes true
_QUEUE_POLICY_FIELDS = frozenset(
    {"max_queue_size", "default_timeout_microseconds", "allow_timeout_override"}
)
_STEP_FIELDS = frozenset({"model_name", "model_version", "input_map", "output_map"})
_LOCATION = re.compile(r"^\d+(?::\d+)? : ")  # ParseError's "line:column : " prefix
# lockgate's own fields, given as parameters in a config.pbtxt: numbers, and whole numbers
_LOCKGATE_FIELDS = ("latency_slo_ms", "admission_slack")
_LOCKGATE_COUNTS = ("max_buffered_responses",)


def parse_pbtxt_config(text: str, *, path: str, folder: str) -> ModelConfig:
    """Parse the text of a Triton `config.pbtxt` for the model in folder `folder`."""
    message = read_pbtxt(text, path=path)
    return config_from_dict(_TritonTranslator(path).translate(message), path=path, folder=folder)


def parse_json_config(text: str, *, path: str, folder: str, backend: str = "") -> ModelConfig:
    """Triton's model config in its JSON form (a load request's `config`, the form
    `GET .../config` answers), for the model in folder `folder`. `backend`: the one used when
    the JSON names neither a backend nor a platform (the repository config's)."""
    message = pb.ModelConfig()
    try:
        json_format.Parse(text, message)
    except json_format.ParseError as exc:
        raise ConfigError(path, "config", str(exc)) from exc
    raw = _TritonTranslator(path).translate(message)
    if "backend" not in raw and backend:
        raw["backend"] = backend
    return config_from_dict(raw, path=path, folder=folder)


def read_pbtxt(text: str, *, path: str) -> pb.ModelConfig:
    """Triton's `ModelConfig` message from `text`. Raises ConfigError (field `pbtxt`) with the
    line and column of the first field or value that Triton's schema refuses."""
    message = pb.ModelConfig()
    try:
        text_format.Parse(text, message)
    except text_format.ParseError as exc:
        raise ConfigError(path, "pbtxt", _parse_problem(exc, text)) from exc
    return message


def _parse_problem(exc: text_format.ParseError, text: str) -> str:
    line, column = exc.GetLine(), exc.GetColumn()
    problem = _LOCATION.sub("", str(exc), count=1)
    if line is None:
        return problem
    lines = text.split("\n")
    if 0 < line <= len(lines):  # the parser quotes the whole line; the position says enough
        problem = problem.removeprefix(f"'{lines[line - 1]}': ")
    where = f"line {line}" if column is None else f"line {line}, column {column}"
    return f"{where}: {problem}"


def _enum_name(enum: EnumDescriptor, number: int) -> str:
    """The value's name; a number the enum does not know (proto3 accepts one) as digits."""
    value = enum.values_by_number.get(number)
    return value.name if value is not None else str(number)


class _TritonTranslator:
    """A parsed `ModelConfig` message -> a mapping with the keys of `config.yaml`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def error(self, field: str, problem: str) -> ConfigError:
        return ConfigError(self.path, field, problem)

    def translate(self, config: pb.ModelConfig) -> dict[str, Any]:
        raw: dict[str, Any] = {}
        for descriptor, _ in config.ListFields():
            handler = getattr(self, f"_field_{descriptor.name}", None)
            if handler is None:
                log.warning(
                    "%s: ignoring Triton field '%s' (not used by lockgate)",
                    self.path,
                    descriptor.name,
                )
                continue
            handler(config, raw)
        return raw

    def warn_unused(self, message: Message, field: str, used: Collection[str]) -> None:
        for descriptor, _ in message.ListFields():
            if descriptor.name not in used:
                log.warning(
                    "%s: ignoring field '%s.%s' (not used by lockgate)",
                    self.path,
                    field,
                    descriptor.name,
                )

    # -- top-level fields that are set, one handler each

    def _field_name(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["name"] = config.name

    def _field_backend(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["backend"] = config.backend

    def _field_platform(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        if config.backend:
            return  # backend wins when both are given, as in Triton
        if config.platform not in _PLATFORMS:
            known = ", ".join(_PLATFORMS)
            problem = f"unsupported platform {config.platform!r}; one of {known}"
            raise self.error("platform", problem)
        raw["backend"] = _PLATFORMS[config.platform]

    def _field_max_batch_size(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["max_batch_size"] = config.max_batch_size

    def _field_default_model_filename(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["default_model_filename"] = config.default_model_filename

    def _field_input(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["input"] = [self.tensor(t, f"input[{i}]") for i, t in enumerate(config.input)]

    def _field_output(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["output"] = [self.tensor(t, f"output[{i}]") for i, t in enumerate(config.output)]

    def _field_dynamic_batching(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["dynamic_batching"] = self.dynamic_batching(config.dynamic_batching)

    def _field_instance_group(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["instance_group"] = [self.instance_group(group) for group in config.instance_group]

    def _field_version_policy(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["version_policy"] = self.version_policy(config.version_policy)

    def _field_model_warmup(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["warmup"] = [
            self.warmup_sample(sample, f"model_warmup[{i}]")
            for i, sample in enumerate(config.model_warmup)
        ]

    def _field_parameters(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        """Backend settings; lockgate's own fields that Triton's schema lacks
        (`latency_slo_ms`, `admission_slack`, `max_buffered_responses`) are given as
        parameters of the same name."""
        parameters = {key: config.parameters[key].string_value for key in sorted(config.parameters)}
        for key in _LOCKGATE_FIELDS:
            if key in parameters:
                value = parameters.pop(key)
                try:
                    raw[key] = float(value)
                except ValueError:
                    problem = f"expected a number, got {value!r}"
                    raise self.error(f"parameters.{key}", problem) from None
        for key in _LOCKGATE_COUNTS:
            if key in parameters:
                value = parameters.pop(key)
                if not value.strip().isdigit():
                    problem = f"expected a whole number, got {value!r}"
                    raise self.error(f"parameters.{key}", problem)
                raw[key] = int(value)
        raw["parameters"] = parameters

    def _field_model_transaction_policy(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        decoupled = config.model_transaction_policy.decoupled
        raw["model_transaction_policy"] = {"decoupled": decoupled}

    def _field_response_cache(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["response_cache"] = {"enable": config.response_cache.enable}

    def _field_ensemble_scheduling(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        scheduling = config.ensemble_scheduling
        self.warn_unused(scheduling, "ensemble_scheduling", ("step",))
        raw["ensemble_scheduling"] = {
            "step": [
                self.ensemble_step(step, f"ensemble_scheduling.step[{i}]")
                for i, step in enumerate(scheduling.step)
            ]
        }

    def _field_sequence_batching(self, config: pb.ModelConfig, raw: dict[str, Any]) -> None:
        raw["sequence_batching"] = self.sequence_batching(config.sequence_batching)

    # -- nested messages

    def sequence_batching(self, batching: pb.ModelSequenceBatching) -> dict[str, Any]:
        """In the keys of Triton's JSON form, which `config.yaml` takes too."""
        field = "sequence_batching"
        if batching.iterative_sequence:
            raise self.error(f"{field}.iterative_sequence", "not supported by lockgate")
        used = ("max_sequence_idle_microseconds", "control_input", "state", "oldest", "direct")
        self.warn_unused(batching, field, used)
        out: dict[str, Any] = {
            "max_sequence_idle_microseconds": batching.max_sequence_idle_microseconds,
            "control_input": [
                {"name": control.name, "control": [self.control(c) for c in control.control]}
                for control in batching.control_input
            ],
            "state": [self.state(state) for state in batching.state],
        }
        strategy = batching.WhichOneof("strategy_choice")
        if strategy == "oldest":
            oldest = batching.oldest
            out["oldest"] = {
                "max_candidate_sequences": oldest.max_candidate_sequences,
                "preferred_batch_size": list(oldest.preferred_batch_size),
                "max_queue_delay_microseconds": oldest.max_queue_delay_microseconds,
            }
        elif strategy == "direct":
            if batching.direct.minimum_slot_utilization:
                log.warning(
                    "%s: ignoring field '%s.direct.minimum_slot_utilization' (lockgate serves "
                    "direct as oldest: a batch leaves when its window ends or it is full)",
                    self.path,
                    field,
                )
            out["direct"] = {
                "max_queue_delay_microseconds": batching.direct.max_queue_delay_microseconds
            }
        return out

    def control(self, control: pb.ModelSequenceBatching.Control) -> dict[str, Any]:
        kind = pb.ModelSequenceBatching.Control.Kind.DESCRIPTOR
        out: dict[str, Any] = {"kind": _enum_name(kind, control.kind)}
        for key in ("int32_false_true", "fp32_false_true", "bool_false_true"):
            values = list(getattr(control, key))
            if values:
                out[key] = values
        if control.data_type != pb.TYPE_INVALID:
            out["data_type"] = self.datatype(control.data_type)
        return out

    def state(self, state: pb.ModelSequenceBatching.State) -> dict[str, Any]:
        out: dict[str, Any] = {
            "input_name": state.input_name,
            "output_name": state.output_name,
            "data_type": self.datatype(state.data_type),
            "dims": list(state.dims),
            "initial_state": [],
        }
        for initial in state.initial_state:
            entry: dict[str, Any] = {
                "name": initial.name,
                "data_type": self.datatype(initial.data_type),
                "dims": list(initial.dims),
            }
            choice = initial.WhichOneof("state_data")
            if choice == "zero_data":
                entry["zero_data"] = True
            elif choice == "data_file":
                entry["data_file"] = initial.data_file
            out["initial_state"].append(entry)
        return out

    def tensor(self, tensor: pb.ModelInput | pb.ModelOutput, field: str) -> dict[str, Any]:
        self.warn_unused(tensor, field, _TENSOR_FIELDS | _TENSOR_IGNORED_QUIETLY)
        spec: dict[str, Any] = {
            "name": tensor.name,
            "data_type": self.datatype(tensor.data_type),
            "dims": list(tensor.dims),
        }
        if isinstance(tensor, pb.ModelInput) and tensor.optional:
            spec["optional"] = True
        if isinstance(tensor, pb.ModelInput) and tensor.allow_ragged_batch:
            spec["allow_ragged_batch"] = True
        if tensor.HasField("reshape"):
            spec["reshape"] = list(tensor.reshape.shape)
        if isinstance(tensor, pb.ModelOutput) and tensor.label_filename:
            spec["label_filename"] = tensor.label_filename
        return spec

    def datatype(self, number: int) -> str | None:
        if number == pb.TYPE_INVALID:
            return None  # unset: the reader reports it missing
        return _enum_name(pb.DataType.DESCRIPTOR, number)

    def dynamic_batching(self, batching: pb.ModelDynamicBatching) -> dict[str, Any]:
        self.warn_unused(batching, "dynamic_batching", _BATCHING_FIELDS)
        out: dict[str, Any] = {
            "preferred_batch_sizes": list(batching.preferred_batch_size),
            "max_queue_delay_us": batching.max_queue_delay_microseconds,
            "default_priority_level": batching.default_priority_level,
        }
        if batching.HasField("default_queue_policy"):
            policy = batching.default_queue_policy
            field = "dynamic_batching.default_queue_policy"
            self.warn_unused(policy, field, _QUEUE_POLICY_FIELDS)
            if policy.max_queue_size:  # Triton's 0 is "unbounded": keep ours
                out["max_queue_size"] = policy.max_queue_size
            out["default_timeout_us"] = policy.default_timeout_microseconds
        if batching.priority_levels:  # Triton's 0 is "no priorities"
            out["priority_levels"] = batching.priority_levels
        return out

    def instance_group(self, group: pb.ModelInstanceGroup) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": _enum_name(pb.ModelInstanceGroup.Kind.DESCRIPTOR, group.kind)
        }
        if group.count:  # Triton's 0 (unset) is one instance
            out["count"] = group.count
        return out

    def version_policy(self, policy: pb.ModelVersionPolicy) -> dict[str, Any]:
        kind = policy.WhichOneof("policy_choice")
        if kind == "latest":
            count = policy.latest.num_versions  # Triton's 0 (unset) is one version
            return {"latest": {"num_versions": count} if count else {}}
        if kind == "specific":
            return {"specific": {"versions": list(policy.specific.versions)}}
        if kind == "all":
            return {"all": {}}
        return {}  # `version_policy { }`: the reader asks for one of them

    def warmup_sample(self, sample: pb.ModelWarmup, field: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "inputs": {
                key: self.warmup_kind(sample.inputs[key], f"{field}.inputs.{key}")
                for key in sorted(sample.inputs)
            }
        }
        if sample.name:
            out["name"] = sample.name
        if sample.batch_size:  # Triton's 0 (unset) is a batch of one
            out["batch_size"] = sample.batch_size
        if sample.count:  # Triton's 0 (unset) runs the sample once
            out["count"] = sample.count
        return out

    def warmup_kind(self, data: pb.ModelWarmup.Input, field: str) -> str:
        if data.random_data:
            return "random"
        if data.zero_data:
            return "zero"
        if data.HasField("input_data_file"):
            return f"file:{data.input_data_file}"  # in the model's warmup folder, as in Triton
        raise self.error(field, "give zero_data, random_data or input_data_file")

    def ensemble_step(self, step: pb.ModelEnsembling.Step, field: str) -> dict[str, Any]:
        self.warn_unused(step, field, _STEP_FIELDS)
        return {
            "model_name": step.model_name,
            "model_version": step.model_version,  # 0 or -1: the latest version
            "input_map": _sorted(step.input_map),
            "output_map": _sorted(step.output_map),
        }


def _sorted(mapping: Mapping[str, str]) -> dict[str, str]:
    """A protobuf map as a dict in key order (a map's own order is not the file's)."""
    return {key: mapping[key] for key in sorted(mapping)}
