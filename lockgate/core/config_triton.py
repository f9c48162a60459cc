"""Triton's `config.pbtxt`, translated into the keys of `config.yaml` and validated by the one
reader (`config_reader.py`). Fields that Triton knows and lockgate does not use (optimization,
sequence_batching, ...) are ignored with a warning."""

from __future__ import annotations

import logging
from typing import Any

from lockgate.backends.base import platforms
from lockgate.config import (
    ModelConfig,
)
from lockgate.core import pbtxt
from lockgate.core.config_reader import config_from_dict
from lockgate.errors import ConfigError

log = logging.getLogger(__name__)

_PLATFORMS = platforms()  # Triton's `platform` names for the runtimes lockgate has


def parse_pbtxt_config(text: str, *, path: str, folder: str) -> ModelConfig:
    """Parse the text of a Triton `config.pbtxt` for the model in folder `folder`."""
    try:
        message = pbtxt.parse(text)
    except pbtxt.PbtxtSyntaxError as exc:
        raise ConfigError(path, "pbtxt", f"syntax error at line {exc.line}: {exc.problem}") from exc
    return config_from_dict(_TritonTranslator(path).translate(message), path=path, folder=folder)


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

    def _field_response_cache(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        cache = self.sub(self.one(message, "response_cache"), "response_cache")
        self.warn_unused(cache, "response_cache", frozenset({"enable"}))
        raw["response_cache"] = {"enable": cache.get("enable", False)}

    def _field_ensemble_scheduling(self, message: pbtxt.Message, raw: dict[str, Any]) -> None:
        scheduling = self.sub(self.one(message, "ensemble_scheduling"), "ensemble_scheduling")
        self.warn_unused(scheduling, "ensemble_scheduling", frozenset({"step"}))
        steps = []
        for index, value in enumerate(scheduling.values("step")):
            field = f"ensemble_scheduling.step[{index}]"
            step = self.sub(value, field)
            used = frozenset({"model_name", "model_version", "input_map", "output_map"})
            self.warn_unused(step, field, used)
            out: dict[str, Any] = {"model_name": step.get("model_name")}
            if "model_version" in step:
                out["model_version"] = step.get("model_version")
            for which in ("input_map", "output_map"):
                entries = [self.sub(v, f"{field}.{which}") for v in step.values(which)]
                out[which] = {str(e.get("key")): e.get("value") for e in entries}
            steps.append(out)
        raw["ensemble_scheduling"] = {"step": steps}

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
