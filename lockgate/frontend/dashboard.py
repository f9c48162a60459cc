"""The live dashboard at /dashboard: one static page, no build step. It polls /metrics and the
repository index from the browser and plots per-model rates, latency quantiles, queue depth,
batch sizes, refusals and, for language models, tokens/s, TTFT, TPOT and KV-cache use."""

from __future__ import annotations

import json
from functools import cache
from importlib import resources
from pathlib import Path

_SLOT = "/*LOCKGATE_SETTINGS*/ {}"


@cache
def _template() -> str:
    return resources.files("lockgate.frontend").joinpath("dashboard.html").read_text("utf-8")


def dashboard_page(model_control: str, repository: Path | None) -> bytes:
    """The page, told whether load and unload are served and which models the repository
    holds (so unloaded ones can be loaded again)."""
    names: list[str] = []
    if model_control == "explicit" and repository is not None and repository.is_dir():
        names = sorted(
            p.name for p in repository.iterdir() if p.is_dir() and not p.name.startswith(".")
        )
    settings = {"modelControl": model_control, "repositoryModels": names}
    # "</" cannot close the script: model names are folder names, escaped anyway
    text = json.dumps(settings).replace("</", "<\\/")
    return _template().replace(_SLOT, text, 1).encode()
