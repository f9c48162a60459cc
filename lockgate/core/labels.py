"""Class names of outputs (Triton's `label_filename`), for classification answers.

Each output may name a file of the model folder holding one class name a line, for the
class indices 0, 1, ... A classification of that output then answers `value:index:label`,
as Triton does (`value:index` past the file's last line, or with no file).
"""

from __future__ import annotations

from pathlib import Path

from lockgate.config import ModelConfig
from lockgate.errors import ConfigError

MAX_LABEL_BYTES = 16 * 2**20  # a label file is names, not data


def read_labels(config: ModelConfig, folder: Path) -> dict[str, tuple[str, ...]]:
    """Output name -> its class names, for the outputs that name a label file in `folder`
    (the model folder). Raises ConfigError naming the output when a file cannot be read."""
    labels = {}
    for index, spec in enumerate(config.outputs):
        if not spec.label_filename:
            continue
        field = f"outputs[{index}].label_filename"
        path = folder / spec.label_filename
        try:
            if not path.resolve().is_relative_to(folder.resolve()):
                raise ConfigError(str(path), field, "resolves outside the model folder")
            if path.stat().st_size > MAX_LABEL_BYTES:
                raise ConfigError(str(path), field, f"larger than {MAX_LABEL_BYTES} bytes")
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(str(path), field, f"cannot read the label file: {exc}") from exc
        labels[spec.name] = tuple(text.splitlines())
    return labels
