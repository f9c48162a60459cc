"""The one small protocol every runtime implements, and the registry of runtimes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from lockgate.config import ModelConfig
from lockgate.datatypes import Arrays


class Backend(Protocol):
    """A loaded model instance. `infer` runs on a runner thread and should release the GIL."""

    def infer(self, inputs: Arrays) -> Arrays:
        """Run one batch: named arrays in (batch first when batching), named arrays out."""
        ...

    def close(self) -> None: ...


BackendFactory = Callable[[ModelConfig, Path], Backend]
"""Build a backend from its config and its version folder (`<repo>/<model>/<version>`)."""

_REGISTRY: dict[str, str] = {
    # backend name -> "module:factory". Imported lazily so torch is loaded only when used.
    "onnxruntime": "lockgate.backends.onnx:load",
    "onnx": "lockgate.backends.onnx:load",
    "sklearn": "lockgate.backends.sklearn:load",
    "python": "lockgate.backends.python:load",
    "pytorch": "lockgate.backends.torch:load",
    "torch": "lockgate.backends.torch:load",
}


LLM_BACKEND = "llm"  # causal language models: served by the LLM engine, not by a Backend


def backend_names() -> list[str]:
    return sorted([*_REGISTRY, LLM_BACKEND])


def get_factory(name: str) -> BackendFactory:
    import importlib

    target = _REGISTRY.get(name)
    if target is None:
        raise KeyError(name)
    module_name, attr = target.split(":")
    factory: BackendFactory = getattr(importlib.import_module(module_name), attr)
    return factory
