"""A bare model: one model file served as a repository of one model, version 1.

    lockgate serve ./digits.onnx                     # a file: the model `digits`
    lockgate serve /mnt/models --model-name digits   # a folder that holds one model file

This is what KServe's storage initializer leaves in /mnt/models when an InferenceService's
`storageUri` names a model rather than a repository. `find_bare_model` tells the two apart: a
folder is a repository when one of its subfolders is a model folder (a config file or a
numbered version folder); otherwise it must hold exactly one model file (.onnx, .joblib,
.pkl, .pt, .pt2). `bare_entry` builds the repository's one entry in memory; nothing is
written into the folder, which may be read-only (as /mnt/models is).

The config is the `config.yaml` or `config.pbtxt` beside the file, as written; or MLServer's
`model-settings.json` beside it (`config_mlserver.py`); or none. The backend's autocomplete
fills the inputs and outputs that the model file tells (an ONNX graph's signature, a
scikit-learn estimator's features and prediction). Without a config file, when every input
and output then starts with a dynamic dimension, that dimension is the batch: the model is
batched, up to `DEFAULT_MAX_BATCH_SIZE` rows (or model-settings.json's `max_batch_size`).
A model file whose backend cannot tell its inputs (TorchScript) needs a config beside it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

from lockgate.backends.base import autocomplete, file_backend, model_file_suffixes, spec_of
from lockgate.config import DynamicBatching, ModelConfig, TensorSpec
from lockgate.core.config_files import CONFIG_FILENAMES, has_model_config, load_model_config
from lockgate.core.config_mlserver import MODEL_SETTINGS, read_model_settings
from lockgate.core.config_reader import check_warmup_inputs
from lockgate.core.repository import ModelEntry, is_model_folder, is_safe_name
from lockgate.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_MAX_BATCH_SIZE = 64  # rows of a batch when no config file sets max_batch_size
_LISTED = 8  # names of what a folder holds, in the message that refuses it


@dataclass(frozen=True, slots=True)
class BareModel:
    """The model file (links followed), the name it is served under, and the backend its
    name calls for (a link's name: the file it leads to may be named by a hash)."""

    name: str
    file: Path
    backend: str

    @property
    def folder(self) -> Path:
        """Where the configs beside the file are read, and its version folder."""
        return self.file.parent

    def watched(self) -> list[Path]:
        """What poll mode watches: the model file and the config files beside it."""
        beside = (*CONFIG_FILENAMES, MODEL_SETTINGS)
        return [self.file, *(self.folder / name for name in beside)]


def find_bare_model(
    path: Path, name: str | None = None, empty_ok: bool = False
) -> BareModel | None:
    """The bare model at `path` (a model file, or a folder holding one), served as `name`
    (default: the file's stem or the folder's name); None when `path` is a model repository.
    `empty_ok`: a folder that holds no model is an empty repository (models may be loaded
    into it later), not an error. Raises ConfigError saying what was found and what is
    expected."""
    if path.is_file():
        return _checked(path, name or path.stem, path.resolve())
    if not path.is_dir():
        raise ConfigError(str(path), "repository", "no such file or folder")
    children = sorted((c for c in path.iterdir() if not c.name.startswith(".")), key=str)
    if any(is_model_folder(child) for child in children):
        return None
    files = [c for c in children if file_backend(c.name) is not None and c.is_file()]
    if len(files) == 1:
        return _checked(files[0], name or path.resolve().name, files[0].resolve())
    if not files and empty_ok and not is_model_folder(path):
        return None
    raise ConfigError(str(path), "repository", _neither(path, children, files))


def _neither(path: Path, children: list[Path], files: list[Path]) -> str:
    if files:
        names = ", ".join(f.name for f in files[:_LISTED])
        return (
            f"holds {len(files)} model files ({names}): serve one of them "
            f"(lockgate serve {files[0]}), or make a repository of them"
        )
    if is_model_folder(path):
        return "is one model's folder (a config and version folders): serve its parent folder"
    found = ", ".join(c.name + ("/" if c.is_dir() else "") for c in children[:_LISTED])
    return (
        f"holds {found or 'nothing'}; expected a model repository (<model>/config.yaml and "
        f"<model>/1/model.onnx) or one model file ({', '.join(model_file_suffixes())})"
    )


def _checked(path: Path, name: str, file: Path) -> BareModel:
    backend = file_backend(path.name)
    if backend is None:
        suffixes = ", ".join(model_file_suffixes())
        problem = f"not a model file: lockgate serves a {suffixes} file or a model repository"
        raise ConfigError(str(path), "model file", problem)
    if not is_safe_name(name):
        problem = f"{name!r} is not a model name (letters, digits, _ . -): give --model-name"
        raise ConfigError(str(path), "name", problem)
    bare = BareModel(name, file, backend)
    if not spec_of(bare.backend).autocomplete and not has_model_config(bare.folder):
        problem = (
            f"the {bare.backend} backend cannot read a model's inputs and outputs from its "
            f"file: put a config.yaml beside {path.name} that declares them, e.g.\n"
            f"  backend: {bare.backend}\n  max_batch_size: 64\n"
            "  inputs: [{name: input, datatype: FP32, dims: [3, 224, 224]}]\n"
            "  outputs: [{name: output, datatype: FP32, dims: [1000]}]"
        )
        raise ConfigError(str(bare.folder / "config.yaml"), "config", problem)
    return bare


def bare_entry(bare: BareModel) -> ModelEntry:
    """The repository entry of a bare model: its config, version 1. Problems become the
    entry's `error`, as a repository's model folder's do."""
    entry = ModelEntry(name=bare.name, path=bare.folder, bare=True)
    try:
        entry.config = _config(bare)
        entry.versions = [1]
    except ConfigError as exc:
        entry.error = str(exc)
    except Exception as exc:  # a parser or a backend's bug: reported, as for a repository
        entry.error = f"{bare.file}: cannot read the model: {type(exc).__name__}: {exc}"[:2000]
    if entry.error:
        log.error("model %s: %s", bare.name, entry.error)
    return entry


def _config(bare: BareModel) -> ModelConfig:
    folder, file_name = bare.folder, bare.file.name
    if has_model_config(folder):  # as written: batched as it says
        config = load_model_config(folder, name=bare.name)
        config = autocomplete(replace(config, default_model_filename=file_name), folder)
        check_warmup_inputs(config)
        return config
    rows, delay = DEFAULT_MAX_BATCH_SIZE, None
    settings_path = folder / MODEL_SETTINGS
    if settings_path.is_file():
        settings = read_model_settings(settings_path, name=bare.name, backend=bare.backend)
        config = settings.config
        rows = settings.max_batch_size or rows
        delay = settings.max_queue_delay_us
    else:
        config = ModelConfig(name=bare.name, backend=bare.backend, source=str(bare.file))
    config = autocomplete(replace(config, default_model_filename=file_name), folder)
    if not config.inputs:
        problem = f"cannot tell the model's inputs from {file_name}: declare them in a config.yaml"
        raise ConfigError(str(folder / "config.yaml"), "inputs", problem)
    return _batched(config, rows, delay)


def _batched(config: ModelConfig, rows: int, delay_us: int | None) -> ModelConfig:
    """The config batched up to `rows` when every tensor's first dimension is dynamic, that
    dimension taken out of `dims`; as it is otherwise."""
    tensors = (*config.inputs, *config.outputs)
    if any(not spec.dims or spec.dims[0] != -1 for spec in tensors):
        return config
    batching = None if delay_us is None else DynamicBatching(max_queue_delay_us=delay_us)
    return replace(
        config,
        max_batch_size=rows,
        inputs=_unbatched(config.inputs),
        outputs=_unbatched(config.outputs),
        dynamic_batching=batching,
    )


def _unbatched(specs: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    return tuple(replace(spec, dims=spec.dims[1:]) for spec in specs)
