"""The C sources `llm/native.py` builds on first use ship with the package: an install that
is not editable has only the files pyproject.toml lists as package data, and a source or a
header missing there fails (or silently skips) its kernel on the user's machine."""

from __future__ import annotations

import tomllib
from pathlib import Path

import lockgate.llm

ROOT = Path(__file__).resolve().parents[2]


def test_every_c_source_and_header_of_the_llm_package_is_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    listed = set(config["tool"]["setuptools"]["package-data"]["lockgate.llm"])
    folder = Path(lockgate.llm.__file__).parent
    sources = {p.name for p in folder.iterdir() if p.suffix in (".c", ".h")}
    assert {"decode_attention.c", "prefill_attention.c", "bf16.h"} <= sources
    assert sources - listed == set(), "C files the package would not ship"
    assert listed - sources == set(), "package data that no longer exists"
