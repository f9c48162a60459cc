"""Cascades: a cheap model answers first, and only the rows it is unsure of go on to a larger
model. Confidence is the largest value in the row of `confidence_output` (a probability
vector), or whatever the `rule` function decides."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lockgate.backends.base import InferContext
from lockgate.backends.user_module import import_file
from lockgate.config import CascadeConfig, ModelConfig
from lockgate.datatypes import Arrays
from lockgate.errors import BackendError, ConfigError

Rule = Callable[[Arrays, Arrays], object]
"""(inputs, outputs) of the rows at one stage -> a bool per row: True sends it on."""


@dataclass(frozen=True, slots=True)
class CascadeResult:
    outputs: Arrays
    rows_per_stage: tuple[int, ...]  # rows answered by each model, cheapest first


@dataclass(frozen=True, slots=True)
class Cascade:
    name: str
    config: CascadeConfig
    batching: bool
    rule: Rule | None

    @classmethod
    def load(cls, config: ModelConfig, version_dir: Path) -> Cascade:
        source = config.source or config.name
        cascade = config.cascade
        if cascade is None:
            raise ConfigError(source, "cascade", "a cascade model needs a `cascade` section")
        rule = _load_rule(cascade.rule, version_dir, config.name, source) if cascade.rule else None
        return cls(config.name, cascade, config.batching, rule)

    async def run(self, inputs: Arrays, ctx: InferContext) -> CascadeResult:
        models = self.config.models
        outputs = {k: np.array(v) for k, v in (await ctx.infer(models[0], inputs)).items()}
        rows = _rows(inputs, outputs, self.batching)
        pending = np.arange(rows)  # rows still answered by the current stage, by index
        answered: list[int] = []
        for stage, model in enumerate(models[1:], start=1):
            sub_in = _take(inputs, pending, self.batching)
            sub_out = _take(outputs, pending, self.batching)
            escalate = self._escalate(sub_in, sub_out, len(pending))
            answered.append(int((~escalate).sum()))
            pending = pending[escalate]
            if len(pending) == 0:
                break
            more = await ctx.infer(model, _take(inputs, pending, self.batching))
            _put(outputs, more, pending, self.batching, self.name, model)
            if stage == len(models) - 1:
                answered.append(len(pending))
        return CascadeResult(outputs, tuple(answered))

    def _escalate(self, inputs: Arrays, outputs: Arrays, rows: int) -> np.ndarray:
        if self.rule is not None:
            decided = np.asarray(self.rule(inputs, outputs), dtype=bool).reshape(-1)
        else:
            name = self.config.confidence_output
            if name not in outputs:
                raise BackendError(f"cascade '{self.name}': no output '{name}' to judge by")
            scores = np.asarray(outputs[name], dtype=np.float64).reshape(rows, -1)
            decided = scores.max(axis=1) < self.config.threshold
        if decided.shape != (rows,):
            raise BackendError(
                f"cascade '{self.name}': the rule gave {decided.shape[0]} decisions for {rows} rows"
            )
        return decided

    async def drain(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        pass


def _rows(inputs: Arrays, outputs: Arrays, batching: bool) -> int:
    if not batching:
        return 1
    return int(next(iter(inputs.values())).shape[0]) if inputs else 1


def _take(arrays: Arrays, rows: np.ndarray, batching: bool) -> Arrays:
    if not batching:
        return arrays
    return {name: array[rows] for name, array in arrays.items()}


def _put(
    outputs: Arrays, more: Arrays, rows: np.ndarray, batching: bool, name: str, model: str
) -> None:
    for key in outputs:
        if key not in more:
            raise BackendError(f"cascade '{name}': model '{model}' returned no output '{key}'")
        if batching:
            outputs[key][rows] = more[key]
        else:
            outputs[key] = np.array(more[key])


def _load_rule(target: str, version_dir: Path, model: str, source: str) -> Rule:
    file_name, _, function = target.partition(":")
    path = (version_dir / file_name).resolve()
    if not function or not path.is_relative_to(version_dir.resolve()) or not path.is_file():
        problem = f"expected 'file.py:function' inside {version_dir}, got {target!r}"
        raise ConfigError(source, "cascade.rule", problem)
    safe = re.sub(r"\W", "_", model)
    module = import_file(path, f"lockgate_cascade_rule_{safe}")
    rule = getattr(module, function, None)
    if not callable(rule):
        raise ConfigError(source, "cascade.rule", f"{file_name} has no function '{function}'")
    return rule  # type: ignore[no-any-return]
