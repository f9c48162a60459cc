"""A model folder's config file: `config.yaml`, or Triton's `config.pbtxt` when there is none.

YAML is parsed here and Triton's format in `config_triton.py`; both end in the one reader of
`config_reader.py`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import yaml

from lockgate.config import (
    ModelConfig,
)
from lockgate.core.config_reader import config_from_dict
from lockgate.core.config_triton import parse_pbtxt_config, read_pbtxt
from lockgate.errors import ConfigError

CONFIG_FILENAMES = ("config.yaml", "config.pbtxt")


def has_model_config(model_dir: Path) -> bool:
    return any((model_dir / filename).is_file() for filename in CONFIG_FILENAMES)


def load_model_config(model_dir: Path, name: str | None = None) -> ModelConfig:
    """Read `<model_dir>/config.yaml`, or `config.pbtxt` when there is no YAML file.
    `name`: the model's name when it is not the folder's (a bare model's config, beside its
    file); a name the file declares yields to it."""
    for filename in CONFIG_FILENAMES:
        path = model_dir / filename
        if path.is_file():
            text = _read_text(path)
            yaml_file = filename.endswith(".yaml")
            parse = parse_yaml_config if yaml_file else parse_pbtxt_config
            if name is None:
                return parse(text, path=str(path), folder=model_dir.name)
            declared = _declared_name(text, str(path), yaml_file)
            return replace(parse(text, path=str(path), folder=declared or name), name=name)
    raise ConfigError(str(model_dir), "config", "no config.yaml or config.pbtxt")


def _declared_name(text: str, path: str, yaml_file: bool) -> str:
    """The `name` a config file declares ("": none, or a file the parser will refuse)."""
    if not yaml_file:
        return read_pbtxt(text, path=path).name
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError:
        return ""
    declared = raw.get("name") if isinstance(raw, dict) else None
    return declared if isinstance(declared, str) else ""


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(str(path), "file", f"cannot read: {exc}") from exc


def parse_yaml_config(text: str, *, path: str, folder: str) -> ModelConfig:
    """Parse the text of a `config.yaml` for the model in folder `folder`."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(path, "yaml", f"syntax error at {where}{problem}") from exc
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(path, "config", "the file must hold a mapping of settings")
    return config_from_dict(raw, path=path, folder=folder)
