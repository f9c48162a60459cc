"""Triton's ensembles: a graph of model steps joined by named tensors.

Each step maps its model's inputs from ensemble tensors (`input_map`: step input -> tensor)
and its outputs to new ensemble tensors (`output_map`: step output -> tensor). Steps run as
soon as their inputs exist, independent steps at the same time, each through its model's own
batcher.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from lockgate.backends.base import InferContext
from lockgate.config import EnsembleStep, ModelConfig
from lockgate.datatypes import Arrays
from lockgate.errors import BackendError, ConfigError


@dataclass(frozen=True, slots=True)
class Ensemble:
    name: str
    waves: tuple[tuple[EnsembleStep, ...], ...]  # steps that can run together, in order
    outputs: tuple[str, ...]

    @classmethod
    def load(cls, config: ModelConfig, version_dir: Path) -> Ensemble:
        """Check the graph: every step input is produced before it is needed, no tensor is
        produced twice, and every ensemble output is produced."""
        return cls(config.name, _waves(config), tuple(s.name for s in config.outputs))

    async def run(self, inputs: Arrays, ctx: InferContext) -> Arrays:
        tensors: Arrays = dict(inputs)
        for wave in self.waves:
            results = await asyncio.gather(*(self._step(step, tensors, ctx) for step in wave))
            for produced in results:
                tensors.update(produced)
        return {name: tensors[name] for name in self.outputs if name in tensors}

    async def _step(self, step: EnsembleStep, tensors: Arrays, ctx: InferContext) -> Arrays:
        inputs = {model_input: tensors[t] for model_input, t in step.input_map.items()}
        outputs = await ctx.infer(step.model, inputs, step.version)
        produced: Arrays = {}
        for model_output, tensor in step.output_map.items():
            if model_output not in outputs:
                raise BackendError(
                    f"ensemble '{self.name}': step model '{step.model}' returned no output "
                    f"'{model_output}'"
                )
            produced[tensor] = outputs[model_output]
        return produced

    async def drain(self, timeout: float) -> bool:
        return True  # holds no requests of its own: its steps' batchers drain them

    def close(self) -> None:
        pass


def _waves(config: ModelConfig) -> tuple[tuple[EnsembleStep, ...], ...]:
    source = config.source or config.name
    if not config.ensemble:
        raise ConfigError(source, "ensemble_scheduling", "an ensemble needs at least one step")
    producer: dict[str, int] = {}
    for index, step in enumerate(config.ensemble):
        for tensor in step.output_map.values():
            if tensor in producer or config.input(tensor) is not None:
                problem = f"tensor '{tensor}' is produced twice"
                raise ConfigError(source, f"ensemble_scheduling.step[{index}]", problem)
            producer[tensor] = index
    level: dict[int, int] = {}

    def depth(index: int, path: tuple[int, ...]) -> int:
        if index in path:
            raise ConfigError(source, "ensemble_scheduling", "the steps form a cycle")
        if index not in level:
            needs = config.ensemble[index].input_map.values()
            level[index] = 1 + max(
                (depth(producer[t], (*path, index)) for t in needs if t in producer), default=-1
            )
        return level[index]

    for index, step in enumerate(config.ensemble):
        for tensor in step.input_map.values():
            if tensor not in producer and config.input(tensor) is None:
                problem = f"input tensor '{tensor}' is neither an ensemble input nor produced"
                raise ConfigError(source, f"ensemble_scheduling.step[{index}]", problem)
        depth(index, ())
    for spec in config.outputs:
        if spec.name not in producer:
            problem = f"ensemble output '{spec.name}' is produced by no step"
            raise ConfigError(source, "ensemble_scheduling", problem)
    waves = [[] for _ in range(max(level.values()) + 1)]  # type: list[list[EnsembleStep]]
    for index, step in enumerate(config.ensemble):
        waves[level[index]].append(step)
    return tuple(tuple(wave) for wave in waves)
