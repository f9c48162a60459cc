"""The folders of models loaded from files sent in a load request (Triton's `file:` load
parameters, `protocol/repository_control.py`).

Each such load writes the files into a new folder of its own under the system's temporary
directory (`lockgate-<model>-...`), never into the repository, and the model is loaded from
there. The folder of a model's previous files-only load is removed once the new load is done
(its versions have been replaced by then; a file an old version still has open stays readable
until it closes), when the model is loaded from the repository again or unloaded, and at
shutdown. A load that fails removes its own folder, and the model loaded before serves on.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path


class ModelFiles:
    """The files-only folder each model is loaded from now, by model name."""

    def __init__(self) -> None:
        self.folders: dict[str, Path] = {}  # model -> its folder's parent (the temporary root)

    @staticmethod
    def write(name: str, files: Mapping[str, bytes]) -> Path:
        """A new folder holding `files` (paths checked by `repository_control.file_path`) as
        the model `name`'s folder; returns that model folder. Blocking: call it off the loop."""
        root = Path(tempfile.mkdtemp(prefix=f"lockgate-{name}-"))
        folder = root / name
        try:
            for relative, contents in files.items():
                path = folder / relative
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(contents)
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return folder

    def loaded(self, name: str, folder: Path | None) -> Path | None:
        """`name` now serves from `folder` (a `write` result, or None: the repository); the
        folder it served from before, to remove, if that was a files-only one."""
        before = self.folders.pop(name, None)
        if folder is not None:
            self.folders[name] = folder.parent
        return before

    def unloaded(self, name: str) -> Path | None:
        return self.folders.pop(name, None)

    def close(self) -> list[Path]:
        roots, self.folders = list(self.folders.values()), {}
        return roots


def remove(root: Path | None) -> None:
    """Remove a files-only model's folder (blocking)."""
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
