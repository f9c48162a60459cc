"""The PyTorch backend: a TorchScript module (`model.pt`) or an exported program (`model.pt2`).

The module is called with the config's inputs as positional arguments, in the order the
config lists them. It may return one tensor, a tuple or list of tensors (named by the
config's outputs, in order) or a dict of tensors. With no outputs declared, results are
named `output__0`, `output__1`, ... as in Triton's PyTorch backend.

Settings (config `parameters`):
    intra_op_threads   calls torch.set_num_threads(n) at load. It is process-wide, so
                       set it only when this is the one torch model of the server.

Loading a TorchScript or exported file runs no Python code of its author, but serve only
repositories you trust all the same.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lockgate.backends.base import Arrays, model_file
from lockgate.config import ModelConfig
from lockgate.errors import BackendError, BadRequest, ConfigError


class TorchBackend:
    """A module run under `torch.inference_mode()`; torch releases the GIL in its kernels."""

    __slots__ = ("_input_names", "_model", "_module", "_output_names")

    def __init__(self, module: Callable[..., Any], config: ModelConfig) -> None:
        if not config.inputs:
            raise ConfigError(config.source, "inputs", "the pytorch backend needs declared inputs")
        self._module = module
        self._model = config.name
        self._input_names = [spec.name for spec in config.inputs]
        self._output_names = [spec.name for spec in config.outputs]

    def infer(self, inputs: Arrays) -> Arrays:
        args = [_tensor(self._model, name, inputs) for name in self._input_names]
        try:
            with torch.inference_mode():
                result = self._module(*args)
        except Exception as exc:
            raise BackendError(f"model '{self._model}': {type(exc).__name__}: {exc}") from exc
        return self._named(result)

    def _named(self, result: Any) -> Arrays:
        if isinstance(result, dict):
            return {str(name): _array(self._model, value) for name, value in result.items()}
        values = list(result) if isinstance(result, tuple | list) else [result]
        names = self._output_names or [f"output__{i}" for i in range(len(values))]
        if len(names) != len(values):
            raise BackendError(
                f"model '{self._model}' returned {len(values)} outputs; "
                f"the config declares {len(names)}"
            )
        return {name: _array(self._model, value) for name, value in zip(names, values, strict=True)}

    def close(self) -> None:
        self._module = _closed


def _closed(*args: Any) -> Any:
    raise BackendError("the model instance is closed")


def load(config: ModelConfig, version_dir: Path) -> TorchBackend:
    """Load `model.pt` with torch.jit.load or `model.pt2` with torch.export.load."""
    path = model_file(config, version_dir)
    threads = config.parameters.get("intra_op_threads")
    if threads is not None:
        torch.set_num_threads(_positive(config, "intra_op_threads", threads))
    try:
        module = _load_module(path)
    except Exception as exc:
        raise ConfigError(str(path), "model", f"torch cannot load the model: {exc}") from exc
    return TorchBackend(module, config)


def _load_module(path: Path) -> Callable[..., Any]:
    if path.suffix == ".pt2":
        program = torch.export.load(str(path))
        module: Callable[..., Any] = program.module()
        return module
    scripted = torch.jit.load(str(path), map_location="cpu")
    scripted.eval()
    return scripted


def _positive(config: ModelConfig, name: str, raw: str) -> int:
    if not raw.isdigit() or int(raw) < 1:
        raise ConfigError(
            config.source, f"parameters.{name}", f"expected an integer >= 1, got {raw!r}"
        )
    return int(raw)


def _tensor(model: str, name: str, inputs: Arrays) -> torch.Tensor:
    array = inputs.get(name)
    if array is None:
        raise BadRequest(f"model '{model}': missing input '{name}'")
    if array.dtype == np.object_:
        raise BadRequest(f"model '{model}': input '{name}': BYTES is not a torch tensor type")
    if not (array.flags.writeable and array.flags.c_contiguous):
        array = np.array(array, order="C")  # torch.from_numpy wants memory it may write
    return torch.from_numpy(array)


def _array(model: str, value: Any) -> np.ndarray:
    if not isinstance(value, torch.Tensor):
        raise BackendError(f"model '{model}' returned {type(value).__name__}, not a tensor")
    return value.detach().cpu().numpy()
