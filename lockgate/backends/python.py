"""The Python backend: a model written as a plain class in `<version>/model.py`.

    class Model:
        def load(self, config: ModelConfig, version_dir: Path) -> None: ...   # optional
        def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...
        def close(self) -> None: ...                                          # optional

`parameters.class_name` names another class. The file is imported under a module name of
its own for every instance, so two models (or two versions) never share module state.
An exception raised by the user's code becomes a BackendError that carries its message.
Like a pickle, `model.py` is code: serve only repositories you trust.
"""

from __future__ import annotations

import inspect
import itertools
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from lockgate.backends import triton_decoupled, triton_python
from lockgate.backends.base import Arrays, InferContext, checked_outputs, model_file
from lockgate.backends.user_module import import_file
from lockgate.config import ModelConfig
from lockgate.errors import BackendError, ConfigError, ServingError

_module_ids = itertools.count(1)


class PythonBackend:
    """An instance of the user's class; `infer` checks that it returns named arrays."""

    __slots__ = ("_expected", "_instance", "_model", "_module_name")

    def __init__(self, instance: Any, config: ModelConfig, module_name: str) -> None:
        self._instance = instance
        self._model = config.name
        self._module_name = module_name
        self._expected = [spec.name for spec in config.outputs if not spec.optional]

    def infer(self, inputs: Arrays) -> Arrays:
        try:
            outputs = self._instance.infer(inputs)
        except ServingError:
            raise  # the model chose the status (e.g. BadRequest for bad text)
        except Exception as exc:
            raise BackendError(f"model '{self._model}': {type(exc).__name__}: {exc}") from exc
        return checked_outputs(outputs, self._model, self._expected)

    def close(self) -> None:
        _close(self._instance, self._module_name)


class PythonComposition:
    """A model whose class defines `async def infer(self, inputs, ctx)`: it runs on the event
    loop, outside the batcher, and calls other models with `await ctx.infer(name, inputs)`
    (each through its own batcher). Keep heavy computation in the models it calls."""

    __slots__ = ("_expected", "_instance", "_model", "_module_name")

    def __init__(self, instance: Any, config: ModelConfig, module_name: str) -> None:
        self._instance = instance
        self._model = config.name
        self._module_name = module_name
        self._expected = [spec.name for spec in config.outputs if not spec.optional]

    async def run(self, inputs: Arrays, ctx: InferContext) -> Arrays:
        try:
            outputs = await self._instance.infer(inputs, ctx)
        except ServingError:
            raise
        except Exception as exc:
            raise BackendError(f"model '{self._model}': {type(exc).__name__}: {exc}") from exc
        return checked_outputs(outputs, self._model, self._expected)

    async def drain(self, timeout: float) -> bool:
        return True  # its requests wait in the models it calls, which drain them

    def close(self) -> None:
        _close(self._instance, self._module_name)


def load_composition(
    config: ModelConfig, version_dir: Path
) -> (
    PythonComposition
    | triton_python.TritonPythonComposition
    | triton_decoupled.TritonPythonDecoupled
    | None
):
    """The model as a composition when its `infer` is a coroutine function, or when it is a
    Triton Python model that calls other models; a decoupled Triton Python model as a
    stream of responses per request; else None (it is then loaded by `load`, behind the
    batcher)."""
    path = model_file(config, version_dir)
    module_name = _module_name(config.name, version_dir.name)
    module = import_file(path, module_name)
    cls = getattr(module, config.parameters.get("class_name", "Model"), None)
    if config.decoupled:
        if not _is_triton(module, cls, config):
            sys.modules.pop(module_name, None)
            problem = f"only a Triton Python model (TritonPythonModel in {path.name}) is decoupled"
            raise ConfigError(str(path), "model_transaction_policy.decoupled", problem)
        backend = _triton_model(module, config, version_dir, module_name)
        return triton_decoupled.TritonPythonDecoupled(backend, config)
    if _is_triton(module, cls, config):
        triton = module.TritonPythonModel
        if triton_python.calls_models(triton, path.read_text(errors="replace")):
            backend = _triton_model(module, config, version_dir, module_name)
            return triton_python.TritonPythonComposition(backend, config.instance_count)
    if not isinstance(cls, type) or not inspect.iscoroutinefunction(getattr(cls, "infer", None)):
        sys.modules.pop(module_name, None)
        return None
    return PythonComposition(_build(cls, config, version_dir, module_name), config, module_name)


def _is_triton(module: ModuleType, cls: Any, config: ModelConfig) -> bool:
    """A Triton Python model: `TritonPythonModel`, and no lockgate class asked for or found."""
    return (
        cls is None
        and "class_name" not in config.parameters
        and triton_python.is_triton_model(module)
    )


def load(
    config: ModelConfig, version_dir: Path
) -> PythonBackend | triton_python.TritonPythonBackend:
    """Import `model.py` from the version folder and build (and `load`) its model class: a
    lockgate `Model`, or Triton's `TritonPythonModel` (`backends/triton_python.py`)."""
    path = model_file(config, version_dir)
    module_name = _module_name(config.name, version_dir.name)
    module = import_file(path, module_name)
    class_name = config.parameters.get("class_name", "Model")
    cls = getattr(module, class_name, None)
    if _is_triton(module, cls, config):
        return _triton_model(module, config, version_dir, module_name)
    if not isinstance(cls, type):
        sys.modules.pop(module_name, None)
        raise ConfigError(
            str(path), "parameters.class_name", f"no class '{class_name}' in {path.name}"
        )
    if not callable(getattr(cls, "infer", None)):
        sys.modules.pop(module_name, None)
        raise ConfigError(
            str(path), "parameters.class_name", f"class '{class_name}' has no infer()"
        )
    return PythonBackend(_build(cls, config, version_dir, module_name), config, module_name)


def _triton_model(
    module: ModuleType, config: ModelConfig, version_dir: Path, module_name: str
) -> triton_python.TritonPythonBackend:
    try:
        backend = triton_python.load(module.TritonPythonModel, config, version_dir)
    except ServingError:
        sys.modules.pop(module_name, None)
        raise
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise BackendError(
            f"model '{config.name}': initialize failed: {type(exc).__name__}: {exc}"
        ) from exc
    backend.module_name = module_name
    return backend


def _build(cls: type, config: ModelConfig, version_dir: Path, module_name: str) -> Any:
    try:
        instance = cls()
        if callable(getattr(instance, "load", None)):
            instance.load(config, version_dir)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise BackendError(
            f"model '{config.name}': load failed: {type(exc).__name__}: {exc}"
        ) from exc
    return instance


def _close(instance: Any, module_name: str) -> None:
    close = getattr(instance, "close", None)
    try:
        if callable(close):
            close()
    finally:
        sys.modules.pop(module_name, None)


def _module_name(model: str, version: str) -> str:
    safe = re.sub(r"\W", "_", f"{model}_{version}")
    return f"lockgate_user_model_{safe}_{next(_module_ids)}"
