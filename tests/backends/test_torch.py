from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lockgate.backends.torch import load
from lockgate.config import ModelConfig, TensorSpec
from lockgate.errors import BackendError, BadRequest, ConfigError


class Affine(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.linear(x) + shift  # [B, 2]
        return y, y.argmax(dim=1)


def config(outputs: tuple[str, ...] = ("y", "label"), **parameters: str) -> ModelConfig:
    return ModelConfig(
        name="affine",
        backend="pytorch",
        max_batch_size=8,
        inputs=(TensorSpec("x", "FP32", (4,)), TensorSpec("shift", "FP32", (2,))),
        outputs=tuple(TensorSpec(name, "FP32", (2,)) for name in outputs),
        parameters=parameters,
        source="affine/config.yaml",
    )


@pytest.fixture(scope="module")
def module() -> Affine:
    torch.manual_seed(0)
    return Affine().eval()


def inputs() -> dict[str, np.ndarray]:
    x = np.random.default_rng(0).random((3, 4), dtype=np.float32)
    return {"x": x, "shift": np.ones((3, 2), np.float32)}


def expected(module: Affine, arrays: dict[str, np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        return module(torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["shift"]))[0].numpy()


def test_torchscript(tmp_path: Path, module: Affine) -> None:
    torch.jit.save(torch.jit.script(module), str(tmp_path / "model.pt"))
    backend = load(config(), tmp_path)
    arrays = inputs()
    out = backend.infer(arrays)
    np.testing.assert_allclose(out["y"], expected(module, arrays), rtol=1e-6)
    np.testing.assert_array_equal(out["label"], out["y"].argmax(axis=1))
    backend.close()
    with pytest.raises(BackendError, match="closed"):
        backend.infer(arrays)


def test_read_only_inputs_are_accepted(tmp_path: Path, module: Affine) -> None:
    torch.jit.save(torch.jit.script(module), str(tmp_path / "model.pt"))
    arrays = inputs()
    readonly = np.frombuffer(arrays["x"].tobytes(), dtype=np.float32).reshape(3, 4)
    out = load(config(), tmp_path).infer({"x": readonly, "shift": arrays["shift"]})
    np.testing.assert_allclose(out["y"], expected(module, arrays), rtol=1e-6)


def test_exported_program(tmp_path: Path, module: Affine) -> None:
    arrays = inputs()
    example = (torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["shift"]))
    batch = torch.export.Dim("batch", min=1, max=8)
    program = torch.export.export(module, example, dynamic_shapes=({0: batch}, {0: batch}))
    torch.export.save(program, str(tmp_path / "model.pt2"))
    out = load(config(), tmp_path).infer(arrays)
    np.testing.assert_allclose(out["y"], expected(module, arrays), rtol=1e-5)


def test_errors(tmp_path: Path, module: Affine) -> None:
    torch.jit.save(torch.jit.script(module), str(tmp_path / "model.pt"))
    backend = load(config(), tmp_path)
    with pytest.raises(BadRequest, match="missing input 'shift'"):
        backend.infer({"x": inputs()["x"]})
    with pytest.raises(BackendError):
        backend.infer({"x": np.zeros((3, 5), np.float32), "shift": np.zeros((3, 2), np.float32)})
    with pytest.raises(BackendError, match="returned 2 outputs; the config declares 1"):
        load(config(outputs=("y",)), tmp_path).infer(inputs())
    with pytest.raises(ConfigError) as info:
        load(config(intra_op_threads="zero"), tmp_path)
    assert info.value.field == "parameters.intra_op_threads"
    (tmp_path / "model.pt").write_bytes(b"garbage")
    with pytest.raises(ConfigError, match="torch cannot load"):
        load(config(), tmp_path)
