"""A Python file of a model folder, imported as a module of its own: a Python model's
`model.py`, a cascade's rule. Like a pickle, such a file is code: serve only repositories you
trust."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from lockgate.backends import pb_utils
from lockgate.errors import BackendError, ConfigError


def import_file(path: Path, module_name: str) -> ModuleType:
    """Import a Python file of the model folder under `module_name`."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(str(path), "model", "cannot import this file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickling look classes up here
    # a Triton Python model imports Triton's utilities under this name (`backends/pb_utils.py`)
    sys.modules.setdefault("triton_python_backend_utils", pb_utils)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise BackendError(f"{path}: import failed: {type(exc).__name__}: {exc}") from exc
    return module
