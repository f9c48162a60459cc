"""The model repository on disk: one folder per model, one numbered folder per version.

    <root>/<model>/config.yaml        (or config.pbtxt)
    <root>/<model>/<version>/<file>   (model.onnx, model.joblib, model.py, model.pt, ...)

`scan_repository` reads every model folder. A model whose config is wrong is reported
with its error and does not stop the others. Model names must be safe path components,
hidden folders are skipped, and nothing may resolve (through symlinks) outside the root.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from lockgate.backends.base import autocomplete, model_file
from lockgate.config import ModelConfig
from lockgate.core.config_files import has_model_config, load_model_config
from lockgate.core.config_reader import check_warmup_inputs
from lockgate.core.config_triton import parse_json_config
from lockgate.errors import ConfigError

log = logging.getLogger(__name__)

_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
_VERSION_NAME = re.compile(r"[1-9][0-9]{0,17}")  # ASCII digits only, as Triton reads them


@dataclass(slots=True)
class ModelEntry:
    """One model folder: its config and the versions its policy selects (newest first)."""

    name: str
    path: Path
    config: ModelConfig | None = None
    versions: list[int] = field(default_factory=list)
    error: str | None = None
    bare: bool = False  # one model file (`core/bare_model.py`): `path` is its folder

    @property
    def ok(self) -> bool:
        return self.error is None and self.config is not None


def is_safe_name(name: str) -> bool:
    """A model name that is one plain path component: no `..`, no separator, not hidden."""
    return _SAFE_NAME.fullmatch(name) is not None and ".." not in name


def is_model_folder(folder: Path) -> bool:
    """A folder with a config file or a numbered version folder: a repository's model."""
    if not folder.is_dir():
        return False
    if has_model_config(folder):
        return True
    return any(_VERSION_NAME.fullmatch(c.name) and c.is_dir() for c in folder.iterdir())


def scan_repository(root: Path) -> list[ModelEntry]:
    """Every model folder under `root`, sorted by name. Raises ConfigError if root is no folder."""
    if not root.is_dir():
        raise ConfigError(str(root), "repository", "not a directory")
    resolved_root = root.resolve()
    entries = []
    for folder in sorted(root.iterdir(), key=lambda p: p.name):
        if folder.name.startswith("."):
            log.debug("repository %s: skipping hidden %s", root, folder.name)
            continue
        if not folder.is_dir():
            continue
        entries.append(scan_model(resolved_root, folder))
    return entries


def model_names(root: Path) -> list[str]:
    """The names of the repository's model folders, sorted, without reading their configs
    (a folder that cannot be listed: none)."""
    try:
        folders = list(root.iterdir())
    except OSError:
        return []
    return sorted(
        f.name
        for f in folders
        if not f.name.startswith(".") and is_safe_name(f.name) and f.is_dir()
    )


def scan_model(resolved_root: Path, folder: Path, config_json: str | None = None) -> ModelEntry:
    """Read one model folder. Problems become the entry's `error`, never an exception.
    `config_json`: a config in Triton's JSON form that replaces the folder's (a load request's
    override), taking the folder config's backend when it names none."""
    entry = ModelEntry(name=folder.name, path=folder)
    try:
        _check_inside(resolved_root, folder, "model folder")
        if not is_safe_name(folder.name):
            raise ConfigError(str(folder), "name", f"unsafe model name {folder.name!r}")
        if config_json is None:
            config = load_model_config(folder)
        else:
            config = _override(folder, config_json)
        available = _version_folders(resolved_root, folder)
        entry.versions = config.version_policy.select(available)
        if not entry.versions:
            raise ConfigError(str(folder), "version_policy", _no_versions(available))
        entry.config = _complete(config, folder / str(entry.versions[0]))
    except ConfigError as exc:
        entry.error = str(exc)
        entry.versions = []
        log.error("model %s: %s", folder.name, entry.error)
    except (
        Exception,
        RecursionError,
    ) as exc:  # a config nested too deep, a parser bug: this model only
        entry.error = f"{folder}: cannot read the model's config: {type(exc).__name__}: {exc}"[
            :2000
        ]
        entry.versions = []
        entry.config = None
        log.error("model %s: %s", folder.name, entry.error)
    return entry


def _override(folder: Path, config_json: str) -> ModelConfig:
    try:
        backend = load_model_config(folder).backend
    except ConfigError:
        backend = ""  # the folder's own config is broken: the override must name one
    where = f"{folder} (the load request's config)"
    return parse_json_config(config_json, path=where, folder=folder.name, backend=backend)


def _check_inside(resolved_root: Path, path: Path, what: str) -> Path:
    resolved = path.resolve()
    if resolved != resolved_root and not resolved.is_relative_to(resolved_root):
        raise ConfigError(str(path), "path", f"{what} resolves outside the repository")
    return resolved


def _version_folders(resolved_root: Path, folder: Path) -> list[int]:
    """Subfolders named by a positive number, without a leading zero (other names, `0` and
    `01` among them, are ignored, as Triton does: `01` was a second folder of version 1)."""
    versions = []
    for child in folder.iterdir():
        if _VERSION_NAME.fullmatch(child.name) and child.is_dir():
            _check_inside(resolved_root, child, f"version folder {child.name}")
            versions.append(int(child.name))
    return versions


def _no_versions(available: list[int]) -> str:
    if not available:
        return "no numbered version folder (e.g. 1/) holds the model"
    listed = ", ".join(str(v) for v in sorted(available))
    return f"the policy selects none of the available versions ({listed})"


def _complete(config: ModelConfig, version_dir: Path) -> ModelConfig:
    """Fill an ONNX model's inputs and outputs from the file when the config omits them."""
    config = autocomplete(config, version_dir)
    check_warmup_inputs(config)
    return config


def resolve_model_file(root: Path, entry: ModelEntry, version: int) -> Path:
    """The model file of one served version of `entry`, checked to stay inside `root`."""
    if entry.config is None:
        raise ConfigError(str(entry.path), "config", entry.error or "the model has no config")
    if version not in entry.versions:
        served = ", ".join(str(v) for v in entry.versions) or "none"
        raise ConfigError(entry.config.source, "version", f"{version} is not served ({served})")
    resolved_root = root.resolve()
    version_dir = _check_inside(resolved_root, root / entry.name / str(version), "version folder")
    return model_file(entry.config, version_dir)
