"""The fingerprint of a loaded model version: what its answers depend on, hashed.

A version number alone does not say which model answers: a repository may replace
`1/model.onnx` and reload it as version 1 again. The response cache keys answers by the
fingerprint too, so a reloaded version never answers from what the model it replaced
computed, in the process or in Redis. The fingerprint depends only on the files' contents and
the config, never on paths or times, so replicas that serve the same files share entries.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path

from lockgate.config import ModelConfig

DIGEST_BYTES = 8  # 64 bits: tells versions of one model apart, in every cache key
_CHUNK = 1 << 20
_SKIPPED = frozenset({"__pycache__"})  # written by Python's import of a model.py


def version_fingerprint(config: ModelConfig, version_dir: Path, only: Path | None = None) -> str:
    """A hash of the config and of every file under the version folder (names and bytes), or
    of the one file `only` in it (a bare model's: its folder may hold anything else). Reads
    every file: call it on a worker thread."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(repr(replace(config, source="")).encode())
    for path in _files(version_dir) if only is None else [only]:
        name = path.relative_to(version_dir).as_posix().encode()
        h.update(len(name).to_bytes(8, "little") + name)
        h.update(path.stat().st_size.to_bytes(8, "little"))
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []  # a composition's version folder may be empty, or absent
    found = []
    for path in sorted(folder.iterdir()):
        if path.name in _SKIPPED:
            continue
        if path.is_dir():
            found += _files(path)
        elif path.is_file():
            found.append(path)
    return found
