"""Checking a request's tensors against the model config, before it is queued.

With `max_batch_size > 0` every input carries a leading batch dim that the config's `dims`
leave out; all inputs must agree on it, and it may not exceed `max_batch_size`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from lockgate.config import ModelConfig, TensorSpec
from lockgate.errors import BadRequest


def validate_inputs(
    config: ModelConfig, inputs: dict[str, np.ndarray], datatypes: dict[str, str]
) -> int:
    """Check names, datatypes and shapes; return the number of batch rows (1 unbatched)."""
    return validate_shapes(config, {name: array.shape for name, array in inputs.items()}, datatypes)


def validate_shapes(
    config: ModelConfig, shapes: Mapping[str, tuple[int, ...]], datatypes: Mapping[str, str]
) -> int:
    """`validate_inputs` on what a request declares, before any data is decoded: names,
    datatypes and shapes; the number of batch rows (1 unbatched)."""
    rows: int | None = None
    first = ""
    for name, shape in shapes.items():
        spec = config.input(name)
        if spec is None:
            raise BadRequest(f"unexpected inference input '{name}' for model '{config.name}'")
        _check_datatype(config, spec, datatypes.get(name))
        _check_shape(config, spec, shape)
        if config.batching:
            if rows is not None and shape[0] != rows:
                raise BadRequest(
                    f"input '{name}': batch size {shape[0]} differs from "
                    f"input '{first}' with batch size {rows}"
                )
            rows, first = shape[0], name
    _check_required(config, shapes)
    return 1 if rows is None else rows


def validate_outputs(config: ModelConfig, names: Iterable[str]) -> None:
    """Every requested output must be one the model produces."""
    for name in names:
        if config.output(name) is None:
            raise BadRequest(f"unexpected inference output '{name}' for model '{config.name}'")


def expected_shape(config: ModelConfig, spec: TensorSpec) -> tuple[int, ...]:
    """The full shape of a tensor, -1 standing for the batch dim and any variable dim."""
    return (-1, *spec.dims) if config.batching else spec.dims


def _check_datatype(config: ModelConfig, spec: TensorSpec, datatype: str | None) -> None:
    if datatype != spec.datatype:
        raise BadRequest(
            f"input '{spec.name}': model '{config.name}' expects datatype "
            f"{spec.datatype}, got {datatype}"
        )


def _check_shape(config: ModelConfig, spec: TensorSpec, shape: tuple[int, ...]) -> None:
    expected = expected_shape(config, spec)
    fits = len(shape) == len(expected)
    if fits:
        for want, got in zip(expected, shape, strict=True):
            if want != got and want != -1:
                fits = False
                break
    if not fits:
        raise BadRequest(
            f"input '{spec.name}': expected shape {_dims(expected)}, got {_dims(shape)}"
        )
    if config.batching and not 1 <= shape[0] <= config.max_batch_size:
        raise BadRequest(
            f"input '{spec.name}': batch size {shape[0]} is outside 1..{config.max_batch_size} "
            f"for model '{config.name}'"
        )


def _check_required(config: ModelConfig, inputs: Mapping[str, object]) -> None:
    missing = [spec.name for spec in config.inputs if not spec.optional and spec.name not in inputs]
    if missing:
        raise BadRequest(
            f"model '{config.name}' is missing required input(s) {_names(missing)}; "
            f"got {_names(list(inputs))}"
        )


def _dims(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(dim) for dim in shape) + "]"


def _names(names: list[str]) -> str:
    return "[" + ", ".join(f"'{name}'" for name in names) + "]"
