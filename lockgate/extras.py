"""Optional dependencies, installed as pip extras, and the error that names the one to add.

`pip install lockgate` serves ONNX models. Everything else is an extra:
`pip install 'lockgate[llm]'` for language models, `[sklearn]`, `[torch]`, `[bench]` for the
load generator and plots, `[redis]` for the shared response cache, `[otel]` for OpenTelemetry
tracing, `[demo]` to build the demo repository, `[all]` for everything.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# extra -> the top-level modules it brings
EXTRAS: dict[str, tuple[str, ...]] = {
    "llm": ("torch", "gguf", "tokenizers", "jinja2", "safetensors", "llguidance"),
    "sklearn": ("sklearn", "joblib", "scipy"),
    "torch": ("torch",),
    "bench": ("aiohttp", "matplotlib"),
    "redis": ("redis",),
    "otel": ("opentelemetry",),
    "demo": ("sklearn", "skl2onnx", "onnx", "tokenizers"),
}


class MissingExtra(ImportError):
    """A feature needs an optional dependency that is not installed."""

    def __init__(self, feature: str, extra: str, module: str) -> None:
        self.feature = feature
        self.extra = extra
        super().__init__(
            f"{feature} needs the Python package '{module}', which is not installed: "
            f"pip install 'lockgate[{extra}]'",
            name=module,
        )


def missing_from(exc: ImportError, extra: str, feature: str) -> MissingExtra | None:
    """`exc` as a MissingExtra when it is the absence of one of `extra`'s modules, else None."""
    if isinstance(exc, MissingExtra):
        return exc
    top = (exc.name or "").split(".")[0]
    if isinstance(exc, ModuleNotFoundError) and top in EXTRAS[extra]:
        return MissingExtra(feature, extra, top)
    return None


def import_for(module: str, extra: str, feature: str) -> ModuleType:
    """Import `module`, turning the absence of a dependency from `extra` into MissingExtra."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        missing = missing_from(exc, extra, feature)
        if missing is None:
            raise
        raise missing from exc
