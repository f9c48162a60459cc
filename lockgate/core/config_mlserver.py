"""MLServer's `model-settings.json`, beside a bare model file, read into a model config.

    {"name": "iris", "implementation": "mlserver_sklearn.SKLearnModel",
     "parameters": {"uri": "./model.joblib", "version": "v0.1.0"},
     "inputs": [{"name": "input-0", "datatype": "FP64", "shape": [-1, 4]}],
     "outputs": [{"name": "predict", "datatype": "INT64", "shape": [-1]}],
     "max_batch_size": 32, "max_batch_time": 0.01}

lockgate reads `inputs` and `outputs` (each `shape` in full, the batch dimension first, as
MLServer writes it), `max_batch_size` (the rows of a batch, when every shape starts with -1)
and `max_batch_time` (seconds a batch may wait to fill). The model's name and file are
lockgate's own (`--model-name`, the one model file of the folder); the other fields
(implementation, parameters, parallel_workers, ...) are MLServer's and are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockgate.config import ModelConfig
from lockgate.core.config_reader import config_from_dict
from lockgate.errors import ConfigError

MODEL_SETTINGS = "model-settings.json"
MAX_SETTINGS_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """The config (shapes in full, not batched yet) and how MLServer asked to batch it."""

    config: ModelConfig
    max_batch_size: int  # 0: not given
    max_queue_delay_us: int | None  # None: not given


def read_model_settings(path: Path, *, name: str, backend: str) -> ModelSettings:
    """The `model-settings.json` at `path` for the model `name` of `backend`. Raises
    ConfigError naming the file and the field."""
    source = str(path)
    raw = _load(path)
    config_raw: dict[str, Any] = {"backend": backend}
    for key in ("inputs", "outputs"):
        tensors = raw.get(key, [])
        if not isinstance(tensors, list):
            raise ConfigError(source, key, f"expected a list, got {type(tensors).__name__}")
        config_raw[key] = [_tensor(item, source, f"{key}[{i}]") for i, item in enumerate(tensors)]
    config = config_from_dict(config_raw, path=source, folder=name)
    return ModelSettings(config, _batch_size(raw, source), _batch_time(raw, source))


def _load(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > MAX_SETTINGS_BYTES:
            raise ConfigError(str(path), "file", f"larger than {MAX_SETTINGS_BYTES} bytes")
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(str(path), "file", f"cannot read: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "settings", "the file must hold a JSON object")
    return raw


def _tensor(item: Any, source: str, field: str) -> dict[str, Any]:
    """One of MLServer's tensor metadata as a config tensor: `shape` becomes `dims`."""
    if not isinstance(item, dict):
        raise ConfigError(source, field, f"expected an object, got {type(item).__name__}")
    tensor = {"name": item.get("name"), "datatype": item.get("datatype")}
    if "shape" in item:
        tensor["dims"] = item["shape"]
    return tensor


def _batch_size(raw: dict[str, Any], source: str) -> int:
    value = raw.get("max_batch_size", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(source, "max_batch_size", f"expected an integer >= 0, got {value!r}")
    return value if value > 1 else 0  # MLServer's 0 and 1 turn its batching off: not given


def _batch_time(raw: dict[str, Any], source: str) -> int | None:
    value = raw.get("max_batch_time")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 60:
        raise ConfigError(source, "max_batch_time", f"expected seconds in [0, 60], got {value!r}")
    return round(value * 1_000_000)
