"""The one small protocol every runtime implements, and the registry of runtimes."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from lockgate.config import ModelConfig
from lockgate.datatypes import Arrays
from lockgate.errors import BackendError, ConfigError, ServingError
from lockgate.extras import import_for


class Backend(Protocol):
    """A loaded model instance. `infer` runs on a runner thread and should release the GIL."""

    def infer(self, inputs: Arrays) -> Arrays:
        """Run one batch: named arrays in (batch first when batching), named arrays out."""
        ...

    def close(self) -> None: ...


class BatchedRequest(Protocol):
    """One client's request in a batch, as a backend that takes each request on its own
    reads it (core's `InferRequest` is one)."""

    @property
    def inputs(self) -> Arrays: ...
    @property
    def id(self) -> str: ...
    @property
    def parameters(self) -> Mapping[str, object]: ...
    @property
    def outputs(self) -> tuple[str, ...] | None:  # the outputs it asks for; None: all
        ...
    @property
    def correlation_id(self) -> int | str:  # its sequence's id; 0: none
        ...
    @property
    def flags(self) -> int:  # Triton's sequence start (1) and end (2) flags
        ...


@dataclass(frozen=True, slots=True)
class RequestView:
    """A `BatchedRequest` with other inputs (the model's shapes, where the client's differ)."""

    inputs: Arrays
    id: str
    parameters: Mapping[str, object]
    outputs: tuple[str, ...] | None
    correlation_id: int | str
    flags: int

    @staticmethod
    def of(request: BatchedRequest, inputs: Arrays) -> RequestView:
        return RequestView(
            inputs,
            request.id,
            request.parameters,
            request.outputs,
            request.correlation_id,
            request.flags,
        )


Answer = Arrays | ServingError
"""What a backend gives one request of a batch: its outputs, or its own error."""


class RequestBackend(Backend, Protocol):
    """A backend that takes a batch as its client requests, each with its own tensors and
    parameters, and answers each on its own (a Triton Python model's `execute(requests)`),
    rather than as one set of merged arrays. It says so with `per_request = True`; the
    batcher then hands it the requests and never merges or splits their tensors."""

    per_request: bool

    def infer_requests(self, requests: Sequence[BatchedRequest]) -> list[Answer]:
        """One answer per request, in order; an error fails only its own request."""
        ...


class ModelService(Protocol):
    """A model that schedules its own work (a language model's engine) instead of a
    `Backend` behind the dynamic batcher. The model manager loads, drains and closes it. One
    that answers each request with a stream of responses is a `StreamingService`
    (`backends/response_stream.py`)."""

    async def drain(self, timeout: float) -> bool:
        """Refuse new work and wait up to `timeout` s for admitted work; True if it all ended."""
        ...

    def close(self) -> None: ...


class InferContext(Protocol):
    """What a composition (an ensemble step, a cascade stage, a Python model that calls other
    models) uses to run a model: through that model's batcher, within the caller's deadline."""

    @property
    def request(self) -> BatchedRequest:
        """The request the composition runs for: its id, parameters and sequence."""
        ...

    async def infer(self, model: str, inputs: Arrays, version: int | None = None) -> Arrays: ...


BackendFactory = Callable[[ModelConfig, Path], Backend]
"""Build a backend from its config and its version folder (`<repo>/<model>/<version>`)."""
ModelServiceFactory = Callable[[ModelConfig, Path], ModelService | None]
"""None: the backend serves this model behind the batcher after all (a synchronous Python
model, where the backend also serves compositions)."""


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """What the repository needs to know of a runtime before it loads it.

    `load` and `autocomplete` name "module:function" and are imported only when used, so
    a runtime's libraries (torch, onnxruntime, ...) load only for the models that use it.
    """

    name: str
    aliases: tuple[str, ...] = ()
    platform: str = ""  # Triton's `platform` name, e.g. onnxruntime_onnx
    file_names: tuple[str, ...] = ()  # the model file when the config names none, by preference
    load: str = ""  # -> BackendFactory: instances behind the batcher
    autocomplete: str = ""  # completes the config from the model file (inputs and outputs)
    service: str = ""  # -> ModelServiceFactory: a model with its own scheduler, no batcher
    extra: str = ""  # the pip extra that installs the runtime's libraries ("" when core)


LLM_BACKEND = "llm"  # causal language models: served by the LLM engine, not by a Backend
SPECS: tuple[BackendSpec, ...] = (
    BackendSpec(
        "onnxruntime",
        ("onnx",),
        "onnxruntime_onnx",
        ("model.onnx",),
        "lockgate.backends.onnx:load",
        "lockgate.backends.onnx:autocomplete",
    ),
    BackendSpec(
        "sklearn",
        (),
        "",
        ("model.joblib", "model.pkl"),
        "lockgate.backends.sklearn:load",
        "lockgate.backends.sklearn:autocomplete",
        extra="sklearn",
    ),
    BackendSpec(
        "python",
        (),
        "",
        ("model.py",),
        "lockgate.backends.python:load",
        "lockgate.backends.triton_python:autocomplete",
        service="lockgate.backends.python:load_composition",
    ),
    BackendSpec(
        "pytorch",
        ("torch",),
        "pytorch_libtorch",
        ("model.pt", "model.pt2"),
        "lockgate.backends.torch:load",
        extra="torch",
    ),
    BackendSpec("ensemble", (), "ensemble", service="lockgate.compose.ensemble:Ensemble.load"),
    BackendSpec("cascade", service="lockgate.compose.cascade:Cascade.load"),
    BackendSpec(LLM_BACKEND, service="lockgate.llm.startup:load_service", extra="llm"),
)
_BY_NAME = {name: spec for spec in SPECS for name in (spec.name, *spec.aliases)}


def backend_names() -> list[str]:
    return sorted(_BY_NAME)


def platforms() -> dict[str, str]:
    """Triton's `platform` names of the runtimes lockgate has -> the backend that serves them."""
    return {spec.platform: spec.name for spec in SPECS if spec.platform}


def spec_of(name: str) -> BackendSpec:
    """The spec of a backend by its name or an alias; KeyError when unknown."""
    return _BY_NAME[name]


def _resolve(spec: BackendSpec, target: str) -> Any:
    module_name, path = target.split(":")
    if spec.extra:
        found: Any = import_for(module_name, spec.extra, f"the {spec.name} backend")
    else:
        found = importlib.import_module(module_name)
    for attr in path.split("."):
        found = getattr(found, attr)
    return found


def get_factory(name: str) -> BackendFactory:
    spec = spec_of(name)
    factory: BackendFactory = _resolve(spec, spec.load)
    return factory


def get_service_factory(name: str) -> ModelServiceFactory | None:
    """The loader of a backend that serves through its own scheduler, or None."""
    spec = spec_of(name)
    if not spec.service:
        return None
    factory: ModelServiceFactory = _resolve(spec, spec.service)
    return factory


def file_backend(filename: str) -> str | None:
    """The backend that serves a model file named `filename` by its suffix (`digits.onnx`:
    onnxruntime), or None. A Python file is code, not a model file: it is served only from a
    repository's version folder."""
    suffix = Path(filename).suffix
    for spec in SPECS:
        if suffix != ".py" and any(Path(name).suffix == suffix for name in spec.file_names):
            return spec.name
    return None


def model_file_suffixes() -> tuple[str, ...]:
    """The suffixes `file_backend` knows, for messages: .onnx, .joblib, ..."""
    names = (name for spec in SPECS for name in spec.file_names)
    return tuple(Path(name).suffix for name in names if not name.endswith(".py"))


def autocomplete(config: ModelConfig, version_dir: Path) -> ModelConfig:
    """The config with what the backend reads from the model file: inputs and outputs the
    config omits (an ONNX graph's signature, an estimator's features and prediction), or
    what a Triton Python model's `auto_complete_config` sets."""
    spec = _BY_NAME.get(config.backend)
    if spec is None or not spec.autocomplete:
        return config
    complete: Callable[[ModelConfig, Path], ModelConfig] = _resolve(spec, spec.autocomplete)
    return complete(config, version_dir)


def model_file(config: ModelConfig, version_dir: Path) -> Path:
    """The model file inside `version_dir`; refuses a file that resolves outside it."""
    names: tuple[str, ...] = (
        (config.default_model_filename,) if config.default_model_filename else ()
    )
    spec = _BY_NAME.get(config.backend)
    names = names or (spec.file_names if spec else ())
    for name in names:
        candidate = version_dir / name
        if candidate.exists():
            resolved = candidate.resolve()
            if not resolved.is_relative_to(version_dir.resolve()):
                problem = f"{candidate} resolves outside its version folder"
                raise ConfigError(config.source, "default_model_filename", problem)
            return resolved
    wanted = " or ".join(names) or "a model file"
    raise ConfigError(config.source, "default_model_filename", f"{version_dir} holds no {wanted}")


def checked_outputs(outputs: Any, model: str, expected: list[str]) -> Arrays:
    """What a user's infer() returned, as named arrays; BackendError when it is not that."""
    if not isinstance(outputs, dict):
        kind = type(outputs).__name__
        raise BackendError(f"model '{model}': infer() returned {kind}, not a dict")
    checked: Arrays = {}
    for name, value in outputs.items():
        if not isinstance(name, str):
            raise BackendError(f"model '{model}': output name {name!r} is not a string")
        checked[name] = value if isinstance(value, np.ndarray) else np.asarray(value)
    for name in expected:
        if name not in checked:
            raise BackendError(f"model '{model}': infer() returned no output '{name}'")
    return checked
