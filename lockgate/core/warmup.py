"""The data warmup runs a model on, and the data its service-time profile is measured on.

Each input of a warmup sample is `zero`, `random` or `file:<name>`: the raw data of one row
in the file `<model folder>/warmup/<name>`, in the form of Triton's `input_data_file`
(row-major, little-endian; a BYTES element is a 4-byte little-endian length and its bytes),
repeated for every row of the sample. Synthetic text is three words; a text model's real
inputs can cost ten times as much, so a file of a typical input lets warmup measure T(B) as
traffic will see it: the profile is measured on the first sample that gives a file, and on
random data otherwise.

A stateful model's batches also hold its control inputs and its implicit state, as rows that
hold no request (`sequence_batcher.idle_inputs`).
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from lockgate.config import ModelConfig, TensorSpec, WarmupSample
from lockgate.core.sequence_batcher import idle_inputs
from lockgate.datatypes import Arrays, numpy_dtype
from lockgate.errors import ConfigError

FILE_PREFIX = "file:"
WARMUP_FOLDER = "warmup"
SYNTHETIC_TEXT = b"lockgate warmup text"


def synthetic_input(spec: TensorSpec, rows: int, batching: bool, kind: str = "zero") -> np.ndarray:
    """`rows` rows of zeros or random values (BYTES: short text) for one input."""
    shape = ((rows,) if batching else ()) + _row_shape(spec)
    if spec.datatype == "BYTES":
        return np.full(shape, SYNTHETIC_TEXT, dtype=object)
    dtype = numpy_dtype(spec.datatype)
    if kind == "random":
        rng = np.random.default_rng(0)
        return rng.random(shape).astype(dtype)
    return np.zeros(shape, dtype=dtype)


def synthetic_batch(config: ModelConfig, rows: int, kind: str = "zero") -> Arrays:
    batch = {
        spec.name: synthetic_input(spec, rows, config.batching, kind)
        for spec in config.inputs
        if not spec.optional
    }
    return {**batch, **idle_inputs(config, rows)}


def sample_batch(config: ModelConfig, folder: Path, sample: WarmupSample, rows: int) -> Arrays:
    """`rows` rows of a warmup sample's inputs; an input it does not name is zeros."""
    batch: Arrays = {}
    for spec in config.inputs:
        kind = sample.inputs.get(spec.name)
        if kind is None and spec.optional:
            continue
        kind = kind or "zero"
        if kind.startswith(FILE_PREFIX):
            row = read_row(spec, folder / WARMUP_FOLDER / kind.removeprefix(FILE_PREFIX))
            batch[spec.name] = np.stack([row] * rows) if config.batching else row
        else:
            batch[spec.name] = synthetic_input(spec, rows, config.batching, kind)
    return {**batch, **idle_inputs(config, rows)}


def profile_sample(config: ModelConfig) -> WarmupSample | None:
    """The warmup sample the profile is measured on: the first that reads a file."""
    for sample in config.warmup:
        if any(kind.startswith(FILE_PREFIX) for kind in sample.inputs.values()):
            return sample
    return None


def read_row(spec: TensorSpec, path: Path) -> np.ndarray:
    """One row of `spec` from a file in Triton's `input_data_file` form."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), "warmup", f"cannot read the warmup file: {exc}") from exc
    shape = _row_shape(spec)
    count = int(np.prod(shape)) if shape else 1
    if spec.datatype == "BYTES":
        elements = _bytes_elements(data, count, path)
        return np.array(elements, dtype=object).reshape(shape)
    dtype = np.dtype(numpy_dtype(spec.datatype)).newbyteorder("<")
    if len(data) != count * dtype.itemsize:
        problem = f"{len(data)} bytes, expected {count} {spec.datatype} values for one row"
        raise ConfigError(str(path), "warmup", problem)
    return np.frombuffer(data, dtype=dtype).astype(dtype.newbyteorder("=")).reshape(shape)


def _bytes_elements(data: bytes, count: int, path: Path) -> list[bytes]:
    elements: list[bytes] = []
    at = 0
    while at < len(data) and len(elements) < count:
        if at + 4 > len(data):
            break
        (length,) = struct.unpack_from("<I", data, at)
        at += 4
        if at + length > len(data):
            break
        elements.append(data[at : at + length])
        at += length
    if len(elements) != count or at != len(data):
        problem = f"expected {count} BYTES elements, each a 4-byte length and its bytes"
        raise ConfigError(str(path), "warmup", problem)
    return elements


def _row_shape(spec: TensorSpec) -> tuple[int, ...]:
    return tuple(1 if d < 0 else d for d in spec.dims)
