from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from lockgate.compose.ensemble import Ensemble
from lockgate.config import EnsembleStep, ModelConfig, TensorSpec
from lockgate.datatypes import Arrays
from lockgate.errors import ConfigError


def ensemble(*steps: EnsembleStep, outputs: tuple[str, ...] = ("out",)) -> ModelConfig:
    return ModelConfig(
        name="e",
        backend="ensemble",
        inputs=(TensorSpec("x", "FP32", (1,)),),
        outputs=tuple(TensorSpec(o, "FP32", (1,)) for o in outputs),
        ensemble=steps,
    )


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> EnsembleStep:
    return EnsembleStep(model, None, inputs, outputs)


class Recorder:
    """An InferContext whose models add their name's length; records the call order."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def infer(self, model: str, inputs: Arrays, version: int | None = None) -> Arrays:
        self.calls.append(model)
        total = sum(inputs.values())
        return {"y": np.asarray(total + len(model), dtype=np.float32)}


def test_steps_run_in_dependency_order_whatever_the_listing_order() -> None:
    config = ensemble(
        step("ccc", {"a": "t1", "b": "t2"}, {"y": "out"}),
        step("a", {"x": "x"}, {"y": "t1"}),
        step("bb", {"x": "x"}, {"y": "t2"}),
    )
    graph = Ensemble.load(config, Path("."))
    assert [[s.model for s in wave] for wave in graph.waves] == [["a", "bb"], ["ccc"]]
    ctx = Recorder()
    out = asyncio.run(graph.run({"x": np.float32(1)}, ctx))
    assert ctx.calls[-1] == "ccc" and float(out["out"]) == (1 + 1) + (1 + 2) + 3


@pytest.mark.parametrize(
    ("steps", "problem"),
    [
        ((step("a", {"x": "nowhere"}, {"y": "out"}),), "neither an ensemble input"),
        ((step("a", {"x": "x"}, {"y": "t"}),), "produced by no step"),
        ((step("a", {"x": "x"}, {"y": "out"}), step("b", {"x": "x"}, {"y": "out"})), "twice"),
        ((step("a", {"x": "t2"}, {"y": "t1"}), step("b", {"x": "t1"}, {"y": "t2"})), "cycle"),
    ],
)
def test_bad_graphs_are_config_errors(steps: tuple[EnsembleStep, ...], problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        Ensemble.load(ensemble(*steps), Path("."))
