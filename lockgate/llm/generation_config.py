"""A language model's sampling defaults: the values its `generation_config.json` sets (as vLLM
does with `--generation-config auto`), used for the fields a request leaves out; the OpenAI
API's defaults for the fields the file does not set.

Read once at load. Of the file's keys only the sampling values lockgate's engine implements
are read (`repetition_penalty` among them, as vLLM reads it); the others (`do_sample`,
`max_new_tokens`, token ids) are ignored, as vLLM ignores them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockgate.errors import ConfigError

FILE_NAME = "generation_config.json"
_FIELDS: tuple[tuple[str, type], ...] = (
    ("temperature", float),
    ("top_p", float),
    ("top_k", int),
    ("min_p", float),
    ("repetition_penalty", float),
)


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling values for a request that gives none. The defaults are the OpenAI API's."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    source: str = ""  # the generation_config.json they were read from; "": none

    def __post_init__(self) -> None:
        checks = [
            ("temperature", math.isfinite(self.temperature) and self.temperature >= 0, ">= 0"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("top_k", self.top_k >= -1, "-1, 0 (off) or a positive count"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("repetition_penalty", 0.0 < self.repetition_penalty <= 10.0, "in (0, 10]"),
        ]
        for name, ok, expected in checks:
            if not ok:
                value = getattr(self, name)
                raise ConfigError(
                    self.source or FILE_NAME, name, f"must be {expected}, got {value}"
                )

    def fill(
        self,
        temperature: float | None,
        top_p: float | None,
        top_k: int | None,
        min_p: float | None,
        repetition_penalty: float | None = None,
    ) -> dict[str, Any]:
        """`SamplingParams` keyword arguments: each value a request gave (not None), else
        this default. A value the request gave is checked by `SamplingParams`, not here."""
        given = {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "repetition_penalty": repetition_penalty,
        }
        return {name: getattr(self, name) if v is None else v for name, v in given.items()}

    def to_dict(self) -> dict[str, float | int]:
        """The values, for clients to see (without the file's path)."""
        return {name: getattr(self, name) for name, _ in _FIELDS}


def read_generation_defaults(folder: Path) -> GenerationDefaults:
    """The defaults of `folder/generation_config.json`; the OpenAI API's when there is none."""
    path = folder / FILE_NAME
    if not path.is_file():
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "<file>", f"invalid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "<file>", "must be a JSON object")
    values: dict[str, Any] = {
        name: _number(path, name, raw[name], kind)
        for name, kind in _FIELDS
        if raw.get(name) is not None  # null: not set
    }
    return GenerationDefaults(**values, source=str(path))


def _number(path: Path, name: str, value: Any, kind: type) -> float | int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(str(path), name, f"must be a number, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise ConfigError(str(path), name, f"must be an integer, got {value!r}")
        return int(value)
    try:
        return float(value)
    except OverflowError:
        raise ConfigError(str(path), name, f"out of range: {value}") from None
