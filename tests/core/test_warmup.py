"""Warmup data: synthetic, or one row read from a file in Triton's input_data_file form."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from lockgate.config import ModelConfig, TensorSpec, WarmupSample
from lockgate.core.config_files import parse_yaml_config
from lockgate.core.config_triton import parse_pbtxt_config
from lockgate.core.warmup import profile_sample, read_row, sample_batch
from lockgate.errors import ConfigError


def text_file(path: Path, *texts: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(struct.pack("<I", len(t)) + t for t in texts))
    return path


def test_a_bytes_row_and_a_numeric_row_are_read_as_triton_writes_them(tmp_path: Path) -> None:
    row = read_row(TensorSpec("text", "BYTES", (1,)), text_file(tmp_path / "s.bin", b"a sentence"))
    assert row.tolist() == [b"a sentence"]
    numbers = tmp_path / "x.bin"
    numbers.write_bytes(np.arange(4, dtype="<f4").tobytes())
    assert read_row(TensorSpec("x", "FP32", (2, 2)), numbers).tolist() == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
    ("data", "spec"),
    [
        (struct.pack("<I", 10) + b"short", TensorSpec("t", "BYTES", (1,))),  # cut short
        (struct.pack("<I", 1) + b"a" + b"junk", TensorSpec("t", "BYTES", (1,))),  # extra bytes
        (np.zeros(3, dtype="<f4").tobytes(), TensorSpec("x", "FP32", (4,))),  # too few values
    ],
)
def test_a_file_that_is_not_one_row_fails_the_load(
    tmp_path: Path, data: bytes, spec: TensorSpec
) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(data)
    with pytest.raises(ConfigError, match="warmup"):
        read_row(spec, path)


def test_a_sample_repeats_its_row_and_the_profile_measures_on_it(tmp_path: Path) -> None:
    text_file(tmp_path / "warmup" / "s.bin", b"a typical sentence")
    config = parse_yaml_config(
        "backend: python\nmax_batch_size: 8\n"
        "inputs: [{name: text, datatype: BYTES, dims: [1]}, {name: n, datatype: FP32, dims: [2]}]\n"
        "outputs: [{name: y, datatype: FP32, dims: [1]}]\n"
        "warmup: [{name: a, inputs: {text: zero}}, {name: b, inputs: {text: 'file:s.bin'}}]\n",
        path="config.yaml",
        folder="m",
    )
    sample = profile_sample(config)
    assert sample is not None and sample.name == "b"
    batch = sample_batch(config, tmp_path, sample, 3)
    assert batch["text"].tolist() == [[b"a typical sentence"]] * 3
    assert batch["n"].shape == (3, 2) and not batch["n"].any()  # not named: zeros
    plain = ModelConfig("m", "python", 8, config.inputs, warmup=(WarmupSample("z"),))
    assert profile_sample(plain) is None


def test_config_files_name_a_warmup_file(tmp_path: Path) -> None:
    pbtxt = (
        'backend: "python" max_batch_size: 8 '
        'input { name: "text" data_type: TYPE_STRING dims: [1] } '
        'output { name: "y" data_type: TYPE_FP32 dims: [1] } '
        'model_warmup { name: "w" batch_size: 4 '
        'inputs { key: "text" value { data_type: TYPE_STRING dims: [1] '
        'input_data_file: "s.bin" } } }'
    )
    config = parse_pbtxt_config(pbtxt, path="config.pbtxt", folder="m")
    assert config.warmup[0].inputs == {"text": "file:s.bin"}
    with pytest.raises(ConfigError, match="a file name in the model's warmup folder"):
        parse_yaml_config(
            "backend: python\ninputs: [{name: text, datatype: BYTES, dims: [1]}]\n"
            "warmup: [{name: w, inputs: {text: 'file:../x'}}]\n",
            path="config.yaml",
            folder="m",
        )
